// Causal prefill attention on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), head
// dim 128: attention.cu's attend_hd128 contract (arguments, grid, block rows, chunk invariance,
// fp16 probabilities summed as rounded), at the rate of the tensor cores rather than of the
// shared-memory loads that feed mma.sync.
//
// Why: attend_hd128 reads every K and V fragment through ldmatrix into registers, for every
// 16 x 8 product; on sm_90 that traffic, not the tensor cores, sets its rate. wgmma reads Q, K
// and V from shared memory through descriptors, asynchronously, a 64 x 128 product at a time.
//
// Block: 256 threads, two warpgroups; block rows as attend's: row r is query position r / group
// and head r % group of one KV head (P = 128 / group positions, every head of the group), so a
// K/V tile is read once for the whole group. Warpgroup w owns rows 64 w .. 64 w + 63. K/V tiles
// of KT = 128 cache rows sit at absolute positions j * KT and stream through a two-stage
// cp.async ring that all 256 threads fill. Per tile and warpgroup:
//   1. s (64 x 128, float32) = q k^T: eight m64n128k16 steps, Q and K both K-major from shared
//      memory in wgmma's 128-byte swizzle, head dim in two panels of 64;
//   2. the causal mask (only on tiles that cross a row's position), the online softmax in
//      registers: per row a float32 running max m and sum l; probabilities exp2((s - m) *
//      scale_log2) rounded to fp16, and those rounded values summed into l;
//   3. o (64 x 128, float32) += p v: eight m64n128k16 steps whose A operand is p in registers
//      (the accumulator fragment of step 1 is the A fragment here) and whose B is the V tile
//      read MN-major (head dim contiguous) from the same swizzled layout as K.
// A tile past all of a warpgroup's rows is an exact no-op for them (as attend's per-row no-op):
// the two-stage schedule skips it, the pipelined one runs it (no wgmma in a divergent path).
//
// Determinism and chunk invariance, as attend's: a row's result is a fixed function of its q,
// its position and cache rows 0..position. Its tiles are the same absolute tiles whatever
// chunk it came in; a tile past its position contributes exactly nothing (scores -inf, the
// max does not move, alpha exactly 1, probabilities exactly 0); each score is one chain of
// k16 steps in ascending head-dim order; there are no atomics and no split of the cache length.
// The bytes are this kernel's own, not attend_hd128's: the tensor cores' order of the adds
// inside a step differs between the two instruction families.
//
// Dynamic shared memory: Q (32 KiB) + STAGES x (K + V) (64 KiB each) + 1024 bytes for the
// swizzle atoms' 1024-byte alignment. Compiled for sm_90a only (the launcher asks for it);
// other targets compile an empty file.
//
// Two build switches give p.v's other readings of the MN-major V descriptor, for
// bench/probe_attention_sm90.py to settle on an sm_90 device which one is right:
// ATTN_V_DESC_SWAP exchanges its two byte offsets, ATTN_PV_N64 issues one 64-wide instruction
// per head-dim panel (whose leading offset is then unused). The source as written uses neither.
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "common/wgmma.cuh"

namespace {

constexpr int HD = 128;                   // head dim
constexpr int ROWS = 128;                 // block rows (positions x heads of the group)
constexpr int KT = 128;                   // cache rows per K/V tile
constexpr int THREADS = 256;              // two warpgroups
constexpr int PANEL_ROWS_BYTES = 128;     // one row of a 64-wide panel
constexpr int Q_PANEL = ROWS * PANEL_ROWS_BYTES;   // 16 KiB: one 64-wide slice of Q
constexpr int KV_PANEL = KT * PANEL_ROWS_BYTES;    // 16 KiB: one 64-wide slice of a K/V tile
constexpr int Q_BYTES = 2 * Q_PANEL;
constexpr int KV_BYTES = 2 * KV_PANEL;             // one K (or V) tile
constexpr int STAGE_BYTES = 2 * KV_BYTES;          // K then V
constexpr int CHUNKS = HD / 8;                     // 16-byte chunks per row
constexpr int ROWS_PER_PASS = THREADS / CHUNKS;    // rows one pass of the copy covers
static_assert(ROWS % ROWS_PER_PASS == 0 && KT % ROWS_PER_PASS == 0, "whole passes");
static_assert(ROWS_PER_PASS % 8 == 0, "a pass keeps a thread's swizzle phase");

__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// s = q . k over one K tile: eight k16 steps, panel kk / 4, 32 bytes a step inside the panel
// (issued and committed as one wgmma group; the caller waits)
__device__ __forceinline__ void issue_scores(float (&s)[64], uint64_t dq, const unsigned char* sk) {
    const uint64_t dk = wg::sw128_desc(sk);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int at = (kk >> 2) * Q_PANEL + (kk & 3) * 32;
        wg::mma_64x128x16(s, wg::desc_at(dq, at), wg::desc_at(dk, at), kk > 0);
    }
    wg::commit();
}

