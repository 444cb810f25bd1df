// Attention of one layer of a Qwen3 model over a chunk of T tokens at absolute positions
// start .. start+T-1 and the KV cache of the positions before them.
//
// qk_norm_rope_hd{64,128}: qkv fp16 [T, q_dim + 2*kv_dim] (q heads | k heads | v heads per row)
//   -> q fp16 [T, n_heads, hd]; k and v into the cache rows start+t ([context, n_kv, hd] each).
//   q and k heads: RMSNorm over hd in float32 (weights float32 [hd]), then RoPE rotating the two
//   halves with the float32 tables cos/sin [context, hd/2] at row start+t; v is copied. One warp
//   per (token, head); the sum of squares is a fixed xor tree, so every run gives the same bytes.
//
// attend_hd{64,128}: causal flash attention, fp16 tensor cores (mma.sync m16n8k16) with float32
//   accumulation. One block serves every query head of one KV head for P = 128 / group query
//   positions (block row r is position r / group, head r % group), so each K/V tile is read
//   from memory once per group. 4 warps of 32 rows (two m16 tiles each); K/V tiles of 64 cache
//   rows stream through a double-buffered cp.async pipeline; the online softmax takes each tile
//   in steps of SUB keys (64, or 32 for hd 128 so the scores fit in registers beside the
//   128-float accumulator) and keeps a float32 running max m and sum l per row; probabilities
//   are rounded to fp16 for p.v and the same rounded values are summed into l.
//   out fp16 [T, n_heads * hd]. Shared memory: 128 query rows + 2 x (K + V tile), 96 KiB at
//   hd 128 (two blocks per SM on sm_90), 48 KiB at hd 64.
//
// Determinism and chunk invariance. A query row's result is a fixed function of its own q, its
// position and the cache rows 0..position: the KV steps sit at absolute positions j*SUB from 0,
// every dot product is one chain of mma steps in ascending hd order, the row max and row sum
// are per row (quad shuffles in a fixed order), there is no split over the KV length and no
// atomics. A tile past a row's position is an exact no-op: its scores are -inf, so the max does
// not move, alpha is set to exactly 1 (not computed) and the probabilities are exactly 0, which
// add nothing to l or to the accumulator. Cache rows at or past start+T are never read (the
// tile is zero-filled there). So a query gives the same bytes whether its prompt came in one
// chunk or in several, and whichever other rows share its block.
//
// start_dev (both kernels, last argument): when not null, the chunk's start is read from this
// device int instead of `start`, so one captured decode step replays at every position.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/prior_grid.cuh"

// ============================================================================ qk norm + rope
#define NR_WARPS 8

template <int HD>
__device__ __forceinline__ void qk_norm_rope(const __half* __restrict__ qkv, int T, int start,
                                             const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm,
                                             const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t, float eps,
                                             __half* __restrict__ q_out,
                                             __half* __restrict__ k_cache,
                                             __half* __restrict__ v_cache, int n_heads,
                                             int n_kv) {
    constexpr int HALF = HD / 2, E = HALF / 32;  // pairs (i, i + HALF) per lane
    const int lane = threadIdx.x & 31;
    const int heads = n_heads + 2 * n_kv;
    const long long w = (long long)blockIdx.x * NR_WARPS + (threadIdx.x >> 5);
    if (w >= (long long)T * heads) return;
    const int t = (int)(w / heads), j = (int)(w % heads);
    const int pos = start + t;
    const __half* src = qkv + (size_t)t * heads * HD + (size_t)j * HD;
    if (j >= n_heads + n_kv) {  // v head: copied as it is
        __half* dst = v_cache + ((size_t)pos * n_kv + (j - n_heads - n_kv)) * HD;
#pragma unroll
        for (int e = 0; e < 2 * E; ++e) dst[lane + 32 * e] = src[lane + 32 * e];
        return;
    }
    const bool is_q = j < n_heads;
    const float* wn = is_q ? q_norm : k_norm;
    __half* dst = is_q ? q_out + ((size_t)t * n_heads + j) * HD
                       : k_cache + ((size_t)pos * n_kv + (j - n_heads)) * HD;
    float x1[E], x2[E];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        x1[e] = __half2float(src[lane + 32 * e]);
        x2[e] = __half2float(src[HALF + lane + 32 * e]);
        ss = fmaf(x1[e], x1[e], ss);
        ss = fmaf(x2[e], x2[e], ss);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = 1.0f / sqrtf(ss / (float)HD + eps);
    const float* cr = cos_t + (size_t)pos * HALF;
    const float* sr = sin_t + (size_t)pos * HALF;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int i = lane + 32 * e;
        const float n1 = x1[e] * inv * wn[i], n2 = x2[e] * inv * wn[HALF + i];
        const float c = cr[i], s = sr[i];
        dst[i] = __float2half_rn(n1 * c - n2 * s);
        dst[HALF + i] = __float2half_rn(n2 * c + n1 * s);
    }
}

