// Grouped IQ3_XXS x fp16 GEMM that dequantizes in its main loop (variant f16_fused): the group
// buffer holds the experts' native IQ3_XXS blocks (byte-copy gathers, 98 bytes per 256
// weights), so nothing writes fp16 images; each block tile reads its weights once per row tile.
//
//   out[r, i] = sum_k acts[r, k] * W_e[i, k]   for every activation row r of every expert e
//
// W_e is the native image at group position p: m rows of k/256 blocks each, row-major, at
// weights + p*m*(k/256)*98 bytes; acts are fp16 [rows, k] row-major, sorted by expert; bounds,
// out, the expert ids and the grid are the MMQ ABI of kernels/common/gemm_f16.cu: arguments
// (Ids16, weights, acts, bounds, out, m, k), grid (m / BN, group position, row tiles).
// Three entries per tile run the same body: iq3_fused_<tile> (the group buffer),
// iq3_fused_at_<tile> (position p's image at its own address: Ptrs16 before the ids) and
// iq3_fused_tab_<tile> (every expert of a layer in one launch: arguments (table, offset, acts,
// bounds, out, m, k), grid (m / BN, the layer's experts, row tiles), expert e's image at
// table[e] + offset, skipped where table[e] is 0).
//
// Same bytes as gemm_f16.cu on the dequantized images: every weight is decoded exactly as
// kernels/iq3_xxs/dequant.cu decodes it (fp16, round to nearest even, of the exact float32
// d * (0.5 + s) * 0.5 * magnitude, sign applied before the rounding), and every output is one
// fp32 accumulator that starts at 0 and takes one mma.sync m16n8k16 per 16 values of K in
// ascending order, each value in the position gemm_f16.cu gives it. Row tiles start at
// bounds[e] + a multiple of BM (a multiple of 16) and weight tiles at a multiple of 8, so
// rows and weight rows also sit at the same fragment positions.
//
// Block tile: BN = 16 * WARPS weight rows x BM activation rows (16, 32 or 64: few row tiles
// for short prompts, where rows per expert are ~16-64). Every warp owns all BM rows and 16
// weight rows (two n8 fragments), so no weight is decoded twice within a row tile. K advances
// one IQ3_XXS block (256 values) per stage through a STAGES-deep cp.async pipeline:
//   - activations: BM rows of 512 bytes, 16-byte chunks XOR-swizzled by row (ldmatrix reads
//     free of bank conflicts), rows past the expert's last zero-filled;
//   - weights: for each of the BN rows, the 98-byte block at an even address is covered by
//     exactly seven aligned 16-byte chunks (it starts at most 14 bytes into the first; the image
//     starts and ends on 16 bytes, so no chunk leaves it), stored as a 112-byte shared row.
// Each lane decodes the B fragment values it feeds the mma (weight row g of the n8 tile,
// values 2t, 2t+1, 2t+8, 2t+9 of the k16 step) straight from the shared block into registers.
//
// Determinism: no split-K, no atomics, no reduction across warps; the bytes do not depend on
// the tile, on rows_hint or on the run.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "iq3_xxs/grid.cuh"

#define IQF_BLOCK 98
#define IQF_VALUES 256
#define IQF_W_CHUNKS 7                 // 16-byte chunks covering one block at an even offset
#define IQF_W_ROW (16 * IQF_W_CHUNKS)  // shared bytes of one weight row of a stage
#define IQF_A_ROW (2 * IQF_VALUES)     // shared bytes of one activation row of a stage

template <int BM_, int WARPS_, int STAGES_>
struct FusedCfg {
    static constexpr int BM = BM_, WARPS = WARPS_, STAGES = STAGES_;
    static constexpr int BN = 16 * WARPS, THREADS = 32 * WARPS;
    static constexpr int MT = BM / 16, NT = 2;  // m16 fragments per warp; n8 fragments per warp
    static constexpr int A_BYTES = BM * IQF_A_ROW, W_BYTES = BN * IQF_W_ROW;
    static constexpr int STAGE_BYTES = A_BYTES + W_BYTES;
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    static constexpr int A_CHUNKS = BM * (IQF_A_ROW / 16), W_CHUNKS = BN * IQF_W_CHUNKS;
    static constexpr int A_ITERS = A_CHUNKS / THREADS;
    static constexpr int W_ITERS = (W_CHUNKS + THREADS - 1) / THREADS;
    static_assert(BM % 16 == 0 && BM <= 64, "row tiles of 16, 32 or 64");
    static_assert(A_CHUNKS % THREADS == 0, "every thread copies the same activation chunks");
    static_assert(STAGES >= 2, "the pipeline keeps STAGES-1 stages in flight");
};