#if defined(ATTN_V_DESC_SWAP)
#define V_DESC(p) \
    ((wg::sw128_desc_mn(p, 1024) & ~(0x3FFFull << 32)) | ((uint64_t)(KV_PANEL >> 4) << 32))
#else
#define V_DESC(p) wg::sw128_desc_mn(p, KV_PANEL)
#endif

// o += p . v over one V tile: keys 16 kk .. are the A fragment {row g, row g+8} x {8-key
// halves}; V's k16 step starts 16 rows (2048 bytes) further down both panels (one group)
__device__ __forceinline__ void issue_pv(float (&o)[64], const unsigned (&pf)[2][KT / 8],
                                         const unsigned char* sv) {
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
        const unsigned a[4] = {pf[0][2 * kk], pf[1][2 * kk], pf[0][2 * kk + 1],
                               pf[1][2 * kk + 1]};
#if defined(ATTN_PV_N64)
        float(&o0)[32] = *reinterpret_cast<float(*)[32]>(&o[0]);
        float(&o1)[32] = *reinterpret_cast<float(*)[32]>(&o[32]);
        wg::mma_64x64x16_rs_mn(o0, a, V_DESC(sv + kk * 16 * PANEL_ROWS_BYTES), 1);
        wg::mma_64x64x16_rs_mn(o1, a, V_DESC(sv + KV_PANEL + kk * 16 * PANEL_ROWS_BYTES), 1);
#else
        wg::mma_64x128x16_rs_mn(o, a, V_DESC(sv + kk * 16 * PANEL_ROWS_BYTES), 1);
#endif
    }
    wg::commit();
}

// The causal mask and the online softmax of one tile's scores: s[4 j + v] is row g + 8 (v / 2),
// key key0 + 8 j + 2 t4 + v % 2. Updates m and l of the thread's two rows, writes p (fp16, the
// values l sums) and alpha (exactly 1 where the max did not move); returns whether any row of
// the warp saw its max move (o needs rescaling).
__device__ __forceinline__ bool softmax_tile(float (&s)[64], int key0, int t4, const int (&qpos)[2],
                                             int w_min, float scale_log2, float (&m_run)[2],
                                             float (&l_run)[2], unsigned (&pf)[2][KT / 8],
                                             float (&alpha)[2]) {
    if (key0 + KT - 1 > w_min) {  // near the diagonal only
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int key = key0 + 8 * j + 2 * t4 + (v & 1);
                if (key > qpos[v >> 1]) s[4 * j + v] = -INFINITY;
            }
    }
    bool moved = false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
            mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_old = m_run[hf];
        const float m_new = fmaxf(m_old, mx);
        moved |= m_new != m_old;
        alpha[hf] = m_new == m_old ? 1.0f : exp2f((m_old - m_new) * scale_log2);
        m_run[hf] = m_new;
        const float mc = m_new * scale_log2;
        float rs = 0.0f;
#pragma unroll
        for (int j = 0; j < KT / 8; ++j) {
            const float e0 = exp2f(fmaf(s[4 * j + 2 * hf], scale_log2, -mc));
            const float e1 = exp2f(fmaf(s[4 * j + 2 * hf + 1], scale_log2, -mc));
            const __half2 h = __floats2half2_rn(e0, e1);
            pf[hf][j] = *reinterpret_cast<const unsigned*>(&h);
            const float2 back = __half22float2(h);
            rs += back.x;
            rs += back.y;
        }
        l_run[hf] = l_run[hf] * alpha[hf] + rs;
    }
    return __any_sync(0xffffffffu, moved);
}