#define QK_NORM_ROPE_KERNEL(HD)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * NR_WARPS) qk_norm_rope_hd##HD(            \
        const __half* __restrict__ qkv, int T, int start, const float* __restrict__ q_norm,    \
        const float* __restrict__ k_norm, const float* __restrict__ cos_t,                     \
        const float* __restrict__ sin_t, float eps, __half* __restrict__ q_out,                \
        __half* __restrict__ k_cache, __half* __restrict__ v_cache, int n_heads, int n_kv,     \
        const int* __restrict__ start_dev) {                                                   \
        wait_prior_grid();                                                                     \
        const int s0 = start_dev != nullptr ? *start_dev : start;                              \
        qk_norm_rope<HD>(qkv, T, s0, q_norm, k_norm, cos_t, sin_t, eps, q_out, k_cache,        \
                         v_cache, n_heads, n_kv);                                              \
    }

QK_NORM_ROPE_KERNEL(64)
QK_NORM_ROPE_KERNEL(128)

// ============================================================================ flash attention
#define AT_ROWS 128   // query rows per block (positions x heads of one group)
#define AT_WARPS 4    // 32 rows (two m16 tiles) per warp
#define AT_KV 64      // cache rows per K/V tile
#define AT_THREADS (32 * AT_WARPS)

template <int HD>
struct AttnCfg {
    static constexpr int CH = HD / 8;                 // 16-byte chunks per row
    static constexpr int ROW_BYTES = HD * 2;
    static constexpr int Q_BYTES = AT_ROWS * ROW_BYTES;
    static constexpr int KV_BYTES = AT_KV * ROW_BYTES;  // one K (or V) tile
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;    // K then V
    static constexpr int SMEM = Q_BYTES + 2 * STAGE_BYTES;
    static constexpr int ROWS_PER_PASS = AT_THREADS / CH;
    static constexpr int Q_PASSES = AT_ROWS / ROWS_PER_PASS;
    static constexpr int KV_PASSES = AT_KV / ROWS_PER_PASS;
    static constexpr int DT = HD / 8;    // n8 tiles of the output per m16 tile
    static constexpr int KS = HD / 16;   // k16 steps of q.k
    // keys per softmax step (a K/V tile is taken in AT_KV / SUB steps): fewer score registers
    // for hd 128, whose accumulator already holds 128 floats per thread
    static constexpr int SUB = HD == 128 ? 32 : 64;
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    static_assert(ROWS_PER_PASS % 8 == 0, "a pass covers whole swizzle phases");
};

