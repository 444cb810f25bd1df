// Exact routing: the top-k experts (and their order, ties to the lower id) that the canonical
// float64 logits pick, at tensor-core speed. Three launches replace routing.cu's GEMM and top-k
// (its scan and scatter sort the result):
//
// 1. router_logits_split_<tile>: approximate logits on tensor cores from split operands
//    (here on mma.sync; routing_split_sm90.cu's wgmma tiles give the same bytes on sm_90).
//    x = xh + 2^-11 xl and w' = w / sigma = wh + 2^-11 wl, each part fp16 (xl and wl are the
//    rounding residuals scaled up by 2^11, so they keep 11 significant bits where fp16 would
//    flush them); three mma products per fragment, xh wh + 2^-11 (xh wl + xl wh), carry about
//    22 of float32's 24 bits. The xh wh products of every 64 columns (CHUNK_K) accumulate in
//    fresh registers and are then added to the running sum with one round-to-nearest float32
//    add, which bounds the tensor cores' own accumulation error by one chunk's worth and makes
//    every tile's sums the same chain. The same pass writes each
//    token's norm |x|_2 (NaN or inf where x holds them), from which the launcher's constants
//    give a rigorous bound B(t) = c1 |x|_2 + c0 on |approx - canonical| for every logit of the
//    token (backends/cuda/routing/exact.py derives c1 and c0). A norm of at most 65504 keeps
//    every value of x inside fp16's range, so the split needs no clamp; a token with a larger
//    norm, a NaN or inf one, or one below 1e-15 is re-ranked whole (step 3).
// 2. topk_exact_w<NPL>: one warp per token ranks the approximate logits. Where every gap between
//    consecutive picks 0..k (the k+1-th included) exceeds 2 B(t), the approximate order is the
//    canonical one, proven by the bound, and the warp writes the token's outputs. Otherwise the
//    token joins a list for
// 3. route_rerank_w<NPL> (routing_rerank.cu): a block per listed token takes the candidates
//    that could still be among the top k (approximate logit within 2 B(t) of the k-th; every
//    expert for a token re-ranked whole), computes the canonical logits of those
//    whose order the bound leaves open (runs of neighbours within 2 B(t)) and ranks them.
//    Weights: float32 softmax of the approximate logits over all experts (of the canonical ones
//    where the token is re-ranked whole), renormalised over the picks.
//
// The canonical logit of token t and expert e, the routing's definition
// (backends/cuda/routing/exact.py's numpy twin computes the same bits): lane l of 32 sums x[c] *
// w[c] for c = l, l + 32, ... in ascending c in float64 (each product of two float32 values is
// exact in float64), then the 32 partial sums meet in an xor tree (offsets 16, 8, 4, 2, 1).
//
// Every output is a fixed function of the inputs and does not depend on the chunk a token sits in.

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/prior_grid.cuh"
#include "common/route_keys.cuh"
#include "common/route_pick.cuh"
#include "common/route_split.cuh"