__device__ __forceinline__ void rescale(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// STAGES 2: each tile's q.k, softmax and p.v in turn. STAGES 3 (pipelined): tile j's q.k is
// issued together with tile j-1's p.v, and tile j's softmax runs while that p.v multiplies;
// the same operations on o in the same order (o += p_{j-1} v_{j-1}, then o *= alpha_j), so
// the same bytes.
template <int STAGES>
__device__ __forceinline__ void attend_sm90(const __half* __restrict__ q,
                                            const __half* __restrict__ k_cache,
                                            const __half* __restrict__ v_cache,
                                            __half* __restrict__ out, int T, int start,
                                            int n_heads, int n_kv, float scale_log2) {
    constexpr int SMEM_USED = Q_BYTES + STAGES * STAGE_BYTES + 1024;
    static_assert(SMEM_USED <= 227 * 1024, "shared memory");
    require_dynamic_smem(SMEM_USED);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* sq = wg::align1024(smem_raw);
    unsigned char* skv = sq + Q_BYTES;

    const int tid = threadIdx.x;
    const int group = n_heads / n_kv;
    const int P = ROWS / group;        // query positions per block
    const int rows = P * group;        // block rows in use
    const int kvh = blockIdx.y;
    const int p0 = (gridDim.x - 1 - blockIdx.x) * P;  // the longest blocks first
    const int np = min(P, T - p0);
    const int kv_len = start + T;
    const int last = start + p0 + np - 1;
    const int n_tiles = last / KT + 1;
    const size_t q_row_stride = (size_t)n_heads * HD;
    const size_t kv_row_stride = (size_t)n_kv * HD;

    // ---- copies: thread tid moves chunk c of rows row0 + i * ROWS_PER_PASS; chunk c sits in
    // panel c / 8 at swizzled chunk (c % 8) ^ (row % 8), the same phase for every pass
    const int c = tid % CHUNKS, row0 = tid / CHUNKS;
    static_assert(Q_PANEL == KV_PANEL, "one copy offset for Q and the K/V tiles");
    const int s_off = (c >> 3) * Q_PANEL + wg::sw128(row0, c & 7);
#pragma unroll
    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
        const int r = row0 + i * ROWS_PER_PASS;
        const int p = r / group, h = r - p * group;
        const bool ok = r < rows && p < np;
        const __half* src = q + (size_t)(p0 + p) * q_row_stride + (size_t)(kvh * group + h) * HD +
                            c * 8;
        cp_async16(sq + s_off + i * ROWS_PER_PASS * PANEL_ROWS_BYTES, ok ? (const void*)src : q,
                   ok ? 16 : 0);
    }
    const __half* k_src = k_cache + (size_t)kvh * HD + c * 8;
    const __half* v_src = v_cache + (size_t)kvh * HD + c * 8;
    auto stage_of = [&](int tile) { return skv + (tile % STAGES) * STAGE_BYTES; };
    auto load_tile = [&](int tile) {
        unsigned char* dk = stage_of(tile) + s_off;
#pragma unroll
        for (int i = 0; i < KT / ROWS_PER_PASS; ++i) {
            const int key = tile * KT + row0 + i * ROWS_PER_PASS;
            const bool ok = key < kv_len;
            const size_t off = (size_t)key * kv_row_stride;
            cp_async16(dk + i * ROWS_PER_PASS * PANEL_ROWS_BYTES,
                       ok ? (const void*)(k_src + off) : (const void*)k_cache, ok ? 16 : 0);
            cp_async16(dk + KV_BYTES + i * ROWS_PER_PASS * PANEL_ROWS_BYTES,
                       ok ? (const void*)(v_src + off) : (const void*)v_cache, ok ? 16 : 0);
        }
    };

    // ---- this thread's two rows (accumulator rows lane / 4 and lane / 4 + 8 of its warp)
    const int w = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    int qpos[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = 64 * w + 16 * warp + g + 8 * hf;
        const int p = r / group;
        qpos[hf] = (r < rows && p < np) ? start + p0 + p : start + p0;
    }
    // positions of the warpgroup's rows in use (w_max < 0: none); the warpgroup takes tiles
    // 0 .. w_max / KT, a uniform test
    int w_min = 0x7fffffff, w_max = -1;
    {
        const int r_lo = 64 * w, r_hi = min(64 * w + 63, rows - 1);
        if (r_lo < rows && r_lo / group < np) {
            w_min = start + p0 + r_lo / group;
            w_max = start + p0 + min(r_hi / group, np - 1);
        }
    }
    const uint64_t dq = wg::sw128_desc(sq + 64 * w * PANEL_ROWS_BYTES);

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    unsigned pf[2][KT / 8];
    float alpha[2];

    if constexpr (STAGES == 2) {
        load_tile(0);
        cp_async_commit();  // group: Q and tile 0
        for (int tile = 0; tile < n_tiles; ++tile) {
            if (tile + 1 < n_tiles) load_tile(tile + 1);
            cp_async_commit();  // possibly empty: keeps the group count uniform
            wg::cp_wait_mem<1>();
            wg::fence_async_smem();
            __syncthreads();
            if (tile * KT <= w_max) {
                const unsigned char* sk = stage_of(tile);
                float s[64];
                issue_scores(s, dq, sk);
                wg::wait<0>();
                wg::pin(s);
                if (softmax_tile(s, tile * KT, t4, qpos, w_min, scale_log2, m_run, l_run, pf,
                                 alpha))
                    rescale(o, alpha);
                issue_pv(o, pf, sk + KV_BYTES);
                wg::wait<0>();
                wg::pin(o);
            }
            __syncthreads();  // both warpgroups are done with this stage before it is refilled
        }
    } else {
        // tile j+1 is copied while tile j's q.k and tile j-1's p.v run: three stages in use
        // both warpgroups take every tile of the block: a warpgroup's tiles past its rows are
        // exact no-ops (as above), and a branch on the warpgroup would put the wgmma in a
        // divergent path, where ptxas serializes them and the overlap is lost
        load_tile(0);
        cp_async_commit();  // group: Q and tile 0
        for (int tile = 0; tile <= n_tiles; ++tile) {
            // tile `tile` landed (the one group in flight) and every warpgroup is past tile
            // - 2's p.v, whose stage the next copy refills
            wg::cp_wait_mem<0>();
            wg::fence_async_smem();
            __syncthreads();
            if (tile + 1 < n_tiles) {
                load_tile(tile + 1);
                cp_async_commit();
            }
            const bool scores = tile < n_tiles, pv = tile >= 1;
            float s[64];
            if (scores) issue_scores(s, dq, stage_of(tile));
            if (pv) issue_pv(o, pf, stage_of(tile - 1) + KV_BYTES);
            if (scores) {
                if (pv)
                    wg::wait<1>();  // q.k done, p.v may still multiply
                else
                    wg::wait<0>();
                wg::pin(s);
                unsigned pn[2][KT / 8];
                const bool moved = softmax_tile(s, tile * KT, t4, qpos, w_min, scale_log2, m_run,
                                                l_run, pn, alpha);
                if (pv) {
                    wg::wait<0>();
                    wg::pin(o);
                }
                if (moved) rescale(o, alpha);
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                    for (int j = 0; j < KT / 8; ++j) pf[hf][j] = pn[hf][j];
            } else if (pv) {
                wg::wait<0>();
                wg::pin(o);
            }
        }
    }
    wg::cp_wait_mem<0>();

    // ---- out = o / l, fp16: o[4 j + v] is row g + 8 (v / 2), head-dim column 8 j + 2 t4 + v % 2
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        float l = l_run[hf];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = 64 * w + 16 * warp + g + 8 * hf;
        const int p = r / group, h = r - p * group;
        if (r >= rows || p >= np) continue;
        const float inv = 1.0f / l;
        __half* dst = out + (size_t)(p0 + p) * q_row_stride + (size_t)(kvh * group + h) * HD +
                      2 * t4;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j)
            *reinterpret_cast<unsigned*>(dst + 8 * j) =
                pack_h2(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
    }
}

}  // namespace

#define ATTEND_SM90_KERNEL(NAME, STAGES)                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                             \
        const __half* __restrict__ q, const __half* __restrict__ k_cache,                      \
        const __half* __restrict__ v_cache, __half* __restrict__ out, int T, int start,        \
        int n_heads, int n_kv, float scale_log2, const int* __restrict__ start_dev) {          \
        const int s0 = start_dev != nullptr ? *start_dev : start;                              \
        attend_sm90<STAGES>(q, k_cache, v_cache, out, T, s0, n_heads, n_kv, scale_log2);       \
    }

ATTEND_SM90_KERNEL(attend_sm90_hd128, 2)
ATTEND_SM90_KERNEL(attend_sm90p_hd128, 3)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