// Physical chunk of logical chunk c in row r: eight rows at one logical chunk (one ldmatrix
// 8x8 matrix) fall in eight distinct 16-byte bank groups (rows are 128 or 256 bytes).
__device__ __forceinline__ int at_swz(int r, int c) { return c ^ (r & 7); }

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_addr(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void cp_async16_addr(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

extern __shared__ __align__(128) uint8_t at_smem[];

template <int HD>
__device__ __forceinline__ void attend(const __half* __restrict__ q,
                                       const __half* __restrict__ k_cache,
                                       const __half* __restrict__ v_cache,
                                       __half* __restrict__ out, int T, int start, int n_heads,
                                       int n_kv, float scale_log2) {
    using C = AttnCfg<HD>;
    require_dynamic_smem(C::SMEM);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = n_heads / n_kv;
    const int P = AT_ROWS / group;   // query positions per block
    const int rows = P * group;      // block rows in use (<= AT_ROWS)
    const int kvh = blockIdx.y;
    // the longest blocks (latest positions) first
    const int p0 = (gridDim.x - 1 - blockIdx.x) * P;
    const int np = min(P, T - p0);   // positions of this block
    const int kv_len = start + T;    // cache rows 0 .. kv_len-1 hold data
    const int last = start + p0 + np - 1;
    const int n_tiles = last / AT_KV + 1;
    const size_t q_row_stride = (size_t)n_heads * HD;

    const unsigned smem = smem_addr(at_smem);
    const unsigned sq = smem, skv = smem + C::Q_BYTES;

    // ---- global -> shared. Thread tid copies chunk tid % CH of rows tid / CH + i*ROWS_PER_PASS.
    const int t_row = tid / C::CH, t_ch = tid % C::CH;
    const unsigned s_thr = t_row * C::ROW_BYTES + (at_swz(t_row, t_ch) << 4);
#pragma unroll 4
    for (int i = 0; i < C::Q_PASSES; ++i) {
        const int r = t_row + i * C::ROWS_PER_PASS;
        const int p = r / group, h = r - p * group;
        const bool ok = r < rows && p < np;
        const __half* src = q + (size_t)(p0 + p) * q_row_stride +
                            (size_t)(kvh * group + h) * HD + t_ch * 8;
        cp_async16_addr(sq + s_thr + i * C::ROWS_PER_PASS * C::ROW_BYTES,
                        ok ? (const void*)src : (const void*)q, ok ? 16 : 0);
    }
    const size_t kv_row_stride = (size_t)n_kv * HD;
    const __half* k_src = k_cache + (size_t)kvh * HD + t_ch * 8;
    const __half* v_src = v_cache + (size_t)kvh * HD + t_ch * 8;
    auto load_tile = [&](int stage, int tile) {
        const unsigned dk = skv + stage * C::STAGE_BYTES + s_thr;
#pragma unroll
        for (int i = 0; i < C::KV_PASSES; ++i) {
            const int key = tile * AT_KV + t_row + i * C::ROWS_PER_PASS;
            const bool ok = key < kv_len;
            const size_t off = (size_t)key * kv_row_stride;
            cp_async16_addr(dk + i * C::ROWS_PER_PASS * C::ROW_BYTES,
                            ok ? (const void*)(k_src + off) : (const void*)k_cache, ok ? 16 : 0);
            cp_async16_addr(dk + C::KV_BYTES + i * C::ROWS_PER_PASS * C::ROW_BYTES,
                            ok ? (const void*)(v_src + off) : (const void*)v_cache, ok ? 16 : 0);
        }
    };
    load_tile(0, 0);
    cp_async_commit();  // group: Q and tile 0

    // ---- this lane's rows: r = warp*32 + mt*16 + g + 8*hf; their absolute query positions
    const int g = lane >> 2, t4 = lane & 3;
    int qpos[2][2];
    int w_min = 0x7fffffff, w_max = -1;  // positions of the warp's rows in use
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = warp * 32 + mt * 16 + g + 8 * hf;
            const int p = r / group;
            qpos[mt][hf] = (r < rows && p < np) ? start + p0 + p : start + p0;
        }
    {
        const int r_lo = warp * 32, r_hi = min(warp * 32 + 31, rows - 1);
        if (r_lo < rows && r_lo / group < np) {
            w_min = start + p0 + r_lo / group;
            w_max = start + p0 + min(r_hi / group, np - 1);
        }
    }

    // ldmatrix lane addresses (before the swizzle and the k offset)
    // Q (A operand): row lane & 15 of the m16 tile, chunk +(lane >> 4)
    const int qa_row = warp * 32 + (lane & 15), qa_chk = lane >> 4;
    // K (B operand of q.k): key (lane & 7) + 8 * (lane >> 4), chunk +((lane >> 3) & 1)
    const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_chk = (lane >> 3) & 1;
    // V (B operand of p.v, transposed): key (lane & 7) + 8 * ((lane >> 3) & 1), chunk +(lane >> 4)
    const int vb_row = (lane & 7) + (((lane >> 3) & 1) << 3), vb_chk = lane >> 4;
    // The swizzled chunk of logical chunk 2i + chk in row r is (2i + chk) ^ (r & 7) =
    // 2i ^ (chk ^ (r & 7)): its byte offset is the lane's offset XOR 32i (rows are >= 128 bytes
    // and 32i < ROW_BYTES), one instruction per ldmatrix instead of a register per address.
    const unsigned qa_off = qa_row * C::ROW_BYTES + ((qa_chk ^ (qa_row & 7)) << 4);
    const unsigned kb_off = kb_row * C::ROW_BYTES + ((kb_chk ^ (kb_row & 7)) << 4);
    const unsigned vb_off = vb_row * C::ROW_BYTES + ((vb_chk ^ (vb_row & 7)) << 4);

    float acc[2][C::DT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int d = 0; d < C::DT; ++d)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][d][c] = 0.0f;
    float m_run[2][2], l_run[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            m_run[mt][hf] = -INFINITY;
            l_run[mt][hf] = 0.0f;
        }

    for (int tile = 0; tile < n_tiles; ++tile) {
        const int stage = tile & 1;
        if (tile + 1 < n_tiles) load_tile(stage ^ 1, tile + 1);
        cp_async_commit();  // possibly empty: keeps the group count uniform
        cp_async_wait<1>();
        __syncthreads();

#pragma unroll 1
        for (int sub = 0; sub < AT_KV / C::SUB; ++sub) {
            const int key0 = tile * AT_KV + sub * C::SUB;
            // past every row of this warp: all masked, an exact no-op
            if (key0 > w_max) break;
            const unsigned sk = skv + stage * C::STAGE_BYTES + sub * C::SUB * C::ROW_BYTES;
            const unsigned sv = sk + C::KV_BYTES;
            // ---- scores s = q . k for 32 rows x SUB keys
            float s[2][C::SUB / 8][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int n = 0; n < C::SUB / 8; ++n)
#pragma unroll
                    for (int c = 0; c < 4; ++c) s[mt][n][c] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < C::KS; ++kk) {
                unsigned a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    ldmatrix_x4_addr(a[mt], sq + mt * 16 * C::ROW_BYTES + (qa_off ^ (kk * 32)));
                }
#pragma unroll
                for (int n2 = 0; n2 < C::SUB / 16; ++n2) {
                    unsigned b[4];
                    ldmatrix_x4_addr(b, sk + n2 * 16 * C::ROW_BYTES + (kb_off ^ (kk * 32)));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_f16_16x8x16(s[mt][2 * n2], a[mt], b[0], b[1], s[mt][2 * n2]);
                        mma_f16_16x8x16(s[mt][2 * n2 + 1], a[mt], b[2], b[3], s[mt][2 * n2 + 1]);
                    }
                }
            }
            // ---- causal mask: key > query position -> -inf (only near the diagonal)
            if (key0 + C::SUB - 1 > w_min) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int n = 0; n < C::SUB / 8; ++n)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int key = key0 + n * 8 + 2 * t4 + (c & 1);
                            if (key > qpos[mt][c >> 1]) s[mt][n][c] = -INFINITY;
                        }
            }
            // ---- online softmax per row; p rounded to fp16 is what both l and p.v use
            unsigned pf[2][C::SUB / 8][2];
            float alpha[2][2];
            bool moved = false;  // did the running max of any of this lane's rows move?
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int n = 0; n < C::SUB / 8; ++n)
                        mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_old = m_run[mt][hf];
                    const float m_new = fmaxf(m_old, mx);
                    // exactly 1 when the max did not move (a fully masked tile changes nothing)
                    moved |= m_new != m_old;
                    alpha[mt][hf] = m_new == m_old ? 1.0f : exp2f((m_old - m_new) * scale_log2);
                    m_run[mt][hf] = m_new;
                    const float mc = m_new * scale_log2;
                    float rs = 0.0f;
