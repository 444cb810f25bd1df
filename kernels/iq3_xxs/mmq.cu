// Grouped IQ3_XXS x q8_1 matmul (MMQ) for one group of up to 16 experts.
//
// out[r, i] = sum over 32-value sub-blocks j (ascending K):
//     acc = acc + (dq_i * da_rj) * rint   with rint = (2s_ij + 1) * idot_rij exactly,
// idot = integer dot of weight sign*magnitude and activation int8, dq = fp16 d * 0.25, da the
// activation's per-32 scale; every float op rounds once (no FMA), so the numpy reference
// (quants/iq3_xxs_device.py: mmq_reference) and every variant give the same bits.
//
// Variants (same tiles, same order, differ in how rint is formed on tensor cores):
//   int8: weights unpacked to int8 in shared memory, mma m16n8k32 s8 -> int32 idot, then
//         rint = float(idot) * (2s+1) (both exact; float(idot) by the 1.5*2^23 bias trick).
//   f16:  weights unpacked to fp16 w = (2s+1)*sign*magnitude (|w| <= 1922, exact), int8
//         activations converted to fp16 in registers (exact), two mma m16n8k16 f32 from a zero
//         accumulator: every partial sum is an integer below 2^23, so the result is rint exactly
//         in any accumulation order.
//
// Variant int8_occ2: the int8 kernel with TM <= 64 and registers capped for two blocks per SM.
// Variant f16_pipe (further below): the f16 arithmetic in a software pipeline.
//
// Block: 128 weight rows x TM activation rows, 256 threads (8 warps of 32 rows x 128*WM/TM).
// Grid: x = weight-row tiles (m % 128 == 0), y = group position, z = activation-row tiles
// (looped with stride gridDim.z, so any rows_hint is safe; experts with no rows exit).
// K advances 256 values (one IQ3_XXS block) per step: activation tiles arrive by cp.async
// (double buffered, zero-filled past the expert's rows), the next step's weight bytes are
// loaded into registers during the current step's math and unpacked after it.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/q8_1.cuh"
#include "iq3_xxs/grid.cuh"


#define IQ3_BLOCK_BYTES 98
#define TW 128
#define NTHREADS 256
#define A_STRIDE 304  // 2 q8_1 blocks (288 bytes) + 16: conflict-free ldmatrix rows

enum { VARIANT_INT8 = 0, VARIANT_F16 = 1 };

template <int VARIANT>
struct WeightTile {
    // bytes per weight row per 32-value sub-block, and the padded row stride in shared memory
    static constexpr int SUB_BYTES = VARIANT == VARIANT_F16 ? 64 : 32;
    static constexpr int STRIDE = 8 * SUB_BYTES + (VARIANT == VARIANT_F16 ? 64 : 32);
};

template <int VARIANT, int TM>
struct Smem {
    static constexpr int GRID = 256 * 4;
    static constexpr int W = TW * WeightTile<VARIANT>::STRIDE;
    static constexpr int DQ = TW * 4;
    static constexpr int S21 = VARIANT == VARIANT_INT8 ? 8 * TW * 4 : 0;
    static constexpr int A = TM * A_STRIDE;
    static constexpr int TOTAL = GRID + W + DQ + S21 + 2 * A;
};

// N consecutive 32-bit words from a 2-byte aligned address (IQ3_XXS blocks are 98 bytes), never
// reading outside [p - 2, p + 4N).
template <int N>
__device__ __forceinline__ void load_words_a2(const char* p, unsigned (&w)[N]) {
    if (((uintptr_t)p & 3) == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = __ldg(reinterpret_cast<const unsigned*>(p) + i);
    } else {
        const unsigned* q = reinterpret_cast<const unsigned*>(p - 2);
        unsigned prev = __ldg(q);
#pragma unroll
        for (int i = 0; i < N - 1; ++i) {
            const unsigned next = __ldg(q + i + 1);
            w[i] = __funnelshift_r(prev, next, 16);
            prev = next;
        }
        const unsigned tail = __ldg(reinterpret_cast<const unsigned short*>(p + 4 * N - 2));
        w[N - 1] = (prev >> 16) | (tail << 16);
    }
}

// Raw bytes of one thread's share of a weight block: row tid/2, sub-blocks 4*(tid&1)..+3.
struct RawWeights {
    unsigned idx[8];   // 32 grid indices
    unsigned sgn[4];   // sign/scale words
    unsigned short d;  // fp16 block scale
};

