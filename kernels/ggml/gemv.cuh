// The decode step's matrix-vector products over a layer's routed experts, written once against a
// decoder struct (decoder.cuh), so a type is its decoder and nothing more:
//
//   STRATA_GGML_GEMV(SUFFIX, DEC)   ggml_gemv_gate_up_SUFFIX, ggml_gemv_down_SUFFIX,
//                                   ggml_gemv_dense_SUFFIX
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
// fp16 input rows; out, the output rows; hidden, ffn. Grid (row tiles, pairs), block
// 32 * warps threads with 1 <= warps <= GEMV_WARPS (gemv_warps: the launcher's choice).
//   gate/up: acts = the fp16 activations [rows, hidden] (act_hidden), out = fp16 [rows, ffn]
//            (act_ffn): silu(gate_i) * up_i of gate row i and up row ffn + i, rounded to fp16;
//            a tile is 8 such i (its 16 weight rows: 8 gate, then the 8 up rows beside them);
//   down:    acts = those fp16 rows [rows, ffn], out = float32 [rows, hidden] (down_out, what
//            the combine reads: row row_of[p], as the grouped products write it); a tile is 16
//            output rows.
// A pair whose expert has no address (0) writes NaN, so a table that misses an expert is seen.
// Every kernel here waits for the grid before it first (prior_grid.cuh), so the launcher
// starts them overlapped with the routing or the product before them.
//
// Work: a tile's 16 weight rows are the A operand of tensor-core products (mma m16n8k16, fp16
// operands, float32 accumulators) and the input row is B, the same in all 8 of B's columns.
// The K dimension goes in stages of GemvStage::values values; the block's warps take
// consecutive runs of stages, each warp accumulating its own run in its fragments, and the
// block adds the warps' sums in warp order. Inside a stage lane (g, c) (g = lane / 4, c = lane
// % 4) decodes chunks of 8 values c, c + 4, c + 8, ... of rows g and g + 8 (the mma's k slots
// are a permutation of the stage's values, the same for A and B, which a dot product allows):
// the four lanes of a row read neighbouring bytes, the eight rows sit in different banks.
//
// Numerics: each weight is the fp16 value (round to nearest even) of the decoder's float32
// value, as the gathers and the decoding GEMM round it, and each product of two fp16 values is
// exact in the float32 accumulators, as in the grouped products; the order of the sums differs
// from theirs, so the results agree within float32 rounding of the sums (not bit for bit). The
// order is fixed by the grid, the warps and the stage, so a run's bytes do not vary.
//
// Loads: each warp copies each stage of its 16 weight rows (whole blocks) into its own shared
// buffer with 16-byte loads of the aligned chunks covering each row's bytes (a row may start
// anywhere: rows of some types are not multiples of 16 bytes), the next stage's loads in
// flight in registers while it decodes the current one; the decoder then reads shared memory.
#pragma once

#include <stdint.h>

#include "decoder.cuh"

#ifndef STRATA_GGML_HOST
#include <cuda_fp16.h>

#include "common/mma.cuh"
#include "common/prior_grid.cuh"
#include "common/swiglu.cuh"

