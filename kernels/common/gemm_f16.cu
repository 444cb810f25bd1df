// Grouped fp16 GEMM with fp32 accumulation over the whole K, for every format whose group buffer
// holds fp16 images (FP16 natively; quantized formats after a dequantizing gather).
//
//   out[r, i] = sum_k acts[r, k] * W_e[i, k]   for every activation row r of every expert e
//
// W_e is the fp16 image at group position p (m x k row-major, at weights + p*m*k*2 bytes);
// acts are fp16 [rows, k] row-major, sorted by expert; bounds[e]..bounds[e+1]-1 are expert e's
// rows; out is float32 [rows, m], written at the same row indices (rows of other experts are
// left alone). The ABI is the MMQ kernels': 16 expert ids by value (unused = -1), weights,
// acts, bounds, out, m, k; grid (m / BN, group position, row tiles).
//
// Block tile: BN = 128 weight rows x BM activation rows (BM = 32, 64 or 128, one kernel each),
// K advanced BK values per pipeline stage. Operands stream global -> shared through a
// STAGES-deep cp.async pipeline (zero fill past the expert's last row), rows of BK fp16 stored
// with an XOR swizzle of their 16-byte chunks so ldmatrix reads are free of bank conflicts;
// warps own WM x WN sub-tiles and run mma.sync m16n8k16 (f16 in, f32 accumulate) with the
// next K step's fragments loaded while the current step multiplies.
//
// Determinism: every output is one accumulator that starts at 0 and takes the k16 steps in
// ascending K order, one mma each; no split-K, no atomics, no reduction across warps. So every
// tile shape and every rows_hint give the same bytes, run after run.
//
// Launch order: the linear block index is remapped so that the row tiles of one (expert,
// weight tile) are adjacent: the blocks sharing a weight tile run together and read it from L2
// rather than HBM. A block loops over row tiles with the grid's row-tile stride, so any grid
// depth is correct (the host may size it from an estimate: the exact counts are read from
// bounds here); an expert without rows costs an exit.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"

template <int BM_, int WM_, int WN_, int BK_, int STAGES_>
struct GemmCfg {
    static constexpr int BM = BM_, BN = 128, WM = WM_, WN = WN_, BK = BK_, STAGES = STAGES_;
    static constexpr int WARPS_M = BM / WM, WARPS_N = BN / WN;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int MT = WM / 16, NT = WN / 8;  // m16 and n8 fragments per warp
    static constexpr int KSTEPS = BK / 16;           // k16 steps per stage
    static constexpr int CH = BK / 8;                // 16-byte chunks per shared row
    static constexpr int ROW_BYTES = BK * 2;
    static constexpr int A_BYTES = BM * ROW_BYTES, B_BYTES = BN * ROW_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    static constexpr int ROWS_PER_PASS = THREADS / CH;  // rows one pass of cp.async covers
    static constexpr int A_PASSES = BM / ROWS_PER_PASS, B_PASSES = BN / ROWS_PER_PASS;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0, "warp tiles");
    static_assert(BK == 32 || BK == 64, "the swizzle covers rows of 4 or 8 chunks");
    static_assert(STAGES >= 3, "the pipeline keeps STAGES-1 tiles in flight");
    static_assert(ROWS_PER_PASS % 8 == 0 && BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0,
                  "every pass of cp.async covers whole rows with one swizzle phase");
};

// Physical 16-byte chunk of logical chunk c in shared row r. Eight consecutive rows (one
// ldmatrix 8x8 matrix) at the same logical chunk land in eight distinct bank groups: rows of
// 128 bytes (CH = 8) permute by r & 7; rows of 64 bytes (CH = 4, two per 128 bytes) by
// (r >> 1) & 3, and the row parity picks the half.
template <int CH>
__device__ __forceinline__ int gemm_swizzle(int r, int c) {
    return CH == 8 ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3));
}