__device__ __forceinline__ void load_raw(RawWeights& r, const char* block, int half) {
    r.d = __ldg(reinterpret_cast<const unsigned short*>(block));
    load_words_a2<8>(block + 2 + 32 * half, r.idx);
    load_words_a2<4>(block + 66 + 16 * half, r.sgn);
}

// Four sign bits -> byte mask (0xff where negative).
__device__ __forceinline__ unsigned sign_bytes(unsigned nib) {
    return ((nib * 0x00204081u) & 0x01010101u) * 0xffu;
}

// Unpacks RawWeights into the shared weight tile. Chunk t (t = 0..3) of a row's sub-block
// holds values 4t..4t+3 and 16+4t..16+4t+3, the order the mma B fragments want (one 8- or
// 16-byte shared load per fragment pair).
template <int VARIANT>
__device__ __forceinline__ void unpack(const RawWeights& r, int row, int half, char* w_s,
                                       float* dq_s, float* s21_s, const unsigned* grid_s) {
    if (half == 0) dq_s[row] = __half2float(__ushort_as_half(r.d)) * 0.25f;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * half + jj;
        const unsigned sw = r.sgn[jj];
        const unsigned s21 = 2 * (sw >> 28) + 1;
        unsigned signs = 0;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned si = (sw >> (7 * l)) & 127u;
            signs |= (si | ((__popc(si) & 1u) << 7)) << (8 * l);
        }
        char* dst = w_s + row * WeightTile<VARIANT>::STRIDE + j * WeightTile<VARIANT>::SUB_BYTES;
        unsigned h2s21 = 0;
        if (VARIANT == VARIANT_F16) {
            const unsigned short hs = __half_as_ushort(__uint2half_rn(s21));
            h2s21 = hs | ((unsigned)hs << 16);
        } else {
            s21_s[j * TW + row] = (float)s21;
        }
        // lanes of a quarter-warp write rows r..r+3 (both halves): rotating the chunk order by
        // row and half spreads their stores over all 32 banks
        const int rot = (row >> 1) + 2 * half;
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
            const int t = (tt + rot) & 3;
            const unsigned g_lo = grid_s[(r.idx[2 * jj] >> (8 * t)) & 255u];
            const unsigned g_hi = grid_s[(r.idx[2 * jj + 1] >> (8 * t)) & 255u];
            const unsigned m_lo = sign_bytes((signs >> (4 * t)) & 15u);
            const unsigned m_hi = sign_bytes((signs >> (16 + 4 * t)) & 15u);
            const unsigned v_lo = __vsub4(g_lo ^ m_lo, m_lo);
            const unsigned v_hi = __vsub4(g_hi ^ m_hi, m_hi);
            if (VARIANT == VARIANT_F16) {
                uint4 h;
                h.x = hmul2_bits(s8x2_to_half2(v_lo, 0x4140), h2s21);
                h.y = hmul2_bits(s8x2_to_half2(v_lo, 0x4342), h2s21);
                h.z = hmul2_bits(s8x2_to_half2(v_hi, 0x4140), h2s21);
                h.w = hmul2_bits(s8x2_to_half2(v_hi, 0x4342), h2s21);
                reinterpret_cast<uint4*>(dst)[t] = h;
            } else {
                reinterpret_cast<uint2*>(dst)[t] = make_uint2(v_lo, v_hi);
            }
        }
    }
}

// Starts the copy of one activation K-step (256 values = 2 q8_1 blocks per row) of TM rows.
template <int TM>
__device__ __forceinline__ void load_acts(char* a_s, const char* acts, long long row0, int nrows,
                                          int kq, int kb) {
    for (int c = threadIdx.x; c < TM * 18; c += NTHREADS) {
        const int r = c / 18, part = c % 18;
        const bool ok = r < nrows;
        const char* src = acts + ((row0 + (ok ? r : 0)) * kq + 2 * kb) * Q8_1_BYTES + 16 * part;
        cp_async16(a_s + r * A_STRIDE + 16 * part, src, ok ? 16 : 0);
    }
}