// logits[t, e] = sigma * (xh wh + 2^-11 (xh wl + xl wh)) over c; xnorm[t] = |x_t|_2 (blocks with
// blockIdx.y == 0 write it). router_split: wh [E, H] fp16, then wl [E, H] fp16. Block tile BM
// tokens x BN experts, WARPS_M x WARPS_N warps, K steps of BK through a STAGES-deep cp.async
// ring; x lands float32 and is split once per K step into the Ah / Al tiles every warp reads.
template <int BM, int BN, int WARPS_M, int WARPS_N, int BK, int STAGES>
__device__ __forceinline__ void router_gemm_split(SPLIT_GEMM_PARAMS) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int AS = BK + 8;  // floats per fp32 A row
    constexpr int BS = BK + 8;  // halves per fp16 row (an odd number of 16-byte units)
    constexpr int V4 = BK / 4;  // float4s per A row and K step: the lanes sharing a row
    constexpr int PER = BM * V4 / THREADS;  // float4s each thread splits per K step
    static_assert(WM * WARPS_M == BM && WN * WARPS_N == BN, "warps must tile the block");
    static_assert(MT >= 1 && WM % 16 == 0 && NT % 2 == 0 && WN % 16 == 0, "warp tile shape");
    static_assert(BK % CHUNK_K == 0 && 32 % V4 == 0 && PER * THREADS == BM * V4, "K step");
    static_assert(STAGES >= 2, "the ring refills one stage while it reads another");
    static_assert(STAGES * (BM * AS * 4 + 2 * BN * BS * 2) + 4 * BM * BS * 2 <= 227 * 1024,
                  "shared memory per block");
    extern __shared__ __align__(16) unsigned char smem[];
    float* As = reinterpret_cast<float*>(smem);
    __half* Bh = reinterpret_cast<__half*>(As + STAGES * BM * AS);
    __half* Bl = Bh + STAGES * BN * BS;
    __half* Ah = Bl + STAGES * BN * BS;  // two buffers of [hi tile, lo tile], BM x BS each

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int g = lane >> 2, q = lane & 3;
    const int steps = hidden / BK;
    const size_t lo_off = (size_t)n_experts * hidden;
    if (n_rerank != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2)
        n_rerank[threadIdx.x] = 0;  // the top-k launch after this one lists from zero

    // A: float4 i = threadIdx.x + p * THREADS of every K step is loaded and split by the same
    // thread, so a thread's own cp.async wait covers what it splits (no barrier needed there)
    auto load = [&](int stage, int step) {
        const int k0 = step * BK;
        float* a = As + stage * BM * AS;
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int i = threadIdx.x + p * THREADS;
            const int r = i / V4, c = (i % V4) * 4;
            const int t = m0 + r;
            const float* src = t < tokens ? xn + (size_t)t * hidden + k0 + c : xn;
            cp_async16(a + r * AS + c, src, t < tokens ? 16 : 0);
        }
        __half* bh = Bh + stage * BN * BS;
        __half* bl = Bl + stage * BN * BS;
        for (int i = threadIdx.x; i < BN * (BK / 8); i += THREADS) {
            const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
            const int e = n0 + r;
            const size_t at = e < n_experts ? (size_t)e * hidden + k0 + c : 0;
            cp_async16(bh + r * BS + c, router_split + at, e < n_experts ? 16 : 0);
            cp_async16(bl + r * BS + c, router_split + lo_off + at, e < n_experts ? 16 : 0);
        }
    };

    float sq[PER];