__device__ __forceinline__ void iqf_cp_async(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void iqf_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Physical 16-byte chunk of logical chunk c in activation row r (rows of 512 bytes, a multiple
// of 128: eight consecutive rows at one logical chunk land in eight distinct bank groups).
__device__ __forceinline__ int iqf_swizzle(int r, int c) { return c ^ (r & 7); }

// Values (sel, sel+1) of grid word gw (magnitude bytes) times db, signs from bits (sel, sel+1)
// of the 8-bit negative mask `neg` shifted so that bit 0 is value sel's: one half2 (value sel
// low), computed as dequant.cu computes each value.
__device__ __forceinline__ unsigned iqf_pair(float db, unsigned gw, int sel, unsigned neg) {
    float f[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        // the magnitude byte under the exponent of 2^23, minus 2^23: the byte as a float
        const float mag = __fsub_rn(
            __uint_as_float(__byte_perm(gw, 0x4B000000u, 0x7540u | (unsigned)(sel + i))),
            8388608.0f);
        f[i] = __uint_as_float(__float_as_uint(__fmul_rn(db, mag)) ^ (((neg >> i) & 1u) << 31));
    }
    const __half2 h2 = __floats2half2_rn(f[0], f[1]);
    return *reinterpret_cast<const unsigned*>(&h2);
}

// 8-bit negative mask of sign group sg (0..3) of a sub-block's sign/scale word: the 7 stored
// bits and bit 7 restoring even parity.
__device__ __forceinline__ unsigned iqf_neg(unsigned word, int sg) {
    const unsigned sidx = (word >> (7 * sg)) & 127u;
    return sidx | ((__popc(sidx) & 1u) << 7);
}

extern __shared__ __align__(128) uint8_t iqf_smem[];

// One BM x BN output tile: activation rows row0 .. row0+nrows-1 (nrows <= BM) against weight
// rows m0 .. m0+BN-1 of the native image img.
template <class C>
__device__ __forceinline__ void fused_tile(const uint8_t* __restrict__ img,
                                           const __half* __restrict__ acts,
                                           float* __restrict__ out, int m, int k, int m0,
                                           int row0, int nrows, const unsigned* s_grid)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn0 = warp * 16;  // this warp's first weight row within the tile
    const int KT = k / IQF_VALUES;
    const long long row_bytes = (long long)KT * IQF_BLOCK;
    const unsigned smem = smem_addr(iqf_smem);

    // ---- global -> shared. Activations: chunk c = tid + i*THREADS is row c / 32, chunk c % 32.
    auto load_stage = [&](int stage, int kt) {
        const unsigned sa = smem + stage * C::STAGE_BYTES;
        const unsigned sw = sa + C::A_BYTES;
#pragma unroll
        for (int i = 0; i < C::A_ITERS; ++i) {
            const int c = tid + i * C::THREADS, r = c >> 5, ch = c & 31;
            const bool ok = r < nrows;
            // rows past the expert's last are zero-filled; their source is never read
            const __half* src = ok ? acts + (size_t)(row0 + r) * k + kt * IQF_VALUES + ch * 8
                                   : acts;
            iqf_cp_async(sa + r * IQF_A_ROW + (iqf_swizzle(r, ch) << 4), src, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < C::W_ITERS; ++i) {
            const int c = tid + i * C::THREADS;
            if (C::W_CHUNKS % C::THREADS == 0 || c < C::W_CHUNKS) {
                const int r = c / IQF_W_CHUNKS, ch = c % IQF_W_CHUNKS;
                const long long start = (long long)(m0 + r) * row_bytes + (long long)kt * IQF_BLOCK;
                iqf_cp_async(sw + r * IQF_W_ROW + ch * 16, img + (start & ~15LL) + ch * 16, 16);
            }
        }
    };

    // ---- per lane: activation ldmatrix rows (lane gives row lane & 15 of each m16 fragment at
    // chunk lane >> 4 of the k16 step -> a0..a3 in mma order) and the weight rows it decodes
    const int a_row = lane & 15, a_chk = lane >> 4;
    int w_row[C::NT], w_mis[C::NT];  // shared row; where the block starts in it at kt = 0
#pragma unroll
    for (int j = 0; j < C::NT; ++j) {
        w_row[j] = wn0 + 8 * j + g;
        w_mis[j] = (int)(((long long)(m0 + w_row[j]) * row_bytes) & 15);
    }
    const int sel = 2 * (t & 1);  // byte of the grid word holding value 2t (and 2t+8)

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
        if (kt + C::STAGES - 1 < KT) load_stage((kt + C::STAGES - 1) % C::STAGES,
                                                kt + C::STAGES - 1);
        cp_async_commit();

        const int st = kt % C::STAGES;
        const unsigned sa = smem + st * C::STAGE_BYTES;
        const uint8_t* sw = iqf_smem + st * C::STAGE_BYTES + C::A_BYTES;
        const uint8_t* blk[C::NT];
        float d[C::NT];
#pragma unroll
        for (int j = 0; j < C::NT; ++j) {
            // 98 = 2 (mod 16): the block of stage kt starts 2*kt bytes further into its chunk
            blk[j] = sw + w_row[j] * IQF_W_ROW + ((w_mis[j] + 2 * kt) & 15);
            d[j] = __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(blk[j])));
        }
#pragma unroll
        for (int sb = 0; sb < 8; ++sb) {  // sub-blocks of 32 values
            unsigned word[C::NT];
            float db[C::NT];
#pragma unroll
            for (int j = 0; j < C::NT; ++j) {
                const unsigned short* wp =
                    reinterpret_cast<const unsigned short*>(blk[j] + 66 + 4 * sb);
                word[j] = (unsigned)wp[0] | ((unsigned)wp[1] << 16);
                db[j] = __fmul_rn(__fmul_rn(d[j], __fadd_rn(0.5f, (float)(word[j] >> 28))), 0.5f);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // k16 step kk = 2*sb + h
                const int kk = 2 * sb + h;
                unsigned af[C::MT][4];
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt) {
                    const int r = mt * 16 + a_row;
                    iqf_ldmatrix_x4(af[mt], sa + r * IQF_A_ROW +
                                                (iqf_swizzle(r, 2 * kk + a_chk) << 4));
                }
                unsigned bf[C::NT][2];
#pragma unroll
                for (int j = 0; j < C::NT; ++j) {
                    // values 16h + 2t, +1 (grid index 4h + t/2, sign group 2h) and 16h + 8 + 2t,
                    // +1 (grid index 4h + 2 + t/2, sign group 2h + 1) of the sub-block
                    const uint8_t* qs = blk[j] + 2 + 8 * sb + 4 * h + (t >> 1);
                    const unsigned g0 = s_grid[qs[0]], g1 = s_grid[qs[2]];
                    bf[j][0] = iqf_pair(db[j], g0, sel, iqf_neg(word[j], 2 * h) >> (2 * t));
                    bf[j][1] = iqf_pair(db[j], g1, sel, iqf_neg(word[j], 2 * h + 1) >> (2 * t));
                }
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                    for (int j = 0; j < C::NT; ++j)
                        mma_f16_16x8x16(acc[mt][j], af[mt], bf[j][0], bf[j][1], acc[mt][j]);
            }
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

// Position p's native image: at weights + p * image bytes in a group buffer, or at srcs.v[p]
// (the in-place entry points: each expert's blob read where it lies, e.g. its resident slot,
// with no gather before the product).
struct Ptrs16 { const uint8_t* v[16]; };

template <class C>
__device__ __forceinline__ void fused_expert(const uint8_t* __restrict__ img,
                                             const GroupedBlock& blk,
                                             const __half* __restrict__ acts,
                                             const int* __restrict__ bounds,
                                             float* __restrict__ out, int m, int k)
{
    require_dynamic_smem(C::SMEM);
    const int e = blk.expert, xt = blk.weight_tile, zt = blk.row_tile;
    const unsigned gz = gridDim.z;
    if (e < 0) return;
    const int r_beg = bounds[e], r_end = bounds[e + 1];
    if (r_beg + zt * C::BM >= r_end) return;  // no row tile for this block

    __shared__ unsigned s_grid[256];
    for (int i = threadIdx.x; i < 256; i += C::THREADS) s_grid[i] = IQ3XXS_GRID[i];
    __syncthreads();

    for (int row0 = r_beg + zt * C::BM; row0 < r_end; row0 += gz * C::BM)
        fused_tile<C>(img, acts, out, m, k, xt * C::BN, row0, min(C::BM, r_end - row0), s_grid);
}

template <class C>
__device__ __forceinline__ void fused_grouped(const uint8_t* __restrict__ weights,
                                              const Ids16& ids, const __half* __restrict__ acts,
                                              const int* __restrict__ bounds,
                                              float* __restrict__ out, int m, int k)
{
    const GroupedBlock blk = grouped_block(ids);  // the same block order as gemm_f16.cu
    const uint8_t* img =
        weights + (size_t)blk.pos * m * ((size_t)(k / IQF_VALUES) * IQF_BLOCK);
    fused_expert<C>(img, blk, acts, bounds, out, m, k);
}

template <class C>
__device__ __forceinline__ void fused_grouped_at(const Ptrs16& srcs, const Ids16& ids,
                                                 const __half* __restrict__ acts,
                                                 const int* __restrict__ bounds,
                                                 float* __restrict__ out, int m, int k)
{
    const GroupedBlock blk = grouped_block(ids);
    if (blk.expert < 0) return;
    const uint8_t* img = nullptr;  // srcs.v[blk.pos] by selects, as grouped_block finds the id
#pragma unroll
    for (int i = 0; i < 16; ++i) img = i == blk.pos ? srcs.v[i] : img;
    fused_expert<C>(img, blk, acts, bounds, out, m, k);
}

// Every expert of a layer in one launch (grid.y = the layer's experts): expert e's image at
// table[e] + offset, none where table[e] is 0; otherwise the in-place entry's tile and body.
template <class C>
__device__ __forceinline__ void fused_table(const unsigned long long* __restrict__ table,
                                            long long offset, const __half* __restrict__ acts,
                                            const int* __restrict__ bounds,
                                            float* __restrict__ out, int m, int k)
{
    const GroupedBlock blk = table_block();
    const uint8_t* img = table_image(table, blk.expert, offset);
    if (img == nullptr) return;
    fused_expert<C>(img, blk, acts, bounds, out, m, k);
}

// name, BM, WARPS (BN = 16 * WARPS), STAGES, min blocks per SM. strata_rt/gemm/fused_gemm.py lists
// the same tiles (a CPU test compares the two lists).
#define FUSED_KERNEL(NAME, BM, WARPS, STAGES, MINB)                                              \
    extern "C" __global__ void __launch_bounds__(FusedCfg<BM, WARPS, STAGES>::THREADS, MINB)    \
    NAME(Ids16 ids, const uint8_t* __restrict__ weights, const __half* __restrict__ acts,       \
         const int* __restrict__ bounds, float* __restrict__ out, int m, int k) {               \
        fused_grouped<FusedCfg<BM, WARPS, STAGES>>(weights, ids, acts, bounds, out, m, k);      \
    }

// The in-place twin of a FUSED_KERNEL: the same tile, position p's image at srcs.v[p].
#define FUSED_AT_KERNEL(NAME, BM, WARPS, STAGES, MINB)                                           \
    extern "C" __global__ void __launch_bounds__(FusedCfg<BM, WARPS, STAGES>::THREADS, MINB)    \
    NAME(Ptrs16 srcs, Ids16 ids, const __half* __restrict__ acts,                               \
         const int* __restrict__ bounds, float* __restrict__ out, int m, int k) {               \
        fused_grouped_at<FusedCfg<BM, WARPS, STAGES>>(srcs, ids, acts, bounds, out, m, k);      \
    }

// The table twin of a FUSED_KERNEL: the same tile over every expert of a layer, expert e's
// image at table[e] + offset.
#define FUSED_TABLE_KERNEL(NAME, BM, WARPS, STAGES, MINB)                                        \
    extern "C" __global__ void __launch_bounds__(FusedCfg<BM, WARPS, STAGES>::THREADS, MINB)    \
    NAME(const unsigned long long* __restrict__ table, long long offset,                        \
         const __half* __restrict__ acts, const int* __restrict__ bounds,                       \
         float* __restrict__ out, int m, int k) {                                               \
        fused_table<FusedCfg<BM, WARPS, STAGES>>(table, offset, acts, bounds, out, m, k);       \
    }

FUSED_KERNEL(iq3_fused_m16, 16, 8, 4, 2)
FUSED_KERNEL(iq3_fused_m32, 32, 8, 3, 2)
FUSED_KERNEL(iq3_fused_m64, 64, 8, 3, 1)
FUSED_AT_KERNEL(iq3_fused_at_m16, 16, 8, 4, 2)
FUSED_AT_KERNEL(iq3_fused_at_m32, 32, 8, 3, 2)
FUSED_AT_KERNEL(iq3_fused_at_m64, 64, 8, 3, 1)
FUSED_TABLE_KERNEL(iq3_fused_tab_m16, 16, 8, 4, 2)
FUSED_TABLE_KERNEL(iq3_fused_tab_m32, 32, 8, 3, 2)
FUSED_TABLE_KERNEL(iq3_fused_tab_m64, 64, 8, 3, 1)