template <int VARIANT, int TM>
__device__ __forceinline__ void mmq_body(const Ids16& ids, const char* __restrict__ weights,
                                         const char* __restrict__ acts,
                                         const int* __restrict__ bounds, float* __restrict__ out,
                                         int m, int k) {
    constexpr int WARPS_M = TM / 32;          // warps along activation rows
    constexpr int WARPS_N = 8 / WARPS_M;      // warps along weight rows
    constexpr int WN = TW / WARPS_N;          // weight rows per warp
    constexpr int NT = WN / 8;                // n8 tiles per warp
    using S = Smem<VARIANT, TM>;
    using WT = WeightTile<VARIANT>;

    const int expert = ids.v[blockIdx.y];
    if (expert < 0) return;
    const int row_begin = bounds[expert];
    const int nrows_e = bounds[expert + 1] - row_begin;
    if ((int)blockIdx.z * TM >= nrows_e) return;

    // The launcher mirrors Smem<>::TOTAL (quants/iq3_xxs_device.py: mmq_smem_bytes); a
    // mismatch must fail loudly, never write past the allocation.
    require_dynamic_smem(S::TOTAL);

    extern __shared__ __align__(16) char smem[];
    unsigned* grid_s = reinterpret_cast<unsigned*>(smem);
    char* w_s = smem + S::GRID;
    float* dq_s = reinterpret_cast<float*>(w_s + S::W);
    float* s21_s = dq_s + TW;
    char* a_s0 = reinterpret_cast<char*>(dq_s) + S::DQ + S::S21;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int nkb = k / 256, kq = k / Q8_1_VALUES;
    const long long row_bytes = (long long)nkb * IQ3_BLOCK_BYTES;
    const int w0 = blockIdx.x * TW;
    const char* wrow = weights + (long long)blockIdx.y * m * row_bytes +
                       (long long)(w0 + (tid >> 1)) * row_bytes;

    grid_s[tid] = IQ3XXS_GRID[tid];

    for (int rt = blockIdx.z; rt * TM < nrows_e; rt += gridDim.z) {
        const long long row0 = row_begin + (long long)rt * TM;
        const int nrows = min(TM, nrows_e - rt * TM);

        RawWeights raw;
        load_raw(raw, wrow, tid & 1);
        load_acts<TM>(a_s0, acts, row0, nrows, kq, 0);
        cp_async_commit();
        __syncthreads();  // grid_s written; previous tile done with w_s
        unpack<VARIANT>(raw, tid >> 1, tid & 1, w_s, dq_s, s21_s, grid_s);

        float acc[2][NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;

        for (int kb = 0; kb < nkb; ++kb) {
            const bool more = kb + 1 < nkb;
            if (more) {
                load_raw(raw, wrow + (kb + 1) * IQ3_BLOCK_BYTES, tid & 1);
                load_acts<TM>(a_s0 + ((kb + 1) & 1) * S::A, acts, row0, nrows, kq, kb + 1);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();

            const char* a_s = a_s0 + (kb & 1) * S::A;
            float dq[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 v = *reinterpret_cast<const float2*>(dq_s + wn * WN + nt * 8 + 2 * tq);
                dq[nt][0] = v.x;
                dq[nt][1] = v.y;
            }
#pragma unroll 2
            for (int j = 0; j < 8; ++j) {
                const int qoff = (j >> 2) * Q8_1_BYTES + 16 + (j & 3) * 32;
                const int doff = (j >> 2) * Q8_1_BYTES + 4 * (j & 3);
                unsigned af[2][4];
                float da[2][2];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const int r = wm * 32 + mt * 16;
                    ldmatrix_x4(af[mt], a_s + (r + (lane & 7) + 8 * ((lane >> 3) & 1)) * A_STRIDE +
                                            qoff + 16 * (lane >> 4));
                    da[mt][0] = *reinterpret_cast<const float*>(a_s + (r + g) * A_STRIDE + doff);
                    da[mt][1] = *reinterpret_cast<const float*>(a_s + (r + g + 8) * A_STRIDE + doff);
                }
                unsigned ah[2][2][4];  // f16: [mt][h] fragments of the two k16 halves
                if (VARIANT == VARIANT_F16) {
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            ah[mt][h][0] = s8x2_to_half2(af[mt][2 * h], 0x4140);
                            ah[mt][h][1] = s8x2_to_half2(af[mt][2 * h + 1], 0x4140);
                            ah[mt][h][2] = s8x2_to_half2(af[mt][2 * h], 0x4342);
                            ah[mt][h][3] = s8x2_to_half2(af[mt][2 * h + 1], 0x4342);
                        }
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int wr = wn * WN + nt * 8;
                    const char* bp = w_s + (wr + g) * WT::STRIDE + j * WT::SUB_BYTES;
                    float s21[2] = {0.0f, 0.0f};
                    uint4 b;
                    if (VARIANT == VARIANT_F16) {
                        b = reinterpret_cast<const uint4*>(bp)[tq];
                    } else {
                        const uint2 b2 = reinterpret_cast<const uint2*>(bp)[tq];
                        b = make_uint4(b2.x, b2.y, 0, 0);
                        const float2 sv = *reinterpret_cast<const float2*>(s21_s + j * TW + wr + 2 * tq);
                        s21[0] = sv.x;
                        s21[1] = sv.y;
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        float rint[4];
                        if (VARIANT == VARIANT_F16) {
                            const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                            float part[4];
                            mma_f16_16x8x16(part, ah[mt][0], b.x, b.y, zero);
                            mma_f16_16x8x16(rint, ah[mt][1], b.z, b.w, part);
                        } else {
                            int idot[4];
                            mma_s8_16x8x32(idot, af[mt], b.x, b.y);
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float f = __fsub_rn(__int_as_float(idot[e] + 0x4B400000),
                                                          12582912.0f);
                                rint[e] = __fmul_rn(f, s21[e & 1]);
                            }
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float scale = __fmul_rn(dq[nt][e & 1], da[mt][e >> 1]);
                            acc[mt][nt][e] = __fadd_rn(acc[mt][nt][e], __fmul_rn(scale, rint[e]));
                        }
                    }
                }
            }
            __syncthreads();  // all warps done with w_s and this activation buffer
            if (more) unpack<VARIANT>(raw, tid >> 1, tid & 1, w_s, dq_s, s21_s, grid_s);
        }

#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = wm * 32 + mt * 16 + g + 8 * hh;
                if (r >= nrows) continue;
                float* orow = out + (row0 + r) * (long long)m + w0 + wn * WN + 2 * tq;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    *reinterpret_cast<float2*>(orow + nt * 8) =
                        make_float2(acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
            }
    }
}

