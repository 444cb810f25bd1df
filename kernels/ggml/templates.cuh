// The kernels every GGML type shares, written once against a decoder struct (decoder.cuh: D with
// block_values, block_bytes and pair(block, i)), so a type is its decoder and nothing more:
//
//   STRATA_GGML_KERNELS(SUFFIX, DEC)   all of the below for decoder DEC
//   STRATA_GGML_GATHER(SUFFIX, DEC)    ggml_gather_SUFFIX: the batched dequantizing gather
//   STRATA_GGML_FUSED(SUFFIX, DEC)     ggml_fused_SUFFIX_<tile>, ggml_fused_at_SUFFIX_<tile>,
//                                      ggml_fused_tab_SUFFIX_<tile>: the grouped GEMM decoding
//                                      native blocks in its main loop
//   STRATA_GGML_GEMV(SUFFIX, DEC)      ggml_gemv_gate_up_SUFFIX, ggml_gemv_down_SUFFIX,
//                                      ggml_gemv_dense_SUFFIX: the decode step's matrix-vector
//                                      products (gemv.cuh)
//
// A plugin with its own type writes one .cu: #include "ggml/templates.cuh", its decoder struct,
// and one STRATA_GGML_KERNELS line (DEC must not hold a top-level comma: use a typedef).
// Compiled with -DSTRATA_GGML_HOST the same line instead exports the decoder as host code
// (ggml_host_decode_SUFFIX, ggml_host_decode_chunks_SUFFIX) and the fused tiles' geometry
// (ggml_host_fused_SUFFIX), which the CPU tests compare with the gguf package and the launcher.
//
// Gather (the conventions of the IQ3_XXS dequantizing gather, so it can replace per-format
// ones): member y of a launch goes to position first_pos + y, its fp16 image at dst +
// (first_pos + y) * image_bytes (16-byte aligned); its matrix is whole blocks, row after row;
// bounds / first_expert as gather_batch in kernels/common/gather.cu (a member whose expert has
// no rows is skipped; null: none is); a member whose source is 0 is skipped too. A warp stages
// a few 256-value groups' bytes in shared memory, then each lane writes 8 values (one 16-byte
// store) per group (gather_run.cuh).
//
// Fused GEMM (generalised from kernels/iq3_xxs/fused.cu; the MMQ ABI of kernels/common/
// gemm_f16.cu: arguments (Ids16, weights, acts, bounds, out, m, k), grid (m / BN, group
// position, row tiles)):  out[r, i] = sum_k acts[r, k] * W_e[i, k]. Position p's native image
// (m rows of row_bytes(k), row-major) is at weights + p * m * row_bytes(k), or, in the in-place
// twin, at srcs.v[p] (16 pointers before the ids). The table twin covers a layer's experts in
// one launch: arguments (table, offset, acts, bounds, out, m, k), grid (m / BN, experts, row
// tiles), expert e's image at table[e] + offset (skipped where table[e] is 0). Images start on
// 16 bytes and span a multiple of 16 bytes, so no 16-byte chunk read below leaves an image.
//   - K advances Stage::values per stage (256; for 1-value types 256 bytes of a row, which
//     keeps two stages of a 128-row tile within every GPU's shared memory), through a cp.async
//     pipeline of up to STAGES buffers (fewer where a type's stage would not fit the budget).
//   - Weights: each of the BN rows' stage bytes (values / block_values blocks) may start
//     anywhere inside a 16-byte chunk; the aligned chunks covering them are copied into a
//     shared row. Activations: BM rows, 16-byte chunks XOR-swizzled by row (ldmatrix reads free
//     of bank conflicts), rows past the expert's last zero-filled.
//   - Each lane decodes the B-fragment pairs it feeds the mma (weight row g of an n8 tile,
//     values 2t, 2t+1 and 2t+8, 2t+9 of a k16 step) with DEC::pair straight from shared
//     memory, rounds them to fp16 as the gather does (__floats2half2_rn, value 2t low), mma.
// Same bytes as the gather followed by gemm_f16.cu: every weight is the gather's fp16 value,
// every output one fp32 accumulator from 0 taking one mma.sync m16n8k16 per 16 values of K in
// ascending order; row tiles start at bounds[e] + a multiple of BM and weight tiles at a
// multiple of 8, so every value sits in the fragment position gemm_f16.cu gives it. No
// split-K, no atomics: the bytes do not depend on the tile, rows_hint or the run.
#pragma once

