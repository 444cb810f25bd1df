// The dense model's own small kernels beside the cuBLAS GEMMs
// (strata_rt/backends/cuda/dense/kernels.py): RMSNorm of float32 residual rows into fp16 GEMM
// operands, and the two helpers of the batch-invariant GEMM path (its row bounds and its epilogue).
//
// Every float operation carries an explicit rounding intrinsic (__fmul_rn, __fadd_rn, ...):
// nvcc may not contract those into FMAs, so the numpy twin (dense_kernels.rmsnorm_f16_reference)
// reproduces the bytes exactly, not within a tolerance.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/prior_grid.cuh"

#define DENSE_NORM_THREADS 256

// Sum over the block of one float per thread, in a fixed order: a butterfly (xor 16, 8, 4, 2,
// 1) inside each warp, then the same butterfly over the warp sums (padded with zeros to 32) in
// warp 0. Float addition is commutative, so every lane of a butterfly holds the same bits.
__device__ __forceinline__ float dense_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? scratch[lane] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) scratch[32] = v;
    }
    __syncthreads();
    return scratch[32];
}

// out[r, c] = fp16( (x[r, c] * inv) * w[c] ),  inv = 1 / sqrt(ss / hidden + eps)
// with ss the sum of x[r, c]^2: thread t adds the rounded squares of columns t, t + 256, ...
// in ascending order from 0, then dense_block_sum. x rows are row_stride floats apart; out rows
// are hidden halves apart. One block of DENSE_NORM_THREADS per row; a row's bytes depend on
// that row only.
extern "C" __global__ void __launch_bounds__(DENSE_NORM_THREADS)
dense_rmsnorm_f16(const float* __restrict__ x, const float* __restrict__ w,
                  __half* __restrict__ out, int hidden, int row_stride, float eps) {
    wait_prior_grid();
    __shared__ float scratch[33];
    const float* row = x + (size_t)blockIdx.x * row_stride;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < hidden; c += DENSE_NORM_THREADS)
        ss = __fadd_rn(ss, __fmul_rn(row[c], row[c]));
    ss = dense_block_sum(ss, scratch);
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)hidden), eps)));
    __half* o = out + (size_t)blockIdx.x * hidden;
    for (int c = threadIdx.x; c < hidden; c += DENSE_NORM_THREADS)
        o[c] = __float2half_rn(__fmul_rn(__fmul_rn(row[c], inv), w[c]));
}

// bounds = {0, rows}: the one-"expert" row bounds of the batch-invariant GEMM, written on the
// stream so a captured graph needs no host upload.
extern "C" __global__ void dense_set_bounds(int* __restrict__ bounds, int rows) {
    if (threadIdx.x == 0) {
        bounds[0] = 0;
        bounds[1] = rows;
    }
}

// The batch-invariant GEMM's epilogue over n float32 values of its scratch: mode 0 writes
// fp16(acc) to out (halves), mode 1 adds acc to out (floats) with one rounding. Element-wise,
// so each output's bytes depend on its own accumulator only.
extern "C" __global__ void dense_epilogue(const float* __restrict__ acc, void* __restrict__ out,
                                          long long n, int mode) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (mode == 0) {
        __half* o = static_cast<__half*>(out);
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
            o[i] = __float2half_rn(acc[i]);
    } else {
        float* o = static_cast<float*>(out);
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
            o[i] = __fadd_rn(o[i], acc[i]);
    }
}