// MINB = blocks per SM the register budget is sized for (2: at most 128 registers, so two
// blocks of the smaller tiles share an SM and hide each other's unpack and barrier time).
#define IQ3_MMQ(NAME, VARIANT, TM, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(NTHREADS, MINB)                              \
    NAME(Ids16 ids, const char* weights, const char* acts, const int* bounds, float* out,     \
         int m, int k) {                                                                      \
        mmq_body<VARIANT, TM>(ids, weights, acts, bounds, out, m, k);                         \
    }                                                                                         \

IQ3_MMQ(iq3_mmq_int8_m32, VARIANT_INT8, 32, 1)
IQ3_MMQ(iq3_mmq_int8_m64, VARIANT_INT8, 64, 1)
IQ3_MMQ(iq3_mmq_int8_m128, VARIANT_INT8, 128, 1)
IQ3_MMQ(iq3_mmq_f16_m32, VARIANT_F16, 32, 1)
IQ3_MMQ(iq3_mmq_f16_m64, VARIANT_F16, 64, 1)
IQ3_MMQ(iq3_mmq_f16_m128, VARIANT_F16, 128, 1)
IQ3_MMQ(iq3_mmq_int8_occ2_m32, VARIANT_INT8, 32, 2)
IQ3_MMQ(iq3_mmq_int8_occ2_m64, VARIANT_INT8, 64, 2)

// ------------------------------------------------------------------------------ f16_pipe
// The f16 arithmetic (w = (2s+1) * sign * magnitude in fp16, two m16n8k16 per 32 values from a
// zero accumulator) in a software pipeline of half-block steps (128 values of K):
//   - the dequantized weight tile is double buffered: while the warps multiply step h, each
//     also unpacks step h+1 into the other buffer, one chunk per 32-value sub-block of the
//     multiply loop, so the unpack's ALU and shared-memory work fills the tensor-core latency;
//     one barrier per step;
//   - activations arrive by cp.async three steps deep; raw IQ3 bytes for step h+2 are loaded
//     into registers while step h+1's are unpacked;
//   - the unpack reads fp16 magnitudes and fp16 sign masks from two small shared tables (grid
//     entry -> 4 halves; 7 sign bits + parity -> 4 half2 masks), so one half2 costs one xor
//     and one multiply;
//   - the weight tile is unpadded (256 bytes per row) with an XOR swizzle of its 16-byte
//     chunks, conflict-free for both the unpack stores and the B-fragment loads.
//   - NW warps per block (8 in f16_pipe; 16 with a 128-register cap was measured on an H200
//     and was slower, bench/notes.md run 4); warps are numbered along the weight rows first,
//     so on an expert's last, partial tile the warps that still have rows spread over the
//     four schedulers.
#define PIPE_ROW 256       // bytes per weight row per step: 4 sub-blocks x 32 fp16
#define PIPE_A_STAGES 3