#include <stdint.h>

#include "decoder.cuh"
#include "gemv.cuh"

// The fused GEMM's tiles: name, BM (activation rows), WARPS (BN = 16 * WARPS weight rows),
// STAGES (at most), min blocks per SM. The one list: strata_rt/gemm/ggml_fused.py reads it
// from this file.
#define STRATA_GGML_FUSED_TILES(TILE, SUFFIX, DEC) \
    TILE(SUFFIX, DEC, m16, 16, 8, 4, 2)            \
    TILE(SUFFIX, DEC, m32, 32, 8, 3, 2)            \
    TILE(SUFFIX, DEC, m64, 64, 8, 3, 1)

namespace ggml {

// shared memory one block may take (sm_80's per-block limit), per SM (sm_90), and what the
// driver reserves per resident block
constexpr int FUSED_BLOCK_SMEM_MAX = 163 * 1024;
constexpr int FUSED_SM_SMEM = 228 * 1024;
constexpr int FUSED_BLOCK_RESERVE = 2048;

constexpr int fused_min(int a, int b) { return a < b ? a : b; }

// One stage of K for decoder D: values, the bytes of one weight row they take, the 16-byte
// chunks covering those bytes wherever they start (row and stage offsets are multiples of
// `align`, the largest power of two up to 16 dividing the stage bytes), and shared row sizes.
template <class D> struct FusedStage {
    static constexpr int values = D::block_values == 1 ? 256 / D::block_bytes : 256;
    static constexpr int bytes = values / D::block_values * D::block_bytes;
    static constexpr int align = (bytes & 15) == 0 ? 16 : (bytes & -bytes);
    static constexpr int chunks = (bytes + 16 - align + 15) / 16;
    static constexpr int w_row = 16 * chunks;  // shared bytes of one weight row
    static constexpr int a_row = 2 * values;   // shared bytes of one activation row
    static_assert(D::block_values == 1 || 256 % D::block_values == 0, "blocks tile 256 values");
    static_assert(values % 64 == 0, "whole k16 steps; activation rows of 128-byte multiples");
};

template <class D, int BM_, int WARPS_, int STAGES_, int MINB_> struct FusedCfg {
    using Stage = FusedStage<D>;
    static constexpr int BM = BM_, WARPS = WARPS_, MINB = MINB_;
    static constexpr int BN = 16 * WARPS, THREADS = 32 * WARPS;
    static constexpr int MT = BM / 16, NT = 2;  // m16 fragments per warp; n8 fragments per warp
    static constexpr int A_BYTES = BM * Stage::a_row, W_BYTES = BN * Stage::w_row;
    static constexpr int STAGE_BYTES = A_BYTES + W_BYTES;
    static constexpr int BUDGET =
        fused_min(FUSED_BLOCK_SMEM_MAX, FUSED_SM_SMEM / MINB - FUSED_BLOCK_RESERVE);
    static constexpr int STAGES = fused_min(STAGES_, BUDGET / STAGE_BYTES);
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    static constexpr int A_CH = Stage::a_row / 16;  // 16-byte chunks per activation row
    static constexpr int A_CHUNKS = BM * A_CH, W_CHUNKS = BN * Stage::chunks;
    static constexpr int A_ITERS = (A_CHUNKS + THREADS - 1) / THREADS;
    static constexpr int W_ITERS = (W_CHUNKS + THREADS - 1) / THREADS;
    static constexpr int KSTEPS = Stage::values / 16;
    static_assert(BM % 16 == 0 && BM <= 64, "row tiles of 16, 32 or 64");
    static_assert(STAGES >= 2, "two stages of this type's tile fit the shared-memory budget");
};

}  // namespace ggml

