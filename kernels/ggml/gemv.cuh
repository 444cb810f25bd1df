// The decode step's matrix-vector products over a layer's routed experts, written once against a
// decoder struct (decoder.cuh), so a type is its decoder and nothing more:
//
//   STRATA_GGML_GEMV(SUFFIX, DEC)   ggml_gemv_gate_up_SUFFIX, ggml_gemv_down_SUFFIX
//
// Why: one token routes top_k experts per layer; a grouped GEMM over 16-expert groups (gather,
// MMQ, SwiGLU, MMQ per group) launches for every group whatever the routing and tiles for many
// rows where there is one. Here one launch per product covers every routed (token, k) pair of
// the layer: block (x, p) takes pair p, reads its expert's blocks where they lie (a resident
// slot, or the pinned host store through its device-mapped address) and decodes them in
// registers, so nothing is gathered and no group buffer is touched.
//
// Arguments (both kernels): experts, the layer's table of n_experts blob addresses (device
// memory, uploaded before the step is captured); offset, where the product's part starts in a
// blob; ids and row_of, the routing's expert and sorted row of each pair (engine.cu); acts, the
// fp16 input rows; out, the output rows; hidden, ffn. Grid (rows / GEMV_WARPS, pairs), block
// GEMV_THREADS: warp w of block x computes output row x * GEMV_WARPS + w.
//   gate/up: acts = the fp16 activations [rows, hidden] (act_hidden), out = fp16 [rows, ffn]
//            (act_ffn): silu(gate_i) * up_i of gate row i and up row ffn + i, rounded to fp16;
//   down:    acts = those fp16 rows [rows, ffn], out = float32 [rows, hidden] (down_out, what
//            the combine reads: row row_of[p], as the grouped products write it).
// A pair whose expert has no address (0) writes NaN, so a table that misses an expert is seen.
//
// Numerics: each weight is the fp16 value (round to nearest even) of the decoder's float32
// value, as the gathers and the decoding GEMM round it, so the products multiply the routed
// path's weights by the routed path's fp16 activations; each product of two fp16 values is
// exact in float32, accumulated in float32: lane l sums its 8 values of every 256-value stage
// in order, then the warp adds its lanes in a fixed butterfly. Only the order of the sum
// differs from the tensor-core products, so the results agree within float32 rounding of the
// sums (not bit for bit); the order is fixed, so a run's bytes do not depend on the grid.
//
// Loads: a warp copies each stage of its weight rows (256 values, whole blocks) into its own
// shared buffer with 16-byte loads of the aligned chunks covering the stage's bytes (a row may
// start anywhere: rows of some types are not multiples of 16 bytes), the next stage's loads in
// flight in registers while it decodes the current one; the decoder then reads shared memory.
#pragma once

#include <stdint.h>

#include "decoder.cuh"

#ifndef STRATA_GGML_HOST
#include <cuda_fp16.h>

#include "common/swiglu.cuh"

