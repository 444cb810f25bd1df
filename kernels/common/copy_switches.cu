// A routed walk's copy switches (plan.RouteCopies, runtime/conditional.py).
//
// Thread i sets the IF node of switched copy i: on when the layer's routing gave its expert
// rows (bounds[e + 1] > bounds[e], the same test GatherRouted skips by), off otherwise. Each
// handle is set by one thread; launched only inside a captured graph, whose IF nodes the
// handles name.

#include <cuda_runtime.h>

extern "C" __global__ void route_copies(const unsigned long long* __restrict__ handles,
                                        const int* __restrict__ experts,
                                        const int* __restrict__ bounds, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const int e = experts[i];
        cudaGraphSetConditional(handles[i], bounds[e + 1] > bounds[e] ? 1u : 0u);
    }
}