#ifndef STRATA_GGML_HOST
#include <cuda_fp16.h>

#include "common/mma.cuh"

struct GgmlSrcs16 { const uint8_t* v[16]; };

#include "gather_run.cuh"

namespace ggml {

// ------------------------------------------------------------------------------ fused GEMM
__device__ __forceinline__ void fused_cp_async(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void fused_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Physical 16-byte chunk of logical chunk c in activation row r (rows of a multiple of 128
// bytes: eight consecutive rows at one logical chunk land in eight distinct bank groups).
__device__ __forceinline__ int fused_swizzle(int r, int c) { return c ^ (r & 7); }

// values v, v + 1 of a stage's weight row as fp16 bits, value v low (the gather's rounding)
template <class D> __device__ __forceinline__ unsigned fused_pair(const uint8_t* row, int v) {
    const Pair p = pair_of<D>(row, v);
    const __half2 h = __floats2half2_rn(p.x, p.y);
    return *reinterpret_cast<const unsigned*>(&h);
}

extern __shared__ __align__(128) uint8_t fused_smem[];

// One BM x BN output tile: activation rows row0 .. row0+nrows-1 (nrows <= BM) against weight
// rows m0 .. m0+BN-1 of the native image img.
template <class C, class D>
__device__ __forceinline__ void fused_tile(const uint8_t* __restrict__ img,
                                           const __half* __restrict__ acts,
                                           float* __restrict__ out, int m, int k, int m0,
                                           int row0, int nrows) {
    using S = typename C::Stage;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn0 = warp * 16;  // this warp's first weight row within the tile
    const int KT = k / S::values;
    const unsigned row_bytes = (unsigned)KT * S::bytes;
    const unsigned smem = smem_addr(fused_smem);

    // ---- global -> shared. Activations: chunk c is row c / A_CH, chunk c % A_CH; weights:
    // chunk c is row c / chunks, chunk c % chunks of the aligned run covering the row's bytes
    // (a chunk past the bytes' end is not read: it may lie past the image).
    auto load_stage = [&](int stage, int kt) {
        const unsigned sa = smem + stage * C::STAGE_BYTES;
        const unsigned sw = sa + C::A_BYTES;
#pragma unroll
        for (int i = 0; i < C::A_ITERS; ++i) {
            const int c = tid + i * C::THREADS;
            if (C::A_CHUNKS % C::THREADS == 0 || c < C::A_CHUNKS) {
                const int r = c / C::A_CH, ch = c % C::A_CH;
                const bool ok = r < nrows;
                // rows past the expert's last are zero-filled; their source is never read
                const __half* src =
                    ok ? acts + (size_t)(row0 + r) * k + (size_t)kt * S::values + ch * 8 : acts;
                fused_cp_async(sa + r * S::a_row + (fused_swizzle(r, ch) << 4), src, ok ? 16 : 0);
            }
        }
#pragma unroll 1
        for (int i = 0; i < C::W_ITERS; ++i) {
            const int c = tid + i * C::THREADS;
            if (C::W_CHUNKS % C::THREADS == 0 || c < C::W_CHUNKS) {
                const int r = c / S::chunks, ch = c % S::chunks;
                // 32-bit offsets: the launcher refuses images of 4 GiB or more
                const unsigned start = (unsigned)(m0 + r) * row_bytes + (unsigned)kt * S::bytes;
                const unsigned at = (start & ~15u) + ch * 16;
                if (at < start + S::bytes) fused_cp_async(sw + r * S::w_row + ch * 16, img + at, 16);
            }
        }
    };

    // ---- per lane: activation ldmatrix rows (lane gives row lane & 15 of each m16 fragment at
    // chunk lane >> 4 of the k16 step -> a0..a3 in mma order) and the weight rows it decodes
    const int a_row = lane & 15, a_chk = lane >> 4;
    int w_row[C::NT], w_mis[C::NT];  // shared row; where its bytes start in it at kt = 0
#pragma unroll
    for (int j = 0; j < C::NT; ++j) {
        w_row[j] = wn0 + 8 * j + g;
        w_mis[j] = (int)(((unsigned)(m0 + w_row[j]) * row_bytes) & 15u);
    }

    float acc[C::MT][C::NT][4];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int j = 0; j < C::NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][j][c] = 0.0f;

#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();  // empty groups keep the count uniform
    }

    for (int kt = 0; kt < KT; ++kt) {
        // stage kt has landed, and every warp is done with stage kt-1, which the load below
        // overwrites
        cp_async_wait<C::STAGES - 2>();
        __syncthreads();
        if (kt + C::STAGES - 1 < KT)
            load_stage((kt + C::STAGES - 1) % C::STAGES, kt + C::STAGES - 1);
        cp_async_commit();

        const int st = kt % C::STAGES;
        const unsigned sa = smem + st * C::STAGE_BYTES;
        const uint8_t* sw = fused_smem + st * C::STAGE_BYTES + C::A_BYTES;
        const uint8_t* row[C::NT];
#pragma unroll
        for (int j = 0; j < C::NT; ++j)
            row[j] = sw + w_row[j] * S::w_row + ((w_mis[j] + kt * (S::bytes & 15)) & 15);
#pragma unroll 1
        for (int kk = 0; kk < C::KSTEPS; ++kk) {
            unsigned af[C::MT][4];
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) {
                const int r = mt * 16 + a_row;
                fused_ldmatrix_x4(af[mt], sa + r * S::a_row +
                                              (fused_swizzle(r, 2 * kk + a_chk) << 4));
            }
            unsigned bf[C::NT][2];
#pragma unroll
            for (int j = 0; j < C::NT; ++j) {
                bf[j][0] = fused_pair<D>(row[j], 16 * kk + 2 * t);
                bf[j][1] = fused_pair<D>(row[j], 16 * kk + 8 + 2 * t);
            }
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                for (int j = 0; j < C::NT; ++j)
                    mma_f16_16x8x16(acc[mt][j], af[mt], bf[j][0], bf[j][1], acc[mt][j]);
        }
    }
    cp_async_wait<0>();