#pragma unroll
    for (int p = 0; p < PER; ++p) sq[p] = 0.0f;
    // float4 p of this thread's share of a K step (p < PER), split into the Ah / Al buffer
    auto split_one = [&](int stage, int buf, int p) {
        const float* a32 = As + stage * BM * AS;
        __half* hi = Ah + buf * 2 * BM * BS;
        __half* lo = hi + BM * BS;
        {
            const int i = threadIdx.x + p * THREADS;
            const int r = i / V4, c = (i % V4) * 4;
            const float4 v = *reinterpret_cast<const float4*>(a32 + r * AS + c);
            uint2 h, l;
            split_float4(v, h, l, sq[p]);
            *reinterpret_cast<uint2*>(hi + r * BS + c) = h;
            *reinterpret_cast<uint2*>(lo + r * BS + c) = l;
        }
    };
    auto split = [&](int stage, int buf) {
#pragma unroll
        for (int p = 0; p < PER; ++p) split_one(stage, buf, p);
    };
    // With three or more stages, step+1's x has landed once step+2's load is issued, so its
    // split is spread over the 16-column mma steps of `step` (part p after mma step p * KK /
    // PER): the warps' ALU work then issues between their mma instead of after all of them.
    constexpr int KK = BK / 16;
    constexpr bool INTERLEAVE = STAGES >= 3;

    float acc[MT][NT][4], part[MT][NT][4], cross[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = cross[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    cp_async_wait<STAGES - 2>();
    split(0, 0);
    for (int step = 0; step < steps; ++step) {
        // every warp is done with step-1's mma (its B stage and split buffer) and with the
        // split of `step`; B of `step` landed for all (each thread waited for its own part)
        __syncthreads();
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next);
        cp_async_commit();
        const bool split_next = step + 1 < steps;
        if (INTERLEAVE && split_next) cp_async_wait<STAGES - 2>();

        const __half* ah = Ah + (step & 1) * 2 * BM * BS + (wm * WM) * BS;
        const __half* al = ah + BM * BS;
        const __half* bh = Bh + (step % STAGES) * BN * BS + (wn * WN) * BS;
        const __half* bl = Bl + (step % STAGES) * BN * BS + (wn * WN) * BS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            if (kk % CHUNK_K == 0) {
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int v = 0; v < 4; ++v) part[i][j][v] = 0.0f;
            }
            unsigned afh[MT][4], afl[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int off = (i * 16 + (lane & 15)) * BS + kk + (lane >> 4) * 8;
                ldmatrix_x4(afh[i], ah + off);
                ldmatrix_x4(afl[i], al + off);
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                const int mat = lane >> 3;
                const int off = ((j + (mat >> 1)) * 8 + (lane & 7)) * BS + kk + (mat & 1) * 8;
                unsigned bfh[4], bfl[4];
                ldmatrix_x4(bfh, bh + off);
                ldmatrix_x4(bfl, bl + off);
                // each accumulator's order is fixed (cross: xh wl, then xl wh); the loops put
                // MT * 2 independent mma between the two that feed one cross accumulator
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma_f16_16x8x16(part[i][j], afh[i], bfh[0], bfh[1], part[i][j]);
                    mma_f16_16x8x16(part[i][j + 1], afh[i], bfh[2], bfh[3], part[i][j + 1]);
                    mma_f16_16x8x16(cross[i][j], afh[i], bfl[0], bfl[1], cross[i][j]);
                    mma_f16_16x8x16(cross[i][j + 1], afh[i], bfl[2], bfl[3], cross[i][j + 1]);
                }
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma_f16_16x8x16(cross[i][j], afl[i], bfh[0], bfh[1], cross[i][j]);
                    mma_f16_16x8x16(cross[i][j + 1], afl[i], bfh[2], bfh[3], cross[i][j + 1]);
                }
            }
            if ((kk + 16) % CHUNK_K == 0) {
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int v = 0; v < 4; ++v)
                            acc[i][j][v] = __fadd_rn(acc[i][j][v], part[i][j][v]);
            }
            if constexpr (INTERLEAVE) {
#pragma unroll
                for (int p = 0; p < PER; ++p)
                    if ((p * KK) / PER == kk / 16 && split_next)
                        split_one((step + 1) % STAGES, (step + 1) & 1, p);
            }
        }

        // split step+1 into the other buffer while other warps still multiply
        if (!INTERLEAVE && split_next) {
            cp_async_wait<STAGES - 2>();
            split((step + 1) % STAGES, (step + 1) & 1);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int e = n0 + wn * WN + j * 8 + 2 * q;
            const int t = m0 + wm * WM + i * 16 + g;
            if (e >= n_experts) continue;
            float out[4];
#pragma unroll
            for (int v = 0; v < 4; ++v)
                out[v] = split_logit(acc[i][j][v], cross[i][j][v], sigma);
            if (t < tokens)
                *reinterpret_cast<float2*>(logits + (size_t)t * n_experts + e) =
                    make_float2(out[0], out[1]);
            if (t + 8 < tokens)
                *reinterpret_cast<float2*>(logits + (size_t)(t + 8) * n_experts + e) =
                    make_float2(out[2], out[3]);
        }
    }

    // token norms: the V4 lanes that split one row reduce their partial sums in a fixed xor tree
    if (blockIdx.y != 0) return;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        float s = sq[p];
#pragma unroll
        for (int o = V4 / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
        const int i = threadIdx.x + p * THREADS;
        const int t = m0 + i / V4;
        if (i % V4 == 0 && t < tokens) xnorm[t] = __fsqrt_rn(s);
    }
}

// Tiles (backends/cuda/routing/exact.py: SPLIT_TILES, SPLIT_TILE_RULE); every tile gives the same
// bytes, since each logit is the same chain of mma steps and K-step sums whatever block computes
// it. Dynamic shared memory: STAGES * (BM * (BK + 8) * 4 + 2 * BN * (BK + 8) * 2) + 4 * BM * (BK +
// 8) * 2.
#define SPLIT_KERNEL(NAME, BM, BN, WM_, WN_, BK, STAGES, MINB)                                \
    extern "C" __global__ void __launch_bounds__(WM_ * WN_ * 32, MINB)                        \
        router_logits_split_##NAME(SPLIT_GEMM_PARAMS) {                                       \
        wait_prior_grid();                                                                    \
        router_gemm_split<BM, BN, WM_, WN_, BK, STAGES>(SPLIT_GEMM_ARGS);                     \
    }
SPLIT_KERNEL(m64, 64, 128, 2, 4, 64, 3, 1)
SPLIT_KERNEL(m64w16, 64, 128, 4, 4, 64, 3, 1)
SPLIT_KERNEL(m32w8, 32, 128, 2, 4, 64, 3, 1)
SPLIT_KERNEL(m64n64, 64, 64, 2, 2, 64, 3, 1)
SPLIT_KERNEL(m32, 32, 128, 1, 4, 64, 3, 1)
SPLIT_KERNEL(m16, 16, 64, 1, 4, 64, 3, 2)
SPLIT_KERNEL(m16k128, 16, 64, 1, 4, 128, 2, 2)