template <int TM>
struct PipeSmem {
    static constexpr int GRID16 = 256 * 8;
    static constexpr int SIGNS = 128 * 16;
    static constexpr int W = TW * PIPE_ROW;
    static constexpr int DQ = TW * 4;
    static constexpr int A = TM * Q8_1_BYTES;
    static constexpr int TOTAL = GRID16 + SIGNS + 2 * W + 2 * DQ + PIPE_A_STAGES * A;
};

// Tile geometry of one pipe configuration: NW warps over TW weight rows x TM activation rows;
// each thread unpacks NS of the 4 sub-blocks of one weight row per step.
template <int TM, int NW>
struct PipeCfg {
    static constexpr int NTH = 32 * NW;
    static constexpr int WARPS_M = TM / 32;
    static constexpr int WARPS_N = NW / WARPS_M;
    static constexpr int WN = TW / WARPS_N;
    static constexpr int NT = WN / 8;
    static constexpr int NS = 4 * TW / NTH;    // sub-blocks per thread per step (2 or 1)
    static constexpr int PARTS = 4 / NS;       // threads per weight row
};

__device__ __forceinline__ unsigned half2_of(unsigned lo, unsigned hi) {
    return (unsigned)__half_as_ushort(__uint2half_rn(lo)) |
           ((unsigned)__half_as_ushort(__uint2half_rn(hi)) << 16);
}

// One thread's raw bytes for one step: NS sub-blocks of one row (16-bit loads: blocks are only
// 2-byte aligned).
template <int NS>
struct PipeRaw {
    unsigned idx[NS][4];  // 16-bit halves of the two grid-index words per sub-block
    unsigned sgn[NS][2];  // 16-bit halves of the sign/scale word per sub-block
    unsigned d;
};

// Sub-block jl (0..3) of step hs: IQ3 block hs/2, sub-block 4*(hs&1) + jl.
template <int NS>
__device__ __forceinline__ void pipe_load_sub(PipeRaw<NS>& r, const char* wrow, int hs, int jl,
                                              int jj) {
    const char* blk = wrow + (hs >> 1) * IQ3_BLOCK_BYTES;
    const int sb = 4 * (hs & 1) + jl;
    const unsigned short* p = reinterpret_cast<const unsigned short*>(blk + 2 + 8 * sb);
    const unsigned short* s = reinterpret_cast<const unsigned short*>(blk + 66 + 4 * sb);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.idx[jj][i] = __ldg(p + i);
    r.sgn[jj][0] = __ldg(s);
    r.sgn[jj][1] = __ldg(s + 1);
}

template <int NS>
__device__ __forceinline__ void pipe_load_d(PipeRaw<NS>& r, const char* wrow, int hs) {
    r.d = __ldg(reinterpret_cast<const unsigned short*>(wrow + (hs >> 1) * IQ3_BLOCK_BYTES));
}

// Swizzle of a row's 16-byte chunks (chunk 4*jl + t holds sub-block jl's chunk t): spreads
// the 8 lanes of an unpack store phase (NS=2: rows r..r+3 x two thread parts; NS=1: rows
// r, r+1 x four parts) and of a B-fragment load phase (rows g, g+1 x four chunks) over all
// 32 banks. Bit 2 = row parity (separates the load phase's two rows).
template <int NS>
__device__ __forceinline__ int pipe_swz(int row, int jl) {
    const int mid = NS == 2 ? (row >> 1) & 1 : row & 1;
    return ((row & 1) << 2) | (mid << 1) | (jl >> 1);
}