    // ---- registers -> global: lane holds rows g, g+8 and columns 2t, 2t+1 of each fragment
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
        const int r = mt * 16 + g;
        float* o0 = out + (size_t)(row0 + r) * m + m0 + wn0 + 2 * t;
        float* o1 = o0 + (size_t)8 * m;
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
            if (r < nrows) *(float2*)(o0 + j * 8) = make_float2(acc[mt][j][0], acc[mt][j][1]);
            if (r + 8 < nrows) *(float2*)(o1 + j * 8) = make_float2(acc[mt][j][2], acc[mt][j][3]);
        }
    }
    __syncthreads();  // the next row tile's prologue overwrites the stages
}

template <class C, class D>
__device__ __forceinline__ void fused_expert(const uint8_t* __restrict__ img,
                                             const GroupedBlock& blk,
                                             const __half* __restrict__ acts,
                                             const int* __restrict__ bounds,
                                             float* __restrict__ out, int m, int k) {
    require_dynamic_smem(C::SMEM);
    const int e = blk.expert, xt = blk.weight_tile, zt = blk.row_tile;
    if (e < 0) return;
    const int r_beg = bounds[e], r_end = bounds[e + 1];
    for (int row0 = r_beg + zt * C::BM; row0 < r_end; row0 += gridDim.z * C::BM)
        fused_tile<C, D>(img, acts, out, m, k, xt * C::BN, row0, min(C::BM, r_end - row0));
}

