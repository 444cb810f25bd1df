// The exact routing's RMSNorm for the presplit GEMM tiles (routing_split_sm90.cu's
// presplit_sm90). It computes rmsnorm_rows' xn, value for value, and writes it as the split
// GEMM's operands instead of float32: the fp16 hi parts [T, H], then the scaled residuals
// [T, H] (route_split.cuh's split_pair: the bytes every split tile makes of xn), which take the
// same bytes as xn did. Beside them, per token, the scale r = 1 / rms (so a consumer that needs
// float32 xn recomputes it as x * r * w, rmsnorm_rows' own expression and rounding, without a
// reduction) and the norm |xn|_2 of the re-rank bound (in this kernel's order of summation:
// the bound allows any, ExactBound's norm term). The GEMM then only copies and multiplies, and
// the experts' fp16 activations are the hi rows. One block of 256 threads per token; the
// finiteness flag as rmsnorm_rows reports it.
#include <cuda_fp16.h>

#include "common/route_split.cuh"
#include "common/row_norm.cuh"

extern "C" __global__ void __launch_bounds__(256) rmsnorm_split_rows(
    const float* __restrict__ x, const float* __restrict__ w, __half* __restrict__ parts,
    float* __restrict__ rscale, float* __restrict__ xnorm, int tokens, int hidden, float eps,
    unsigned long long* __restrict__ bad, int layer) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const float* row = x + (size_t)t * hidden;
    const float r = row_rms_scale(row, hidden, eps, scratch, bad, layer, t, true);
    unsigned* hi = reinterpret_cast<unsigned*>(parts + (size_t)t * hidden);
    unsigned* lo = reinterpret_cast<unsigned*>(parts + ((size_t)tokens + t) * hidden);
    float sq = 0.0f;
    for (int c = 2 * threadIdx.x; c < hidden; c += 2 * blockDim.x) {
        const float v0 = row[c] * r * w[c], v1 = row[c + 1] * r * w[c + 1];
        split_pair(v0, v1, hi[c / 2], lo[c / 2]);
        sq = fmaf(v0, v0, sq);
        sq = fmaf(v1, v1, sq);
    }
    sq = block_sum(sq, scratch);
    if (threadIdx.x == 0) {
        rscale[t] = r;
        xnorm[t] = sqrtf(sq);
    }
}