namespace ggml {

// output rows per block (one warp each) and threads per block; the launcher
// (strata_rt/gemm/ggml_gemv.py) reads GEMV_WARPS from this line
constexpr int GEMV_WARPS = 8;
constexpr int GEMV_THREADS = 32 * GEMV_WARPS;
// values of K one stage takes: one 8-value chunk per lane
constexpr int GEMV_STAGE = 256;

template <class D> struct GemvStage {
    static constexpr int bytes = GEMV_STAGE / D::block_values * D::block_bytes;
    // 16-byte chunks that cover a stage's bytes from any start, per lane, and shared bytes
    static constexpr int chunks = (bytes + 15 + 15) / 16;
    static constexpr int loads = (chunks + 31) / 32;
    static constexpr int span = 16 * chunks;
    static_assert(D::block_values == 1 || GEMV_STAGE % D::block_values == 0,
                  "whole blocks per stage");
};

// fp16 rounding of a decoded weight, back in float32 (exact)
__device__ __forceinline__ float gemv_f16(float w) { return __half2float(__float2half_rn(w)); }

// The aligned 16-byte chunks covering `nbytes` bytes from s: chunk lane + 32 l into r[l] (zero
// past the bytes: a chunk beyond them is never read, it may lie past the part).
template <class S>
__device__ __forceinline__ void gemv_fetch(const uint8_t* s, int nbytes, int lane,
                                           uint4 (&r)[S::loads]) {
    const uintptr_t a0 = (uintptr_t)s & ~(uintptr_t)15;
    const uintptr_t end = (uintptr_t)s + (uintptr_t)nbytes;
#pragma unroll
    for (int l = 0; l < S::loads; ++l) {
        const uintptr_t at = a0 + 16u * (uintptr_t)(lane + 32 * l);
        r[l] = (lane + 32 * l < S::chunks && at < end) ? *reinterpret_cast<const uint4*>(at)
                                                       : make_uint4(0u, 0u, 0u, 0u);
    }
}

// acc[j] = sum over k of fp16(W_j[k]) * x[k] for NR weight rows starting at rows[j] (k values
// each, whole blocks of D), partial per lane (the caller reduces over the warp). sh: this
// warp's shared bytes, NR * GemvStage<D>::span.
template <class D, int NR>
__device__ __forceinline__ void gemv_rows(const uint8_t* const (&rows)[NR],
                                          const __half* __restrict__ x, int k, uint8_t* sh,
                                          float (&acc)[NR]) {
    using S = GemvStage<D>;
    const int lane = threadIdx.x & 31;
    const int stages = (k + GEMV_STAGE - 1) / GEMV_STAGE;
    uint4 next[NR][S::loads];
    auto stage_values = [&](int kt) { return min(GEMV_STAGE, k - kt * GEMV_STAGE); };
    auto stage_bytes = [&](int kt) { return stage_values(kt) / D::block_values * D::block_bytes; };
#pragma unroll
    for (int j = 0; j < NR; ++j) {
        acc[j] = 0.0f;
        gemv_fetch<S>(rows[j], stage_bytes(0), lane, next[j]);
    }
    const long long stage_row = (long long)S::bytes;  // bytes from one full stage to the next
#pragma unroll 1
    for (int kt = 0; kt < stages; ++kt) {
        int mis[NR];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
            const uint8_t* s = rows[j] + kt * stage_row;
            mis[j] = (int)((uintptr_t)s & 15u);
#pragma unroll
            for (int l = 0; l < S::loads; ++l)
                if (lane + 32 * l < S::chunks)
                    *reinterpret_cast<uint4*>(sh + j * S::span + 16 * (lane + 32 * l)) = next[j][l];
        }
        __syncwarp();
        if (kt + 1 < stages) {
#pragma unroll
            for (int j = 0; j < NR; ++j)
                gemv_fetch<S>(rows[j] + (kt + 1) * stage_row, stage_bytes(kt + 1), lane, next[j]);
        }
        if (8 * lane < stage_values(kt)) {
            const __half* xs = x + (size_t)kt * GEMV_STAGE + 8 * lane;
            const uint4 xa = *reinterpret_cast<const uint4*>(xs);
            const __half2* xh = reinterpret_cast<const __half2*>(&xa);
            float2 xf[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) xf[p] = __half22float2(xh[p]);
#pragma unroll
            for (int j = 0; j < NR; ++j) {
                Pair w[4];
                chunk8_of<D>(sh + j * S::span + mis[j], lane, w);
                float a = acc[j];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    a = __fmaf_rn(gemv_f16(w[p].x), xf[p].x, a);
                    a = __fmaf_rn(gemv_f16(w[p].y), xf[p].y, a);
                }
                acc[j] = a;
            }
        }
        __syncwarp();  // every lane is done with the stage the next one overwrites
    }
#pragma unroll
    for (int j = 0; j < NR; ++j)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
}

// the routed pair of this block: its expert's part (null: no address) and its sorted row
struct GemvPair {
    const uint8_t* part;
    int row;
};