#pragma unroll
                    for (int n = 0; n < C::SUB / 8; ++n) {
                        const float e0 = exp2f(fmaf(s[mt][n][2 * hf], scale_log2, -mc));
                        const float e1 = exp2f(fmaf(s[mt][n][2 * hf + 1], scale_log2, -mc));
                        const __half2 h = __floats2half2_rn(e0, e1);
                        pf[mt][n][hf] = *reinterpret_cast<const unsigned*>(&h);
                        const float2 back = __half22float2(h);
                        rs += back.x;
                        rs += back.y;
                    }
                    l_run[mt][hf] = l_run[mt][hf] * alpha[mt][hf] + rs;
                }
            // rescale the accumulators; skipped (an exact no-op: x * 1 == x) when no row of
            // the warp saw its max move, which is most steps once a row has seen many keys
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int d = 0; d < C::DT; ++d)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[mt][d][c] *= alpha[mt][c >> 1];
            }
            // ---- acc += p . v: the score fragments of keys 16kk.. are the A fragment
#pragma unroll
            for (int kk = 0; kk < C::SUB / 16; ++kk) {
                unsigned a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    a[mt][0] = pf[mt][2 * kk][0];
                    a[mt][1] = pf[mt][2 * kk][1];
                    a[mt][2] = pf[mt][2 * kk + 1][0];
                    a[mt][3] = pf[mt][2 * kk + 1][1];
                }