namespace ggml {

// warps per block at most (each a run of the K stages); the launcher
// (strata_rt/gemm/ggml_gemv.py) reads GEMV_WARPS, GEMV_HOST_WARPS and GEMV_ROWS from these
// lines. The _host kernels of the expert products take up to GEMV_HOST_WARPS: launches that
// read experts from pinned host memory keep more loads in flight across PCIe with them, while
// on device memory more warps (and the registers their bounds allow) lose.
constexpr int GEMV_WARPS = 4;
constexpr int GEMV_THREADS = 32 * GEMV_WARPS;
constexpr int GEMV_HOST_WARPS = 8;
// shared bytes a _host block's stage buffers may take: the warps of a type whose 16 staged rows
// would take more (Q8_0's 400-byte rows) stay fewer, so the block, its sums and the decoder's
// tables keep within the 48 KiB of static shared memory (gemv_host_warps)
constexpr int GEMV_HOST_SHARED = 40960;
// weight rows of a tile (the mma's M)
constexpr int GEMV_ROWS = 16;
// a stage's bytes per row stay at most this, where whole blocks allow (F16, BF16, F32 halve
// their stage): the copies of the next stage live in registers
constexpr int GEMV_STAGE_BYTES = 288;

// chunks of 8 values per lane and stage: 8 (256 values a stage), halved while a row's stage
// would be over GEMV_STAGE_BYTES and still hold whole blocks
template <class D> constexpr int gemv_cpl() {
    int cpl = 8;
    while (cpl > 1 && 32 * cpl / D::block_values * D::block_bytes > GEMV_STAGE_BYTES &&
           (16 * cpl) % D::block_values == 0)
        cpl /= 2;
    return cpl;
}

template <class D> struct GemvStage {
    static constexpr int cpl = gemv_cpl<D>();
    static constexpr int values = 32 * cpl;
    static constexpr int bytes = values / D::block_values * D::block_bytes;
    // 16-byte chunks that cover a row's stage from any start, the shared bytes of one row
    // (padded to an odd number of 16-byte units past a multiple of 128 bytes: the 8 rows a
    // warp's lanes read at once then start in 8 different groups of 4 banks), and the loads
    // per lane for the tile's 16 rows
    static constexpr int chunks = (bytes + 15 + 15) / 16;
    static constexpr int span = 16 * ((chunks + 6) / 8 * 8 + 1);
    static constexpr int loads = (GEMV_ROWS * chunks + 31) / 32;
    static_assert(D::block_values == 1 || values % D::block_values == 0, "whole blocks per stage");
};

// the warps a _host kernel of type D is built for: GEMV_HOST_WARPS, fewer where their stage
// buffers would pass GEMV_HOST_SHARED
template <class D> __host__ __device__ constexpr int gemv_host_warps() {
    const int fit = GEMV_HOST_SHARED / (GEMV_ROWS * GemvStage<D>::span);
    return fit < 1 ? 1 : fit < GEMV_HOST_WARPS ? fit : GEMV_HOST_WARPS;
}

// A tile's 16 weight rows: row r < 8 is matrix row min(a + r, la), row r >= 8 is min(b + r - 8,
// lb) (rows past the matrix repeat its last row; their sums are not written)
struct GemvRows {
    const uint8_t* part;
    long long row_bytes;
    int a, la, b, lb;
    __device__ __forceinline__ const uint8_t* operator()(int r) const {
        const int i = r < GEMV_ROWS / 2 ? min(a + r, la) : min(b + r - GEMV_ROWS / 2, lb);
        return part + (long long)i * row_bytes;
    }
};

// The stage kt of the tile's rows: chunk q = lane + 32 l of the 16 rows' covering chunks (row
// q / chunks) into r[l]; zero past a row's bytes (never read; it may lie past the part).
template <class S>
__device__ __forceinline__ void gemv_fetch(const GemvRows& rows, int kt, int nbytes, int lane,
                                           uint4 (&r)[S::loads]) {
#pragma unroll
    for (int l = 0; l < S::loads; ++l) {
        const int q = lane + 32 * l, row = q / S::chunks, j = q - row * S::chunks;
        r[l] = make_uint4(0u, 0u, 0u, 0u);
        if (row < GEMV_ROWS) {
            const uint8_t* s = rows(row) + (long long)kt * S::bytes;
            const uintptr_t at = ((uintptr_t)s & ~(uintptr_t)15) + 16u * (uintptr_t)j;
            if (at < (uintptr_t)s + (uintptr_t)nbytes) r[l] = *reinterpret_cast<const uint4*>(at);
        }
    }
}

// The warp's run of stages [s0, s1) of the tile's rows times x (k values): d as the mma leaves
// it (lane (g, c): d[0] row g, d[2] row g + 8, in column 2c; all columns alike). sh: this
// warp's shared bytes, GEMV_ROWS * GemvStage<D>::span.
template <class D>
__device__ __forceinline__ void gemv_tile(const GemvRows& rows, const __half* __restrict__ x,
                                          int k, int s0, int s1, uint8_t* sh,
                                          const shared_of<D>& tables, float (&d)[4]) {
    using S = GemvStage<D>;
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    auto stage_values = [&](int kt) { return min(S::values, k - kt * S::values); };
    auto stage_bytes = [&](int kt) { return stage_values(kt) / D::block_values * D::block_bytes; };
#pragma unroll
    for (int i = 0; i < 4; ++i) d[i] = 0.0f;
    if (s0 >= s1) return;
    const uint8_t* const row_lo = rows(g);
    const uint8_t* const row_hi = rows(g + GEMV_ROWS / 2);
    uint4 next[S::loads];
    gemv_fetch<S>(rows, s0, stage_bytes(s0), lane, next);
#pragma unroll 1
    for (int kt = s0; kt < s1; ++kt) {
#pragma unroll
        for (int l = 0; l < S::loads; ++l) {
            const int q = lane + 32 * l, row = q / S::chunks;
            if (row < GEMV_ROWS)
                *reinterpret_cast<uint4*>(sh + row * S::span + 16 * (q - row * S::chunks)) = next[l];
        }
        __syncwarp();
        if (kt + 1 < s1) gemv_fetch<S>(rows, kt + 1, stage_bytes(kt + 1), lane, next);
        const int nv = stage_values(kt);
        const long long at = (long long)kt * S::bytes;
        const uint8_t* lo = sh + g * S::span + (int)((uintptr_t)(row_lo + at) & 15u);
        const uint8_t* hi = sh + (g + GEMV_ROWS / 2) * S::span + (int)((uintptr_t)(row_hi + at) & 15u);
        const __half* xs = x + (long long)kt * S::values;
#pragma unroll
        for (int m = 0; m < S::cpl; ++m) {
            const int ch = 4 * m + c;  // this lane's chunk of the stage
            unsigned a0[4] = {0u, 0u, 0u, 0u}, a1[4] = {0u, 0u, 0u, 0u};
            uint4 xv = make_uint4(0u, 0u, 0u, 0u);
            if (8 * ch < nv) {
                unsigned w[4], v[4];
                chunk8_f16_at<D>(lo, ch, w, tables);
                chunk8_f16_at<D>(hi, ch, v, tables);
                xv = *reinterpret_cast<const uint4*>(xs + 8 * ch);
                a0[0] = w[0];
                a0[1] = v[0];
                a0[2] = w[1];
                a0[3] = v[1];
                a1[0] = w[2];
                a1[1] = v[2];
                a1[2] = w[3];
                a1[3] = v[3];
            }
            mma_f16_16x8x16(d, a0, xv.x, xv.y, d);
            mma_f16_16x8x16(d, a1, xv.z, xv.w, d);
        }
        __syncwarp();  // every lane is done with the stage the next one overwrites
    }
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

// The block's tile times x (k values), the warps' runs of stages added in warp order: thread t
// gets the sums of tile rows t % 16 (x) and (t + 8) % 16 (y). Every thread of the block calls it
// (two barriers).
template <class D, int WARPS = GEMV_WARPS>
__device__ __forceinline__ float2 gemv_block(const GemvRows& rows, const __half* __restrict__ x,
                                             int k) {
    using S = GemvStage<D>;
    __shared__ __align__(16) uint8_t sh[WARPS][GEMV_ROWS * S::span];
    __shared__ float part_sums[WARPS][GEMV_ROWS];
    __shared__ shared_of<D> tables;  // the decoder's tables, if it has any
    SharedOf<D>::fill(tables);
    __syncthreads();
    // warps past the ones this kernel is built for (a launch with more) take no stages
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = min((int)(blockDim.x >> 5), WARPS);
    const int stages = (k + S::values - 1) / S::values, per = (stages + warps - 1) / warps;
    if (warp < warps) {
        const int s0 = min(stages, warp * per), s1 = min(stages, s0 + per);
        float d[4];
        gemv_tile<D>(rows, x, k, s0, s1, sh[warp], tables, d);
        if ((lane & 3) == 0) {
            part_sums[warp][lane >> 2] = d[0];
            part_sums[warp][(lane >> 2) + GEMV_ROWS / 2] = d[2];
        }
    }
    __syncthreads();
    const int r = threadIdx.x % GEMV_ROWS, r2 = (r + GEMV_ROWS / 2) % GEMV_ROWS;
    float2 s = make_float2(part_sums[0][r], part_sums[0][r2]);
    for (int w = 1; w < warps; ++w) {
        s.x += part_sums[w][r];
        s.y += part_sums[w][r2];
    }
    return s;
}

template <class D, int WARPS = GEMV_WARPS>
__device__ __forceinline__ void gemv_gate_up(const uint8_t* const* __restrict__ experts,
                                             long long offset, const int* __restrict__ ids,
                                             const int* __restrict__ row_of,
                                             const __half* __restrict__ acts,
                                             __half* __restrict__ out, int hidden, int ffn) {
    const int i0 = blockIdx.x * (GEMV_ROWS / 2), t = threadIdx.x;
    const GemvPair q = gemv_pair(experts, offset, ids, row_of);
    __half* o = out + (size_t)q.row * ffn + i0;
    const bool writes = t < GEMV_ROWS / 2 && i0 + t < ffn;
    if (q.part == nullptr) {  // the whole block leaves: no barrier is waited for
        if (writes) o[t] = __float2half_rn(__int_as_float(0x7fc00000));
        return;
    }
    const GemvRows rows{q.part, (long long)(hidden / D::block_values) * D::block_bytes,
                        i0, ffn - 1, ffn + i0, 2 * ffn - 1};
    const float2 s = gemv_block<D, WARPS>(rows, acts + (size_t)q.row * hidden, hidden);
    if (writes) o[t] = __float2half_rn(swiglu(s.x, s.y));
}

template <class D, int WARPS = GEMV_WARPS>
__device__ __forceinline__ void gemv_down(const uint8_t* const* __restrict__ experts,
                                          long long offset, const int* __restrict__ ids,
                                          const int* __restrict__ row_of,
                                          const __half* __restrict__ acts,
                                          float* __restrict__ out, int hidden, int ffn) {
    const int i0 = blockIdx.x * GEMV_ROWS, t = threadIdx.x;
    const GemvPair q = gemv_pair(experts, offset, ids, row_of);
    float* o = out + (size_t)q.row * hidden + i0;
    const bool writes = t < GEMV_ROWS && i0 + t < hidden;
    if (q.part == nullptr) {
        if (writes) o[t] = __int_as_float(0x7fc00000);
        return;
    }
    const GemvRows rows{q.part, (long long)(ffn / D::block_values) * D::block_bytes,
                        i0, hidden - 1, i0 + GEMV_ROWS / 2, hidden - 1};
    const float2 s = gemv_block<D, WARPS>(rows, acts + (size_t)q.row * ffn, ffn);
    if (writes) o[t] = s.x;
}

// A dense matrix times one token's row (a decode step's projections and output head, read in
// the weight's own type): W [rows, k] of type D (rows of whole blocks, one after another from
// w) times fp16 x [k]. mode 0: out fp16 [rows] = fp16(sum); 1: out float32 [rows] = sum; 2:
// out float32 [rows] += sum (one rounding: the residual add of the o projection). Grid
// (ceil(rows / 16)), block as the expert products'.
template <class D>
__device__ __forceinline__ void gemv_dense(const uint8_t* __restrict__ w,
                                           const __half* __restrict__ x, void* __restrict__ out,
                                           int rows, int k, int mode) {
    const int i0 = blockIdx.x * GEMV_ROWS, t = threadIdx.x;
    const GemvRows tile{w, (long long)(k / D::block_values) * D::block_bytes,
                        i0, rows - 1, i0 + GEMV_ROWS / 2, rows - 1};
    const float2 s = gemv_block<D>(tile, x, k);
    if (t >= GEMV_ROWS || i0 + t >= rows) return;
    if (mode == 0) {
        static_cast<__half*>(out)[i0 + t] = __float2half_rn(s.x);
    } else {
        float* o = static_cast<float*>(out) + i0 + t;
        *o = mode == 1 ? s.x : __fadd_rn(*o, s.x);
    }
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
        wait_prior_grid();                                                                     \
        ggml::gemv_gate_up<DEC>(experts, offset, ids, row_of, acts, out, hidden, ffn);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ggml::GEMV_THREADS)                          \
    ggml_gemv_down_##SUFFIX(STRATA_GGML_GEMV_ARGS, float* __restrict__ out, int hidden,        \
                            int ffn) {                                                         \
        wait_prior_grid();                                                                     \
        ggml::gemv_down<DEC>(experts, offset, ids, row_of, acts, out, hidden, ffn);            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ggml::GEMV_HOST_WARPS)                  \
    ggml_gemv_gate_up_host_##SUFFIX(STRATA_GGML_GEMV_ARGS, __half* __restrict__ out,           \
                                    int hidden, int ffn) {                                     \
        wait_prior_grid();                                                                     \
        ggml::gemv_gate_up<DEC, ggml::gemv_host_warps<DEC>()>(experts, offset, ids, row_of,    \
                                                              acts, out, hidden, ffn);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * ggml::GEMV_HOST_WARPS)                  \
    ggml_gemv_down_host_##SUFFIX(STRATA_GGML_GEMV_ARGS, float* __restrict__ out, int hidden,   \
                                 int ffn) {                                                    \
        wait_prior_grid();                                                                     \
        ggml::gemv_down<DEC, ggml::gemv_host_warps<DEC>()>(experts, offset, ids, row_of, acts, \
                                                           out, hidden, ffn);                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(ggml::GEMV_THREADS)                          \
    ggml_gemv_dense_##SUFFIX(const uint8_t* __restrict__ w, const __half* __restrict__ x,      \
                             void* __restrict__ out, int rows, int k, int mode) {              \
        wait_prior_grid();                                                                     \
        ggml::gemv_dense<DEC>(w, x, out, rows, k, mode);                                       \
    }

#else  // STRATA_GGML_HOST: nothing of these kernels runs on the host

#define STRATA_GGML_GEMV(SUFFIX, DEC)

#endif  // STRATA_GGML_HOST