// Chunks 2c, 2c+1 of sub-block jl of raw slot jj -> fp16 weight tile `w`.
// Chunk t of a sub-block holds values 4t..4t+3 and 16+4t..16+4t+3 (the B-fragment order).
template <int NS>
__device__ __forceinline__ void pipe_unpack(const PipeRaw<NS>& r, int jj, int jl, int c, int row,
                                            char* w, float* dq, const uint2* grid16,
                                            const uint4* signs) {
    if (jl == 0 && c == 0) dq[row] = __half2float(__ushort_as_half((unsigned short)r.d)) * 0.25f;
    const unsigned i0 = r.idx[jj][0] | (r.idx[jj][1] << 16);  // values 0..15
    const unsigned i1 = r.idx[jj][2] | (r.idx[jj][3] << 16);  // values 16..31
    const unsigned sw = r.sgn[jj][0] | (r.sgn[jj][1] << 16);
    const unsigned s21 = 2 * (sw >> 28) + 1;
    const unsigned h2s21 = half2_of(s21, s21);
    const uint4 mlo = signs[(sw >> (7 * c)) & 127u];        // values 8c..8c+7
    const uint4 mhi = signs[(sw >> (7 * (2 + c))) & 127u];  // values 16+8c..16+8c+7
    const int swz = pipe_swz<NS>(row, jl);
    char* dst = w + row * PIPE_ROW;
#pragma unroll
    for (int tt = 0; tt < 2; ++tt) {
        const int t = 2 * c + tt;
        const uint2 glo = grid16[(i0 >> (8 * t)) & 255u];
        const uint2 ghi = grid16[(i1 >> (8 * t)) & 255u];
        uint4 h;
        h.x = hmul2_bits(glo.x, h2s21 ^ (tt ? mlo.z : mlo.x));
        h.y = hmul2_bits(glo.y, h2s21 ^ (tt ? mlo.w : mlo.y));
        h.z = hmul2_bits(ghi.x, h2s21 ^ (tt ? mhi.z : mhi.x));
        h.w = hmul2_bits(ghi.y, h2s21 ^ (tt ? mhi.w : mhi.y));
        reinterpret_cast<uint4*>(dst)[(4 * jl + t) ^ swz] = h;
    }
}

// Starts the copy of one step's activations (one q8_1 block per row) of TM rows.
template <int TM, int NTH>
__device__ __forceinline__ void pipe_load_acts(char* a_s, const char* acts, long long row0,
                                               int nrows, int kq, int hs) {
    for (int c = threadIdx.x; c < TM * 9; c += NTH) {
        const int r = c / 9, part = c % 9;
        const bool ok = r < nrows;
        const char* src = acts + ((row0 + (ok ? r : 0)) * kq + hs) * Q8_1_BYTES + 16 * part;
        cp_async16(a_s + r * Q8_1_BYTES + 16 * part, src, ok ? 16 : 0);
    }
}

// The thread's unpack work of one step is 2*NS chunk pairs, done after the multiply of j
// when q = unpack_slot(j) >= 0; the raw bytes of a sub-block are reloaded (for the step after
// next) as soon as its second pair is unpacked.
template <int NS>
__device__ __forceinline__ void pipe_unpack_at(int j, PipeRaw<NS>& raw, int urow, int upart,
                                               char* w_next, float* dq_next, const uint2* grid16,
                                               const uint4* signs, const char* wrow,
                                               int hs_prefetch) {
    constexpr int EVERY = 2 / NS;  // multiply sub-blocks per unpacked chunk pair
    if ((j + 1) % EVERY) return;
    const int q = j / EVERY, jj = q >> 1, c = q & 1, jl = upart * NS + jj;
    pipe_unpack<NS>(raw, jj, jl, c, urow, w_next, dq_next, grid16, signs);
    if (q == 0) pipe_load_d(raw, wrow, hs_prefetch);
    if (c == 1) pipe_load_sub(raw, wrow, hs_prefetch, jl, jj);
}