#pragma unroll
                for (int d2 = 0; d2 < C::DT / 2; ++d2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, sv + kk * 16 * C::ROW_BYTES + (vb_off ^ (d2 * 32)));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_f16_16x8x16(acc[mt][2 * d2], a[mt], b[0], b[1], acc[mt][2 * d2]);
                        mma_f16_16x8x16(acc[mt][2 * d2 + 1], a[mt], b[2], b[3],
                                        acc[mt][2 * d2 + 1]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();

    // ---- out = acc / l, fp16; lane holds rows g, g+8 and columns 2t4, 2t4+1 of each n8 tile
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = l_run[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = warp * 32 + mt * 16 + g + 8 * hf;
            const int p = r / group, h = r - p * group;
            if (r >= rows || p >= np) continue;
            const float inv = 1.0f / l;
            __half* dst = out + (size_t)(p0 + p) * q_row_stride + (size_t)(kvh * group + h) * HD +
                          2 * t4;
#pragma unroll
            for (int d = 0; d < C::DT; ++d)
                *reinterpret_cast<unsigned*>(dst + d * 8) =
                    pack_half2(acc[mt][d][2 * hf] * inv, acc[mt][d][2 * hf + 1] * inv);
        }
}

#define ATTEND_KERNEL(HD)                                                                      \
    extern "C" __global__ void __launch_bounds__(AT_THREADS, 2) attend_hd##HD(                 \
        const __half* __restrict__ q, const __half* __restrict__ k_cache,                      \
        const __half* __restrict__ v_cache, __half* __restrict__ out, int T, int start,        \
        int n_heads, int n_kv, float scale_log2, const int* __restrict__ start_dev) {          \
        const int s0 = start_dev != nullptr ? *start_dev : start;                              \
        attend<HD>(q, k_cache, v_cache, out, T, s0, n_heads, n_kv, scale_log2);                \
    }

ATTEND_KERNEL(64)
ATTEND_KERNEL(128)