__device__ __forceinline__ GemvPair gemv_pair(const uint8_t* const* __restrict__ experts,
                                              long long offset, const int* __restrict__ ids,
                                              const int* __restrict__ row_of) {
    const int p = blockIdx.y;
    const uint8_t* blob = experts[ids[p]];
    return {blob == nullptr ? nullptr : blob + offset, row_of[p]};
}

template <class D>
__device__ __forceinline__ void gemv_gate_up(const uint8_t* const* __restrict__ experts,
                                             long long offset, const int* __restrict__ ids,
                                             const int* __restrict__ row_of,
                                             const __half* __restrict__ acts,
                                             __half* __restrict__ out, int hidden, int ffn) {
    __shared__ __align__(16) uint8_t sh[GEMV_WARPS][2 * GemvStage<D>::span];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * GEMV_WARPS + warp;
    if (i >= ffn) return;  // no block-wide barrier follows
    const GemvPair q = gemv_pair(experts, offset, ids, row_of);
    __half* o = out + (size_t)q.row * ffn + i;
    if (q.part == nullptr) {
        if (lane == 0) *o = __float2half_rn(__int_as_float(0x7fc00000));
        return;
    }
    const long long row_bytes = (long long)(hidden / D::block_values) * D::block_bytes;
    const uint8_t* const rows[2] = {q.part + i * row_bytes, q.part + (ffn + i) * row_bytes};
    float acc[2];
    gemv_rows<D, 2>(rows, acts + (size_t)q.row * hidden, hidden, sh[warp], acc);
    if (lane == 0) *o = __float2half_rn(swiglu(acc[0], acc[1]));
}

template <class D>
__device__ __forceinline__ void gemv_down(const uint8_t* const* __restrict__ experts,
                                          long long offset, const int* __restrict__ ids,
                                          const int* __restrict__ row_of,
                                          const __half* __restrict__ acts,
                                          float* __restrict__ out, int hidden, int ffn) {
    __shared__ __align__(16) uint8_t sh[GEMV_WARPS][GemvStage<D>::span];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = blockIdx.x * GEMV_WARPS + warp;
    if (i >= hidden) return;
    const GemvPair q = gemv_pair(experts, offset, ids, row_of);
    float* o = out + (size_t)q.row * hidden + i;
    if (q.part == nullptr) {
        if (lane == 0) *o = __int_as_float(0x7fc00000);
        return;
    }
    const long long row_bytes = (long long)(ffn / D::block_values) * D::block_bytes;
    const uint8_t* const rows[1] = {q.part + i * row_bytes};
    float acc[1];
    gemv_rows<D, 1>(rows, acts + (size_t)q.row * ffn, ffn, sh[warp], acc);
    if (lane == 0) *o = acc[0];
}

}  // namespace ggml

#define STRATA_GGML_GEMV_ARGS                                                                 \
    const uint8_t* const* __restrict__ experts, long long offset, const int* __restrict__ ids, \
        const int* __restrict__ row_of, const __half* __restrict__ acts
#define STRATA_GGML_GEMV(SUFFIX, DEC) STRATA_GGML_GEMV_(SUFFIX, DEC)
#define STRATA_GGML_GEMV_(SUFFIX, DEC)                                                         \
    extern "C" __global__ void __launch_bounds__(ggml::GEMV_THREADS)                          \
    ggml_gemv_gate_up_##SUFFIX(STRATA_GGML_GEMV_ARGS, __half* __restrict__ out, int hidden,    \
                               int ffn) {                                                      \
        ggml::gemv_gate_up<DEC>(experts, offset, ids, row_of, acts, out, hidden, ffn);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ggml::GEMV_THREADS)                          \
    ggml_gemv_down_##SUFFIX(STRATA_GGML_GEMV_ARGS, float* __restrict__ out, int hidden,        \
                            int ffn) {                                                         \
        ggml::gemv_down<DEC>(experts, offset, ids, row_of, acts, out, hidden, ffn);            \
    }

#else  // STRATA_GGML_HOST: nothing of these kernels runs on the host

#define STRATA_GGML_GEMV(SUFFIX, DEC)

#endif  // STRATA_GGML_HOST