// One step: multiply weight buffer w_cur by activation buffer a_s; when UNPACK, unpack the
// next step's raw bytes into w_next (and start loading the step after next).
template <int TM, int NW, bool UNPACK>
__device__ __forceinline__ void pipe_step(float (&acc)[2][PipeCfg<TM, NW>::NT][4],
                                          PipeRaw<PipeCfg<TM, NW>::NS>& raw, const char* w_cur,
                                          const float* dq_cur, const char* a_s, char* w_next,
                                          float* dq_next, const uint2* grid16,
                                          const uint4* signs, const char* wrow,
                                          int hs_prefetch) {
    using C = PipeCfg<TM, NW>;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    const int urow = tid / C::PARTS, upart = tid % C::PARTS;
    const int gswz = pipe_swz<C::NS>(g, 0);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        unsigned af[2][4];
        float da[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int r = wm * 32 + mt * 16;
            ldmatrix_x4(af[mt], a_s + (r + (lane & 7) + 8 * ((lane >> 3) & 1)) * Q8_1_BYTES +
                                    16 + 32 * j + 16 * (lane >> 4));
            da[mt][0] = *reinterpret_cast<const float*>(a_s + (r + g) * Q8_1_BYTES + 4 * j);
            da[mt][1] = *reinterpret_cast<const float*>(a_s + (r + g + 8) * Q8_1_BYTES + 4 * j);
        }
        unsigned ah[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                ah[mt][h][0] = s8x2_to_half2(af[mt][2 * h], 0x4140);
                ah[mt][h][1] = s8x2_to_half2(af[mt][2 * h + 1], 0x4140);
                ah[mt][h][2] = s8x2_to_half2(af[mt][2 * h], 0x4342);
                ah[mt][h][3] = s8x2_to_half2(af[mt][2 * h + 1], 0x4342);
            }
        const int chunk = (4 * j + tq) ^ gswz ^ (j >> 1);
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
            const int wr = wn * C::WN + nt * 8;
            const uint4 b = lds128(w_cur + (wr + g) * PIPE_ROW + 16 * chunk);
            const float2 dq = *reinterpret_cast<const float2*>(dq_cur + wr + 2 * tq);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                float part[4], rint[4];
                mma_f16_16x8x16(part, ah[mt][0], b.x, b.y, zero);
                mma_f16_16x8x16(rint, ah[mt][1], b.z, b.w, part);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float scale = __fmul_rn(e & 1 ? dq.y : dq.x, da[mt][e >> 1]);
                    acc[mt][nt][e] = __fadd_rn(acc[mt][nt][e], __fmul_rn(scale, rint[e]));
                }
            }
        }
        if (UNPACK)
            pipe_unpack_at<C::NS>(j, raw, urow, upart, w_next, dq_next, grid16, signs, wrow,
                                  hs_prefetch);
    }
}

