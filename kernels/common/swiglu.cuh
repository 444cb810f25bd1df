// SwiGLU of one value pair, silu(gate) * up in float32: the engine's SwiGLU kernels (engine.cu)
// and the decode step's matrix-vector kernels (kernels/ggml/gemv.cuh) share it, so both paths
// round the same operations the same way (explicit round-to-nearest intrinsics: nvcc never
// contracts them into an FMA).
#pragma once

__device__ __forceinline__ float swiglu(float gate, float up) {
    return __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);
}
