// A dense F16 matrix times one token's fp16 row, one warp per output row: the decode step's
// projections and output head where the weights are stored as F16 (GgmlGemv.dense takes it in
// place of the tiled gemv_dense for that type). Why a warp per row: a matrix-vector product
// reads each weight once, so it runs at the rate its loads reach HBM; a row of 2,048 - 4,096
// halves is 8 - 16 16-byte loads a lane, all issued before the first is used, and the grid
// (a block per ROWS_WARPS rows) covers the GPU for any projection of a decode step. Nothing is
// staged or decoded: the products are fp16 x fp16 exact in float32, summed by each lane in
// ascending chunk order and then by the warp's xor tree, so a run's bytes are fixed.
//
// gemv_f16_rows(w, x, out, rows, k, mode): W fp16 [rows, k] row-major from w (16-byte aligned,
// k a multiple of 8), x fp16 [k] (16-byte aligned); mode 0: out fp16 [rows]; 1: out float32
// [rows]; 2: out float32 [rows] += the sum (one rounding: the o projection's residual add).
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/prior_grid.cuh"

#define ROWS_WARPS 4
// 16-byte loads a lane keeps in flight
#define ROWS_UNROLL 8

__device__ __forceinline__ float rows_dot8(const uint4 w, const uint4 x, float acc) {
    const __half2* wh = reinterpret_cast<const __half2*>(&w);
    const __half2* xh = reinterpret_cast<const __half2*>(&x);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 a = __half22float2(wh[i]), b = __half22float2(xh[i]);
        acc = __fmaf_rn(a.x, b.x, acc);
        acc = __fmaf_rn(a.y, b.y, acc);
    }
    return acc;
}

// Launched overlapped (prior_grid.cuh), it issues its first ROWS_UNROLL loads of weights before
// it waits for the grid before it: no kernel writes the weights (resident dense weights, or a
// streamed layer's dense slot, whose copy the stream waits for with an ordinary dependency), so
// the loads of the largest operand of a decode step's projection overlap the kernels before it.
// Everything else (x, out) is read and written after the wait.
extern "C" __global__ void __launch_bounds__(ROWS_WARPS * 32)
gemv_f16_rows(const __half* __restrict__ w, const __half* __restrict__ x, void* __restrict__ out,
              int rows, int k, int mode) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5);
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)min(row, rows - 1) * k);
    const int n = k / 8;  // 16-byte chunks of a row
    uint4 wv[ROWS_UNROLL];
    const bool early = lane + 32 * (ROWS_UNROLL - 1) < n;  // the first run of loads is whole
    if (early) {
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u) wv[u] = __ldcs(wr + lane + 32 * u);  // read once
    }
    wait_prior_grid();
    if (row >= rows) return;
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    float acc = 0.0f;
    int c = lane;
    for (bool loaded = early; c + 32 * (ROWS_UNROLL - 1) < n; c += 32 * ROWS_UNROLL) {
        if (!loaded) {
#pragma unroll
            for (int u = 0; u < ROWS_UNROLL; ++u) wv[u] = __ldcs(wr + c + 32 * u);
        }
        loaded = false;
#pragma unroll
        for (int u = 0; u < ROWS_UNROLL; ++u) acc = rows_dot8(wv[u], __ldg(xr + c + 32 * u), acc);
    }
    for (; c < n; c += 32) acc = rows_dot8(__ldcs(wr + c), __ldg(xr + c), acc);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (lane != 0) return;
    if (mode == 0) {
        static_cast<__half*>(out)[row] = __float2half_rn(acc);
    } else {
        float* o = static_cast<float*>(out) + row;
        *o = mode == 1 ? acc : __fadd_rn(*o, acc);
    }
}
