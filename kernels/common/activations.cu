// Activation encodings the MMQ kernels consume, rows picked through an index list so they
// come out sorted by expert. Grid: x = output row, y = groups of four 128-value blocks;
// 128 threads, one warp per 128-value block. x must be 16-byte aligned with x_stride % 4 == 0
// (the launcher checks).
#include <cuda_fp16.h>

#include "common/q8_1.cuh"

__device__ __forceinline__ const float4* act_row(const float* x, int x_stride, const int* index,
                                                 int row) {
    const long long src = index ? index[row] : row;
    return reinterpret_cast<const float4*>(x + src * (long long)x_stride);
}

extern "C" __global__ void __launch_bounds__(128)
quantize_q8_1_rows(const float* x, int x_stride, const int* index, char* out, int rows, int k) {
    const int row = blockIdx.x;
    const int kb = blockIdx.y * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows || kb * Q8_1_VALUES >= k) return;
    const float4 v = act_row(x, x_stride, index, row)[kb * 32 + lane];
    char* blk = out + ((long long)row * (k / Q8_1_VALUES) + kb) * Q8_1_BYTES;
    q8_1_quantize_warp128(v, lane, blk);
}

extern "C" __global__ void __launch_bounds__(128)
convert_f16_rows(const float* x, int x_stride, const int* index, __half* out, int rows, int k) {
    const int row = blockIdx.x;
    const int c4 = blockIdx.y * 128 + threadIdx.x;
    if (row >= rows || c4 * 4 >= k) return;
    const float4 v = act_row(x, x_stride, index, row)[c4];
    __half2* dst = reinterpret_cast<__half2*>(out + (long long)row * k) + c4 * 2;
    dst[0] = __halves2half2(__float2half_rn(v.x), __float2half_rn(v.y));
    dst[1] = __halves2half2(__float2half_rn(v.z), __float2half_rn(v.w));
}

// Rows index[0..rows-1] of fp16 x (row pitch x_stride halves) copied into out [rows, k]: the
// experts' fp16 activations where the exact routing's RMSNorm wrote xn's fp16 hi parts
// (routing_norm_split.cu), which are convert_f16_rows' bytes of xn. Same grid as the others.
extern "C" __global__ void __launch_bounds__(128)
gather_f16_rows(const __half* x, int x_stride, const int* index, __half* out, int rows, int k) {
    const int row = blockIdx.x;
    const int c8 = blockIdx.y * 128 + threadIdx.x;
    if (row >= rows || c8 * 8 >= k) return;
    const long long src = index ? index[row] : row;
    reinterpret_cast<uint4*>(out + (long long)row * k)[c8] =
        reinterpret_cast<const uint4*>(x + src * (long long)x_stride)[c8];
}