template <int TM, int NW>
__device__ __forceinline__ void mmq_pipe_body(const Ids16& ids, const char* __restrict__ weights,
                                              const char* __restrict__ acts,
                                              const int* __restrict__ bounds,
                                              float* __restrict__ out, int m, int k) {
    using S = PipeSmem<TM>;
    using C = PipeCfg<TM, NW>;
    constexpr int NS = C::NS;

    const int expert = ids.v[blockIdx.y];
    if (expert < 0) return;
    const int row_begin = bounds[expert];
    const int nrows_e = bounds[expert + 1] - row_begin;
    if ((int)blockIdx.z * TM >= nrows_e) return;

    require_dynamic_smem(S::TOTAL);

    extern __shared__ __align__(16) char smem[];
    uint2* grid16 = reinterpret_cast<uint2*>(smem);
    uint4* signs = reinterpret_cast<uint4*>(smem + S::GRID16);
    char* w_s = smem + S::GRID16 + S::SIGNS;
    float* dq_s = reinterpret_cast<float*>(w_s + 2 * S::W);
    char* a_s0 = w_s + 2 * S::W + 2 * S::DQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = warp / C::WARPS_N, wn = warp % C::WARPS_N;
    const int urow = tid / C::PARTS, upart = tid % C::PARTS;
    const int nhs = k / Q8_1_VALUES, kq = nhs;
    const long long row_bytes = (long long)(k / 256) * IQ3_BLOCK_BYTES;
    const int w0 = blockIdx.x * TW;
    const char* wrow = weights + (long long)blockIdx.y * m * row_bytes +
                       (long long)(w0 + urow) * row_bytes;

    if (tid < 256) {
        const unsigned gw = IQ3XXS_GRID[tid];
        grid16[tid] = make_uint2(half2_of(gw & 255u, (gw >> 8) & 255u),
                                 half2_of((gw >> 16) & 255u, gw >> 24));
    }
    if (tid < 128) {
        const unsigned s8 = tid | ((__popc(tid) & 1u) << 7);
        unsigned q[4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
            q[p] = (((s8 >> (2 * p)) & 1u) << 15) | (((s8 >> (2 * p + 1)) & 1u) << 31);
        signs[tid] = make_uint4(q[0], q[1], q[2], q[3]);
    }

    for (int rt = blockIdx.z; rt * TM < nrows_e; rt += gridDim.z) {
        const long long row0 = row_begin + (long long)rt * TM;
        const int nrows = min(TM, nrows_e - rt * TM);
        // warps whose 32 activation rows are all past the expert's end only unpack: on an
        // expert's last, partial tile their issue slots go to the warps that multiply
        const bool busy = wm * 32 < nrows;

        PipeRaw<NS> raw;
        pipe_load_d(raw, wrow, 0);
#pragma unroll
        for (int jj = 0; jj < NS; ++jj) pipe_load_sub(raw, wrow, 0, upart * NS + jj, jj);
        pipe_load_acts<TM, C::NTH>(a_s0, acts, row0, nrows, kq, 0);
        cp_async_commit();
        pipe_load_acts<TM, C::NTH>(a_s0 + S::A, acts, row0, nrows, kq, 1);
        cp_async_commit();
        __syncthreads();  // tables written; the previous row tile is done with every buffer
#pragma unroll
        for (int q = 0; q < 2 * NS; ++q)
            pipe_unpack<NS>(raw, q >> 1, upart * NS + (q >> 1), q & 1, urow, w_s, dq_s, grid16,
                            signs);
        pipe_load_d(raw, wrow, 1);
#pragma unroll
        for (int jj = 0; jj < NS; ++jj) pipe_load_sub(raw, wrow, 1, upart * NS + jj, jj);

        float acc[2][C::NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
        cp_async_wait<1>();
        __syncthreads();

        // nhs is even (k % 256 == 0), so the last step always exists and never unpacks
        int hs = 0;
        for (; hs < nhs - 1; ++hs) {
            if (hs + 2 < nhs)
                pipe_load_acts<TM, C::NTH>(a_s0 + ((hs + 2) % PIPE_A_STAGES) * S::A, acts, row0,
                                           nrows, kq, hs + 2);
            cp_async_commit();
            const int cur = hs & 1;
            char* w_next = w_s + (cur ^ 1) * S::W;
            float* dq_next = dq_s + (cur ^ 1) * TW;
            const int pre = min(hs + 2, nhs - 1);
            if (busy) {
                pipe_step<TM, NW, true>(acc, raw, w_s + cur * S::W, dq_s + cur * TW,
                                        a_s0 + (hs % PIPE_A_STAGES) * S::A, w_next, dq_next,
                                        grid16, signs, wrow, pre);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    pipe_unpack_at<NS>(j, raw, urow, upart, w_next, dq_next, grid16, signs, wrow,
                                       pre);
            }
            cp_async_wait<1>();
            __syncthreads();
        }
        if (busy)
            pipe_step<TM, NW, false>(acc, raw, w_s + (hs & 1) * S::W, dq_s + (hs & 1) * TW,
                                     a_s0 + (hs % PIPE_A_STAGES) * S::A, nullptr, nullptr,
                                     grid16, signs, wrow, hs);
        cp_async_wait<0>();
        __syncthreads();  // the next row tile's prologue overwrites every buffer

#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = wm * 32 + mt * 16 + g + 8 * hh;
                if (r >= nrows) continue;
                float* orow = out + (row0 + r) * (long long)m + w0 + wn * C::WN + 2 * tq;
#pragma unroll
                for (int nt = 0; nt < C::NT; ++nt)
                    *reinterpret_cast<float2*>(orow + nt * 8) =
                        make_float2(acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
            }
    }
}

#define IQ3_MMQ_PIPE(NAME, TM, NW)                                                            \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1)                                  \
    NAME(Ids16 ids, const char* weights, const char* acts, const int* bounds, float* out,     \
         int m, int k) {                                                                      \
        mmq_pipe_body<TM, NW>(ids, weights, acts, bounds, out, m, k);                         \
    }

IQ3_MMQ_PIPE(iq3_mmq_f16_pipe_m32, 32, 8)
IQ3_MMQ_PIPE(iq3_mmq_f16_pipe_m64, 64, 8)
IQ3_MMQ_PIPE(iq3_mmq_f16_pipe_m128, 128, 8)