__device__ __forceinline__ void gemm_cp_async(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void gemm_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// One BM x BN output tile: activation rows row0 .. row0+nrows-1 (nrows <= BM) against weight
// rows m0 .. m0+BN-1 of the image w (already offset to row m0).
template <class C>
__device__ __forceinline__ void gemm_tile(const __half* __restrict__ w,
                                          const __half* __restrict__ acts,
                                          float* __restrict__ out, int m, int k, int m0,
                                          int row0, int nrows, unsigned smem)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm0 = (warp / C::WARPS_N) * C::WM;  // this warp's first activation row
    const int wn0 = (warp % C::WARPS_N) * C::WN;  // and first weight row, within the tile

    // ---- global -> shared: thread tid copies chunk tid % CH of rows tid / CH + i*ROWS_PER_PASS
    const int t_row = tid / C::CH, t_ch = tid % C::CH;
    const unsigned s_thr = t_row * C::ROW_BYTES + (gemm_swizzle<C::CH>(t_row, t_ch) << 4);
    const __half* a_src = acts + (size_t)(row0 + t_row) * k + t_ch * 8;
    const __half* b_src = w + (size_t)t_row * k + t_ch * 8;
    const size_t pass_stride = (size_t)C::ROWS_PER_PASS * k;

    auto load_stage = [&](int stage, int kt) {
        const unsigned sa = smem + stage * C::STAGE_BYTES + s_thr;
        const unsigned sb = sa + C::A_BYTES;
        const int k0 = kt * C::BK;
#pragma unroll
        for (int i = 0; i < C::A_PASSES; ++i) {
            const bool ok = t_row + i * C::ROWS_PER_PASS < nrows;
            // rows past the expert's last are zero-filled; their source is never read
            gemm_cp_async(sa + i * C::ROWS_PER_PASS * C::ROW_BYTES,
                          ok ? (const void*)(a_src + i * pass_stride + k0) : (const void*)acts,
                          ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < C::B_PASSES; ++i)
            gemm_cp_async(sb + i * C::ROWS_PER_PASS * C::ROW_BYTES, b_src + i * pass_stride + k0,
                          16);
    };

    // ---- shared -> registers: per-lane ldmatrix row addresses. Rows of a fragment start at a
    // multiple of 8, so the swizzle phase depends on the lane only.
    // A (x4: rows 0-7 / 8-15 of a m16 tile at k chunks 0 / 1): lane gives row lane & 15 at
    // chunk lane >> 4 -> registers a0..a3 in mma order.
    // B (x4: two n8 tiles at k chunks 0 / 1): lane gives row (lane & 7) + 8 * (lane >> 4) at
    // chunk (lane >> 3) & 1 -> b[2j][0], b[2j][1], b[2j+1][0], b[2j+1][1].
    const int a_row = wm0 + (lane & 15), a_chk = lane >> 4;
    const int b_row = wn0 + (lane & 7) + ((lane >> 4) << 3), b_chk = (lane >> 3) & 1;
    const unsigned a_lane = a_row * C::ROW_BYTES;
    const unsigned b_lane = C::A_BYTES + b_row * C::ROW_BYTES;

    auto load_frags = [&](unsigned (&af)[C::MT][4], unsigned (&bf)[C::NT][2], int stage,
                          int kk) {
        const unsigned base = smem + stage * C::STAGE_BYTES;
        const unsigned ao = base + a_lane + (gemm_swizzle<C::CH>(a_row, 2 * kk + a_chk) << 4);
        const unsigned bo = base + b_lane + (gemm_swizzle<C::CH>(b_row, 2 * kk + b_chk) << 4);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) gemm_ldmatrix_x4(af[mt], ao + mt * 16 * C::ROW_BYTES);
#pragma unroll
        for (int j = 0; j < C::NT / 2; ++j) {
            unsigned r[4];
            gemm_ldmatrix_x4(r, bo + j * 16 * C::ROW_BYTES);
            bf[2 * j][0] = r[0];
            bf[2 * j][1] = r[1];
            bf[2 * j + 1][0] = r[2];
            bf[2 * j + 1][1] = r[3];
        }
    };

    float acc[C::MT][C::NT][4];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.0f;

    const int KT = k / C::BK;
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();  // empty groups keep the count uniform
    }
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();

    unsigned af[2][C::MT][4], bf[2][C::NT][2];
    int rs = 0, ws = C::STAGES - 1;  // stage read now, stage the next load goes to
    load_frags(af[0], bf[0], 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int kk = 0; kk < C::KSTEPS; ++kk) {
            if (kk == C::KSTEPS - 1) {
                // tile kt+1 must have landed, and every warp must be past its last fragment
                // load of tile kt-1's stage before the load below overwrites it
                cp_async_wait<C::STAGES - 2>();
                __syncthreads();
                rs = rs + 1 == C::STAGES ? 0 : rs + 1;
            }
            load_frags(af[(kk + 1) & 1], bf[(kk + 1) & 1], rs, (kk + 1) % C::KSTEPS);
            if (kk == 0) {
                if (kt + C::STAGES - 1 < KT) load_stage(ws, kt + C::STAGES - 1);
                cp_async_commit();
                ws = ws + 1 == C::STAGES ? 0 : ws + 1;
            }
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < C::NT; ++nt)
                    mma_f16_16x8x16(acc[mt][nt], af[kk & 1][mt], bf[kk & 1][nt][0],
                                    bf[kk & 1][nt][1], acc[mt][nt]);
        }
    }
    cp_async_wait<0>();

    // ---- registers -> global: lane holds rows g, g+8 and columns 2t, 2t+1 of each fragment
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
        const int r = wm0 + mt * 16 + g;
        float* o0 = out + (size_t)(row0 + r) * m + m0 + wn0 + 2 * t;
        float* o1 = o0 + (size_t)8 * m;
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
            if (r < nrows) *(float2*)(o0 + nt * 8) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            if (r + 8 < nrows)
                *(float2*)(o1 + nt * 8) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
        }
    }
    __syncthreads();  // the next row tile's prologue overwrites the stages
}