template <class C, class D>
__device__ __forceinline__ void fused_grouped(const uint8_t* __restrict__ weights,
                                              const Ids16& ids, const __half* __restrict__ acts,
                                              const int* __restrict__ bounds,
                                              float* __restrict__ out, int m, int k) {
    const GroupedBlock blk = grouped_block(ids);  // the same block order as gemm_f16.cu
    const size_t row_bytes = (size_t)(k / C::Stage::values) * C::Stage::bytes;
    fused_expert<C, D>(weights + (size_t)blk.pos * m * row_bytes, blk, acts, bounds, out, m, k);
}

template <class C, class D>
__device__ __forceinline__ void fused_grouped_at(const GgmlSrcs16& srcs, const Ids16& ids,
                                                 const __half* __restrict__ acts,
                                                 const int* __restrict__ bounds,
                                                 float* __restrict__ out, int m, int k) {
    const GroupedBlock blk = grouped_block(ids);
    if (blk.expert < 0) return;
    const uint8_t* img = nullptr;  // srcs.v[blk.pos] by selects, as grouped_block finds the id
#pragma unroll
    for (int i = 0; i < 16; ++i) img = i == blk.pos ? srcs.v[i] : img;
    fused_expert<C, D>(img, blk, acts, bounds, out, m, k);
}

template <class C, class D>
__device__ __forceinline__ void fused_table(const unsigned long long* __restrict__ table,
                                            long long offset, const __half* __restrict__ acts,
                                            const int* __restrict__ bounds,
                                            float* __restrict__ out, int m, int k) {
    const GroupedBlock blk = table_block();
    const uint8_t* img = table_image(table, blk.expert, offset);
    if (img == nullptr) return;
    fused_expert<C, D>(img, blk, acts, bounds, out, m, k);
}

}  // namespace ggml

// ------------------------------------------------------------------------------ the macros
// srcs: each member's blocks (0: skip it); dst: the images' base; image_bytes: bytes from one
// position's image to the next; values: rows * cols of one expert (a multiple of 8)
#define STRATA_GGML_GATHER(SUFFIX, DEC) STRATA_GGML_GATHER_(SUFFIX, DEC)
#define STRATA_GGML_GATHER_(SUFFIX, DEC)                                                      \
    extern "C" __global__ void __launch_bounds__(256)                                        \
    ggml_gather_##SUFFIX(GgmlSrcs16 srcs, uint8_t* dst, long long image_bytes,               \
                         long long values, int first_pos, const int* __restrict__ bounds,     \
                         int first_expert) {                                                  \
        ggml::gather_run<DEC>(srcs, dst, image_bytes, values, first_pos, bounds,             \
                              first_expert);                                                  \
    }

#define STRATA_GGML_FUSED_TILE_(SUFFIX, DEC, NAME, BM, WARPS, STAGES, MINB)                   \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB)                            \
    ggml_fused_##SUFFIX##_##NAME(Ids16 ids, const uint8_t* __restrict__ weights,             \
                                 const __half* __restrict__ acts,                             \
                                 const int* __restrict__ bounds, float* __restrict__ out,     \
                                 int m, int k) {                                              \
        ggml::fused_grouped<ggml::FusedCfg<DEC, BM, WARPS, STAGES, MINB>, DEC>(               \
            weights, ids, acts, bounds, out, m, k);                                           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB)                            \
    ggml_fused_at_##SUFFIX##_##NAME(GgmlSrcs16 srcs, Ids16 ids,                               \
                                    const __half* __restrict__ acts,                          \
                                    const int* __restrict__ bounds, float* __restrict__ out,  \
                                    int m, int k) {                                           \
        ggml::fused_grouped_at<ggml::FusedCfg<DEC, BM, WARPS, STAGES, MINB>, DEC>(            \
            srcs, ids, acts, bounds, out, m, k);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MINB)                            \
    ggml_fused_tab_##SUFFIX##_##NAME(const unsigned long long* __restrict__ table,            \
                                     long long offset, const __half* __restrict__ acts,       \
                                     const int* __restrict__ bounds, float* __restrict__ out, \
                                     int m, int k) {                                          \
        ggml::fused_table<ggml::FusedCfg<DEC, BM, WARPS, STAGES, MINB>, DEC>(                 \
            table, offset, acts, bounds, out, m, k);                                          \
    }
