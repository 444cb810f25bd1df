// Attention of one query row per head (a decode step: T = 1 at position `start`) over the KV
// cache rows 0..start, split across the cache length (flash-decoding) so that a step uses the
// GPU rather than one block per KV head.
//
// decode_split_hd{HD}_g{G}: grid (n_kv, splits), DEC_WARPS warps. Block (h, s) takes the cache
//   rows of split s (ceil((start + 1) / splits) rows each, from row 0; a split past the end has
//   none) for the G query heads of KV head h. Warp w takes rows s0 + w, s0 + w + DEC_WARPS, ...;
//   lane l holds dims l * PL .. l * PL + PL - 1 (PL = HD / 32) of q, k and v in float32. A row's
//   score is the warp's xor-tree sum of the lanes' products; each warp keeps a running max m,
//   sum l and accumulator per head (float32, probabilities exp2((score - m) * scale_log2) kept
//   in float32), and the block merges its warps in a fixed order into `part` (float32
//   [n_heads, splits, HD + 2]: the accumulator, then m and l).
// decode_merge_hd{HD}: grid (n_heads), HD threads: out fp16 [n_heads * HD] = the splits merged
//   in ascending order (each weighed by exp2((m_s - max m) * scale_log2)), divided by their
//   sum.
// A run's bytes are a fixed function of q, the cache and the split count (no atomics). They are
// not those of attend_hd* (which rounds probabilities to fp16 for p.v): the tolerance is tested.
//
// start_dev (split kernel, last argument): when not null, the position is read from this device
// int instead of `start`, so one captured decode step replays at every position.
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common/prior_grid.cuh"

#define DEC_WARPS 4

template <int PL>
__device__ __forceinline__ void dec_load(const __half* __restrict__ p, float (&f)[PL]) {
    if constexpr (PL == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
    } else {
        static_assert(PL == 2, "hd 64 or 128");
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(p));
        f[0] = a.x; f[1] = a.y;
    }
}

template <int HD, int G>
__device__ __forceinline__ void decode_split(const __half* __restrict__ q,
                                             const __half* __restrict__ k_cache,
                                             const __half* __restrict__ v_cache,
                                             float* __restrict__ part, int start, int n_kv,
                                             float scale_log2) {
    constexpr int PL = HD / 32;
    __shared__ float sm_m[DEC_WARPS][G], sm_l[DEC_WARPS][G];
    __shared__ float sm_acc[DEC_WARPS][G][HD];
    const int kvh = blockIdx.x, s = blockIdx.y, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows = start + 1, per = (rows + splits - 1) / splits;
    const int r0 = s * per, r1 = min(rows, r0 + per);
    float qf[G][PL], m[G], l[G], acc[G][PL];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        dec_load<PL>(q + (size_t)(kvh * G + h) * HD + lane * PL, qf[h]);
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < PL; ++i) acc[h][i] = 0.0f;
    }
    for (int r = r0 + warp; r < r1; r += DEC_WARPS) {
        float kf[PL], vf[PL];
        const size_t at = ((size_t)r * n_kv + kvh) * HD + lane * PL;
        dec_load<PL>(k_cache + at, kf);
        dec_load<PL>(v_cache + at, vf);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < PL; ++i) d = fmaf(qf[h][i], kf[i], d);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            const float m_new = fmaxf(m[h], d);
            const float alpha = m_new == m[h] ? 1.0f : exp2f((m[h] - m_new) * scale_log2);
            const float p = exp2f((d - m_new) * scale_log2);
            l[h] = fmaf(l[h], alpha, p);
#pragma unroll
            for (int i = 0; i < PL; ++i) acc[h][i] = fmaf(acc[h][i], alpha, p * vf[i]);
            m[h] = m_new;
        }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (lane == 0) {
            sm_m[warp][h] = m[h];
            sm_l[warp][h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < PL; ++i) sm_acc[warp][h][lane * PL + i] = acc[h][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
        const int h = idx / HD, d = idx % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, sm_m[w][h]);
        float a = 0.0f, L = 0.0f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < DEC_WARPS; ++w) {
                if (sm_m[w][h] == -INFINITY) continue;  // a warp without rows adds nothing
                const float e = exp2f((sm_m[w][h] - M) * scale_log2);
                a = fmaf(e, sm_acc[w][h][d], a);
                L = fmaf(e, sm_l[w][h], L);
            }
        }
        float* dst = part + ((size_t)(kvh * G + h) * splits + s) * (HD + 2);
        dst[d] = a;
        if (d == 0) {
            dst[HD] = M;
            dst[HD + 1] = L;
        }
    }
}

template <int HD>
__device__ __forceinline__ void decode_merge(const float* __restrict__ part, int splits,
                                             float scale_log2, __half* __restrict__ out) {
    const int head = blockIdx.x, d = threadIdx.x;
    const float* p = part + (size_t)head * splits * (HD + 2);
    float M = -INFINITY;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * (HD + 2) + HD]);
    float a = 0.0f, L = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ms = p[s * (HD + 2) + HD];
        if (ms == -INFINITY) continue;  // a split past the cache's end
        const float e = exp2f((ms - M) * scale_log2);
        a = fmaf(e, p[s * (HD + 2) + d], a);
        L = fmaf(e, p[s * (HD + 2) + HD + 1], L);
    }
    out[(size_t)head * HD + d] = __float2half_rn(a / L);
}

#define DECODE_SPLIT_KERNEL(HD, G)                                                             \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) decode_split_hd##HD##_g##G(  \
        const __half* __restrict__ q, const __half* __restrict__ k_cache,                      \
        const __half* __restrict__ v_cache, float* __restrict__ part, int start, int n_kv,     \
        float scale_log2, const int* __restrict__ start_dev) {                                 \
        wait_prior_grid();                                                                     \
        const int s0 = start_dev != nullptr ? *start_dev : start;                              \
        decode_split<HD, G>(q, k_cache, v_cache, part, s0, n_kv, scale_log2);                  \
    }
#define DECODE_MERGE_KERNEL(HD)                                                                \
    extern "C" __global__ void __launch_bounds__(HD) decode_merge_hd##HD(                      \
        const float* __restrict__ part, int splits, float scale_log2,                          \
        __half* __restrict__ out) {                                                            \
        wait_prior_grid();                                                                     \
        decode_merge<HD>(part, splits, scale_log2, out);                                       \
    }

DECODE_SPLIT_KERNEL(64, 1)
DECODE_SPLIT_KERNEL(64, 2)
DECODE_SPLIT_KERNEL(64, 4)
DECODE_SPLIT_KERNEL(64, 8)
DECODE_SPLIT_KERNEL(64, 16)
DECODE_SPLIT_KERNEL(128, 1)
DECODE_SPLIT_KERNEL(128, 2)
DECODE_SPLIT_KERNEL(128, 4)
DECODE_SPLIT_KERNEL(128, 8)
DECODE_SPLIT_KERNEL(128, 16)
DECODE_MERGE_KERNEL(64)
DECODE_MERGE_KERNEL(128)