extern __shared__ __align__(128) uint8_t gemm_smem[];

template <class C>
__device__ __forceinline__ void gemm_grouped(const uint8_t* __restrict__ weights, const Ids16& ids,
                                             const __half* __restrict__ acts,
                                             const int* __restrict__ bounds,
                                             float* __restrict__ out, int m, int k)
{
    require_dynamic_smem(C::SMEM);
    const GroupedBlock blk = grouped_block(ids);
    const int e = blk.expert, xt = blk.weight_tile;
    if (e < 0) return;
    const int r_end = bounds[e + 1];
    const __half* w = reinterpret_cast<const __half*>(weights) + (size_t)blk.pos * m * k +
                      (size_t)xt * C::BN * k;
    const unsigned smem = smem_addr(gemm_smem);
    for (int row0 = bounds[e] + blk.row_tile * C::BM; row0 < r_end; row0 += gridDim.z * C::BM)
        gemm_tile<C>(w, acts, out, m, k, xt * C::BN, row0, min(C::BM, r_end - row0), smem);
}

// name, BM, WM, WN, BK, STAGES, min blocks per SM. strata_rt/gemm/grouped_gemm.py lists the same
// tiles (a CPU test compares the two lists).
#define GEMM_KERNEL(NAME, BM, WM, WN, BK, STAGES, MINB)                                         \
    extern "C" __global__ void __launch_bounds__(GemmCfg<BM, WM, WN, BK, STAGES>::THREADS, MINB) \
    NAME(Ids16 ids, const uint8_t* __restrict__ weights, const __half* __restrict__ acts,      \
         const int* __restrict__ bounds, float* __restrict__ out, int m, int k) {              \
        gemm_grouped<GemmCfg<BM, WM, WN, BK, STAGES>>(weights, ids, acts, bounds, out, m, k);  \
    }

GEMM_KERNEL(gemm_f16_m128, 128, 64, 64, 32, 4, 2)
GEMM_KERNEL(gemm_f16_m128_k64, 128, 64, 64, 64, 3, 2)
GEMM_KERNEL(gemm_f16_m128_w8, 128, 64, 32, 32, 4, 1)
GEMM_KERNEL(gemm_f16_m64, 64, 32, 64, 32, 4, 3)
GEMM_KERNEL(gemm_f16_m64_k64, 64, 32, 64, 64, 3, 2)
GEMM_KERNEL(gemm_f16_m32, 32, 32, 32, 64, 4, 2)