#define STRATA_GGML_FUSED(SUFFIX, DEC) STRATA_GGML_FUSED_TILES(STRATA_GGML_FUSED_TILE_, SUFFIX, DEC)

#define STRATA_GGML_KERNELS(SUFFIX, DEC) \
    STRATA_GGML_GATHER(SUFFIX, DEC)      \
    STRATA_GGML_FUSED(SUFFIX, DEC)       \
    STRATA_GGML_GEMV(SUFFIX, DEC)

#else  // STRATA_GGML_HOST: the decoder and the tiles' geometry as host exports

namespace ggml {

// nvalues values (whole pairs and blocks; with chunks, whole 8-value steps) from src into out,
// pair by pair or 8 values per step as the gather walks: 0, or -2 for a partial count
template <class D> int host_decode(const uint8_t* src, long long nvalues, float* out, bool chunks) {
    if (nvalues < 0 || nvalues % 2 || nvalues % D::block_values || (chunks && nvalues % 8))
        return -2;
    if (chunks) {
        for (long long c = 0; c < nvalues / 8; ++c) {
            Pair p[4];
            chunk8_of<D>(src, c, p);
            for (int q = 0; q < 4; ++q) {
                out[8 * c + 2 * q] = p[q].x;
                out[8 * c + 2 * q + 1] = p[q].y;
            }
        }
        return 0;
    }
    for (long long v = 0; v < nvalues; v += 2) {
        const Pair p = pair_of<D>(src, v);
        out[v] = p.x;
        out[v + 1] = p.y;
    }
    return 0;
}

}  // namespace ggml

// geo: block values, block bytes, stage values, stage bytes, shared weight row, stages, smem
#define STRATA_GGML_HOST_TILE_(SUFFIX, DEC, NAME, BM_, WARPS_, STAGES_, MINB_)      \
    if (n++ == tile) {                                                              \
        using C = ggml::FusedCfg<DEC, BM_, WARPS_, STAGES_, MINB_>;                 \
        const int row[7] = {DEC::block_values, DEC::block_bytes, C::Stage::values,  \
                            C::Stage::bytes,   C::Stage::w_row,  C::STAGES, C::SMEM}; \
        for (int i = 0; i < 7; ++i) geo[i] = row[i];                                \
        return 0;                                                                   \
    }
#define STRATA_GGML_KERNELS(SUFFIX, DEC) STRATA_GGML_HOST_(SUFFIX, DEC)
#define STRATA_GGML_HOST_(SUFFIX, DEC)                                                      \
    extern "C" int ggml_host_decode_##SUFFIX(const uint8_t* src, long long n, float* out) { \
        return ggml::host_decode<DEC>(src, n, out, false);                                  \
    }                                                                                       \
    extern "C" int ggml_host_decode_chunks_##SUFFIX(const uint8_t* src, long long n,        \
                                                    float* out) {                           \
        return ggml::host_decode<DEC>(src, n, out, true);                                   \
    }                                                                                       \
    extern "C" int ggml_host_fused_##SUFFIX(int tile, int* geo) {                           \
        int n = 0;                                                                          \
        STRATA_GGML_FUSED_TILES(STRATA_GGML_HOST_TILE_, SUFFIX, DEC)                        \
        return -1;                                                                          \
    }
#define STRATA_GGML_GATHER(SUFFIX, DEC)
#define STRATA_GGML_FUSED(SUFFIX, DEC)

#endif  // STRATA_GGML_HOST