// ---------------------------------------------------------------------------- exact top-k
// One warp per token, 32 tokens (one sort tile) per block of 1024 threads. Ranks the approximate
// logits (picks 0..k; ties to the lower id). Certain (every gap between consecutive picks
// j, j+1 for j < k exceeds 2 B(t), B(t) = c1 * xnorm[t] + c0): writes ids, weights (float32
// softmax of the approximate logits) and the tile mask bits as routing.cu's top-k does.
// Otherwise the token goes to `rerank` (count at n_rerank[0]: zeroed by the split GEMM and
// again by route_rerank when it is done, with n_rerank[1] its count of finished blocks;
// n_rerank[2] counts listed tokens across launches and is never reset here) and route_rerank
// writes its outputs.
template <int NPL>
__device__ __forceinline__ void topk_exact_warp(
    const float* __restrict__ logits, const float* __restrict__ xnorm, int tokens,
    int n_experts, int top_k, double c1, double c0, int* __restrict__ ids,
    float* __restrict__ weights, unsigned* __restrict__ masks, int n_tiles,
    int* __restrict__ n_rerank, Rerank* __restrict__ rerank) {
    __shared__ unsigned tile_mask[32 * NPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) tile_mask[e] = 0u;
    __syncthreads();

    const int t = blockIdx.x * ROUTE_TILE + warp;
    if (t < tokens) {
        const float* l = logits + (size_t)t * n_experts;
        float v[NPL];
        unsigned key[NPL];
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < n_experts ? l[e] : 0.0f;
            // an approximate logit never maps to key 0 (that is the NaN pattern 0xffffffff)
            key[i] = e < n_experts ? max(float_key(v[i]), 1u) : 0u;
        }
        const int picks = min(top_k + 1, n_experts);
        int my_id = 0;
        unsigned my_key = 0u;
        warp_pick<NPL, unsigned>(key, picks, lane, my_id, my_key);

        const float norm = xnorm[t];
        const double bound = c1 * (double)norm + c0;
        const unsigned next_key = __shfl_down_sync(0xffffffffu, my_key, 1);
        const bool close = lane + 1 < picks &&
                           !((double)key_float(my_key) - (double)key_float(next_key) > 2.0 * bound);
        const bool unsure = !(norm >= 1e-15f && norm <= F16_LIMIT);
        if (__any_sync(0xffffffffu, close) || unsure) {
            const float kth = key_float(__shfl_sync(0xffffffffu, my_key, top_k - 1));
            if (lane == 0) {
                const int slot = atomicAdd(n_rerank, 1);  // < tokens: each token is listed once
                const float gap = unsure ? 0.0f : __double2float_ru(2.0 * bound);
                if (slot < tokens) rerank[slot] = Rerank{t, unsure ? 1 : 0, kth, gap};
                atomicAdd(n_rerank + 2, 1);  // a running total for tests and benchmarks

            }
        } else {
            const float m = key_float(__shfl_sync(0xffffffffu, my_key, 0));
            // the pick's key is its value (-0 as +0): no lane holds a NaN on this path
            const float w = pick_weight_of<NPL>(v, n_experts, top_k, m, key_float(my_key), lane);
            if (lane < top_k) {
                ids[(size_t)t * top_k + lane] = my_id;
                weights[(size_t)t * top_k + lane] = w;
                atomicOr(&tile_mask[my_id], 1u << (t & (ROUTE_TILE - 1)));
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x)
        masks[(size_t)e * n_tiles + blockIdx.x] = tile_mask[e];
}

#define TOPK_EXACT_KERNEL(NPL)                                                                 \
    extern "C" __global__ void __launch_bounds__(1024) topk_exact_w##NPL(                      \
        const float* __restrict__ logits, const float* __restrict__ xnorm, int tokens,         \
        int n_experts, int top_k, double c1, double c0, int* __restrict__ ids,                 \
        float* __restrict__ weights, unsigned* __restrict__ masks, int n_tiles,                \
        int* __restrict__ n_rerank, Rerank* __restrict__ rerank) {                             \
        wait_prior_grid();                                                                     \
        topk_exact_warp<NPL>(logits, xnorm, tokens, n_experts, top_k, c1, c0, ids, weights,    \
                             masks, n_tiles, n_rerank, rerank);                                \
    }
TOPK_EXACT_KERNEL(1)
TOPK_EXACT_KERNEL(2)
TOPK_EXACT_KERNEL(4)
TOPK_EXACT_KERNEL(8)
TOPK_EXACT_KERNEL(16)

