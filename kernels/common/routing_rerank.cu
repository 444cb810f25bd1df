// The exact routing's re-ranking (see routing_exact.cu for the definition and the bound): the
// tokens the top-k warp could not settle get canonical logits for the experts whose place the
// bound leaves open, and their picks from those.

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/prior_grid.cuh"
#include "common/route_keys.cuh"
#include "common/route_pick.cuh"
#include "common/row_norm.cuh"

// ---------------------------------------------------------------------------- re-ranking
#define RERANK_WARPS 4
#define RERANK_UNROLL 32

// The canonical logit of x and w (see routing_exact.cu), by one warp: lane l's sequential
// float64 sum over c = l, l + 32, ..., then the xor tree. The unrolled loads keep RERANK_UNROLL
// elements of both rows in flight; the sum still adds them in ascending c. X_SHARED: x is in
// shared memory (read plainly; __ldg reads global memory only).
template <bool X_SHARED = false>
__device__ __forceinline__ double canonical_logit(const float* __restrict__ x,
                                                  const float* __restrict__ w, int hidden,
                                                  int lane) {
    double acc = 0.0;
    int c = lane;
    for (; c + 32 * (RERANK_UNROLL - 1) < hidden; c += 32 * RERANK_UNROLL) {
        float xv[RERANK_UNROLL], wv[RERANK_UNROLL];
#pragma unroll
        for (int u = 0; u < RERANK_UNROLL; ++u) {
            if constexpr (X_SHARED)
                xv[u] = x[c + 32 * u];
            else
                xv[u] = __ldg(x + c + 32 * u);
            wv[u] = __ldg(w + c + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < RERANK_UNROLL; ++u) acc = __fma_rn((double)xv[u], (double)wv[u], acc);
    }
    for (; c < hidden; c += 32) {
        const float xc = X_SHARED ? x[c] : __ldg(x + c);
        acc = __fma_rn((double)xc, (double)__ldg(w + c), acc);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc = __dadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    return acc;
}

// Block b re-ranks the listed tokens b, b + gridDim.x, ...
// Candidates: the experts whose approximate logit is >= kth - gap (every expert for a token
// with `all` set); no other expert can reach the top k. A candidate with no other candidate
// within gap = 2 B(t) is isolated: every expert is more than 2 B(t) above or below it, so its
// canonical logit keeps its approximate place among all of them. Only the others (typically a
// near-tied pair, not the whole top k; every expert for `all`) get canonical logits. The key
// of a candidate is then its approximate logit if isolated, else its canonical logit: two
// experts more than 2 B(t) apart compare the same whichever key each has, and experts closer
// than that both have canonical keys, so the top k by key (ties to the lower id) is the top k
// by canonical logit. Each warp finds the candidates itself (no barrier before the products),
// the n-th expert that needs a canonical logit goes to warp n % RERANK_WARPS, and after one
// barrier warp 0 picks and writes ids, weights (float32 softmax of the approximate logits, or
// of the canonical ones for `all`) and the tile mask bits. n_experts <= 32 * NPL.
// FROM_X: `xn` is the residual x, and the block first normalises the token's row into shared
// memory (dynamic, hidden floats) as x * rscale[t] * norm_w: rmsnorm_rows' bytes, for the
// presplit tiles, whose RMSNorm keeps no float32 xn.
template <int NPL, bool FROM_X = false>
__device__ __forceinline__ void rerank_block(
    const float* __restrict__ logits, const float* __restrict__ xn,
    const float* __restrict__ rscale, const float* __restrict__ norm_w,
    const float* __restrict__ router32, int tokens, int hidden, int n_experts, int top_k,
    int* __restrict__ n_rerank, const Rerank* __restrict__ rerank,
    int* __restrict__ ids, float* __restrict__ weights, unsigned* __restrict__ masks,
    int n_tiles) {
    __shared__ double canon_s[32 * NPL];
    __shared__ int pick_s[32 * NPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = min(*n_rerank, tokens);
    for (int j = blockIdx.x; j < n; j += gridDim.x) {
        const Rerank r = rerank[j];
        const int t = r.token;
        // the token's row of x, which the canonical sums read once the candidates are known:
        // asked into L2 now, beside the load of its logits
        for (int c = 32 * threadIdx.x; c < hidden; c += 32 * blockDim.x)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(xn + (size_t)t * hidden + c));
        const double gap = (double)r.gap, thresh = (double)r.kth - gap;
        float v[NPL];
        bool cand[NPL], iso[NPL];
#pragma unroll
        for (int i = 0; i < NPL; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < n_experts ? logits[(size_t)t * n_experts + e] : 0.0f;
            cand[i] = e < n_experts && (r.all || (double)v[i] >= thresh);
            iso[i] = cand[i] && !r.all;
        }
        if (!r.all) {
#pragma unroll
            for (int i2 = 0; i2 < NPL; ++i2) {
                unsigned m = __ballot_sync(0xffffffffu, cand[i2]);
                while (m) {
                    const int l2 = __ffs(m) - 1;
                    m &= m - 1;
                    const double v2 = (double)__shfl_sync(0xffffffffu, v[i2], l2);
#pragma unroll
                    for (int i = 0; i < NPL; ++i)
                        if (cand[i] && !(i == i2 && lane == l2) && fabs((double)v[i] - v2) <= gap)
                            iso[i] = false;
                }
            }
        }
        const float* x = xn + (size_t)t * hidden;
        if constexpr (FROM_X) {
            extern __shared__ float x_row[];
            const float r = rscale[t];
            for (int c = threadIdx.x; c < hidden; c += blockDim.x)
                x_row[c] = x[c] * r * norm_w[c];
            __syncthreads();
            x = x_row;
        }
        int q = 0;
#pragma unroll
        for (int i2 = 0; i2 < NPL; ++i2) {
            unsigned m = __ballot_sync(0xffffffffu, cand[i2] && !iso[i2]);
            while (m) {
                const int e = __ffs(m) - 1 + 32 * i2;
                m &= m - 1;
                if (q++ % RERANK_WARPS == warp) {
                    const double L = canonical_logit<FROM_X>(x, router32 + (size_t)e * hidden,
                                                             hidden, lane);
                    if (lane == 0) canon_s[e] = L;
                }
            }
        }
        __syncthreads();
        if (warp == 0) {
            unsigned long long key[NPL];
#pragma unroll
            for (int i = 0; i < NPL; ++i) {
                const int e = lane + 32 * i;
                const double c = cand[i] && !iso[i] ? canon_s[e] : 0.0;
                key[i] = cand[i] ? max(double_key(iso[i] ? (double)v[i] : c), 1ull) : 0ull;
                if (r.all && cand[i]) v[i] = __double2float_rn(c);
            }
            // each candidate's place among the candidates: how many have a larger key, or the
            // same key and a lower id (the order warp_pick gives); places below top_k are the
            // picks, and pick_s[j] holds the expert of place j
            int place[NPL];
#pragma unroll
            for (int i = 0; i < NPL; ++i) place[i] = 0;
#pragma unroll
            for (int i2 = 0; i2 < NPL; ++i2) {
                unsigned m = __ballot_sync(0xffffffffu, key[i2] != 0ull);
                while (m) {
                    const int l2 = __ffs(m) - 1;
                    m &= m - 1;
                    const unsigned long long k2 = __shfl_sync(0xffffffffu, key[i2], l2);
#pragma unroll
                    for (int i = 0; i < NPL; ++i)
                        place[i] += k2 > key[i] ||
                                    (k2 == key[i] && (i2 < i || (i2 == i && l2 < lane)));
                }
            }
#pragma unroll
            for (int i = 0; i < NPL; ++i)
                if (key[i] != 0ull && place[i] < top_k) pick_s[place[i]] = lane + 32 * i;
            __syncwarp();
            const int my_id = lane < top_k ? pick_s[lane] : 0;
            float mx = -__int_as_float(0x7f800000);
#pragma unroll
            for (int i = 0; i < NPL; ++i)
                if (lane + 32 * i < n_experts) mx = fmaxf(mx, v[i]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float w = pick_weight<NPL>(v, n_experts, top_k, mx, my_id, lane);
            if (lane < top_k) {
                ids[(size_t)t * top_k + lane] = my_id;
                weights[(size_t)t * top_k + lane] = w;
                atomicOr(&masks[(size_t)my_id * n_tiles + t / ROUTE_TILE],
                         1u << (t & (ROUTE_TILE - 1)));
            }
        }
        __syncthreads();  // canon_s is free for the block's next token
    }
    // the last block with a token to finish zeroes the count and itself, so the next top-k
    // launch lists from zero whoever launches it. Each of those min(n, gridDim.x) blocks read
    // the count before its last barrier; a block without a token takes no part (it read the
    // count too, or reads zero after the reset: either way it has nothing to do)
    if (threadIdx.x == 0 && (int)blockIdx.x < n) {
        if (atomicAdd(n_rerank + 1, 1) == min(n, (int)gridDim.x) - 1) {
            n_rerank[0] = 0;
            n_rerank[1] = 0;
        }
    }
}

// route_rerank_w<NPL> reads float32 xn; route_rerank_x_w<NPL> normalises each listed token's
// residual row itself (the presplit tiles' chain; dynamic shared memory: hidden floats).
#define RERANK_KERNEL(NPL)                                                                     \
    extern "C" __global__ void __launch_bounds__(RERANK_WARPS * 32) route_rerank_w##NPL(       \
        const float* __restrict__ logits, const float* __restrict__ xn,                        \
        const float* __restrict__ router32, int tokens, int hidden, int n_experts, int top_k,  \
        int* __restrict__ n_rerank, const Rerank* __restrict__ rerank,                         \
        int* __restrict__ ids, float* __restrict__ weights, unsigned* __restrict__ masks,      \
        int n_tiles) {                                                                         \
        wait_prior_grid();                                                                     \
        rerank_block<NPL>(logits, xn, nullptr, nullptr, router32, tokens, hidden, n_experts,   \
                          top_k, n_rerank, rerank, ids, weights, masks, n_tiles);              \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(RERANK_WARPS * 32) route_rerank_x_w##NPL(     \
        const float* __restrict__ logits, const float* __restrict__ x,                         \
        const float* __restrict__ rscale, const float* __restrict__ norm_w,                    \
        const float* __restrict__ router32, int tokens, int hidden, int n_experts, int top_k,  \
        int* __restrict__ n_rerank, const Rerank* __restrict__ rerank,                         \
        int* __restrict__ ids, float* __restrict__ weights, unsigned* __restrict__ masks,      \
        int n_tiles) {                                                                         \
        wait_prior_grid();                                                                     \
        rerank_block<NPL, true>(logits, x, rscale, norm_w, router32, tokens, hidden,           \
                                n_experts, top_k, n_rerank, rerank, ids, weights, masks,       \
                                n_tiles);                                                      \
    }
RERANK_KERNEL(1)
RERANK_KERNEL(2)
RERANK_KERNEL(4)
RERANK_KERNEL(8)
RERANK_KERNEL(16)

// ---------------------------------------------------------------------------- one token
// A chunk of one token (a decode step) needs no split GEMM, bound, list or sort. Two launches:
// route_one_logits writes the canonical logit (canonical_logit above) of every expert, one warp
// per expert, as float64 into `canon` [n_experts]; route_one_pick (one warp) ranks them (ties to
// the lower id) and writes ids, weights (float32 softmax of the canonical logits rounded to
// float32: what route_rerank writes for a token with `all` set, byte for byte) and the sort's
// outputs for one token: bounds [n_experts + 1], sorted_token and row_of [top_k]. Nothing is
// kept between launches, so no counter needs a reset.
#define ONE_WARPS 4

extern "C" __global__ void __launch_bounds__(ONE_WARPS * 32) route_one_logits(
    const float* __restrict__ xn, const float* __restrict__ router32, int hidden,
    int n_experts, double* __restrict__ canon) {
    wait_prior_grid();
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * ONE_WARPS + (threadIdx.x >> 5);
    if (e >= n_experts) return;
    const double L = canonical_logit(xn, router32 + (size_t)e * hidden, hidden, lane);
    if (lane == 0) canon[e] = L;
}

// route_one_norm_logits: route_one_logits with the layer's RMSNorm in front, for a decode
// step whose experts take fp16 activations: every block normalises the token's residual row x
// into shared memory (row_norm.cuh: the bytes rmsnorm_rows writes) and its ONE_NORM_WARPS warps
// take one expert each; block 0 also writes xn, the fp16 activations of the token's act_rows
// sorted rows (all the same token: what convert_f16_rows writes from xn) and the norm's
// finiteness flag. Two launches of a decode step's routing fewer (the norm, the activations).
// Dynamic shared memory: hidden floats.
#define ONE_NORM_WARPS 8

extern "C" __global__ void __launch_bounds__(ONE_NORM_WARPS * 32) route_one_norm_logits(
    const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
    const float* __restrict__ router32, int hidden, int n_experts, double* __restrict__ canon,
    float* __restrict__ xn, __half* __restrict__ act, int act_rows,
    unsigned long long* __restrict__ bad, int layer) {
    wait_prior_grid();
    extern __shared__ float xs[];
    __shared__ float scratch[32];
    const bool first = blockIdx.x == 0;
    const float r = row_rms_scale(x, hidden, eps, scratch, bad, layer, 0u, first);
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        const float v = x[c] * r * norm_w[c];
        xs[c] = v;
        if (first) {
            xn[c] = v;
            const __half h = __float2half_rn(v);
            for (int k = 0; k < act_rows; ++k) act[(size_t)k * hidden + c] = h;
        }
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * ONE_NORM_WARPS + (threadIdx.x >> 5);
    if (e >= n_experts) return;
    const double L = canonical_logit<true>(xs, router32 + (size_t)e * hidden, hidden, lane);
    if (lane == 0) canon[e] = L;
}

template <int NPL>
__device__ __forceinline__ void route_one_pick_warp(
    const double* __restrict__ canon, int n_experts, int top_k, int* __restrict__ ids,
    float* __restrict__ weights, int* __restrict__ bounds, int* __restrict__ sorted_token,
    int* __restrict__ row_of) {
    const int lane = threadIdx.x & 31;
    unsigned long long key[NPL];
    float v[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
        const int e = lane + 32 * i;
        const double c = e < n_experts ? canon[e] : 0.0;
        key[i] = e < n_experts ? max(double_key(c), 1ull) : 0ull;
        v[i] = e < n_experts ? __double2float_rn(c) : 0.0f;
    }
    int my_id = 0;
    unsigned long long my_key = 0ull;
    warp_pick<NPL, unsigned long long>(key, top_k, lane, my_id, my_key);
    float mx = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < NPL; ++i)
        if (lane + 32 * i < n_experts) mx = fmaxf(mx, v[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float w = pick_weight<NPL>(v, n_experts, top_k, mx, my_id, lane);
    // the sort of one token: an expert's rows start after the picks with a lower id
    int below = 0;
    for (int j = 0; j < top_k; ++j) below += __shfl_sync(0xffffffffu, my_id, j) < my_id;
    if (lane < top_k) {
        ids[lane] = my_id;
        weights[lane] = w;
        sorted_token[lane] = 0;
        row_of[lane] = below;
    }
    for (int e = lane; e <= n_experts; e += 32) {
        int start = 0;
        for (int j = 0; j < top_k; ++j) start += __shfl_sync(0xffffffffu, my_id, j) < e;
        bounds[e] = start;
    }
}

#define ROUTE_ONE_PICK_KERNEL(NPL)                                                             \
    extern "C" __global__ void __launch_bounds__(32) route_one_pick_w##NPL(                    \
        const double* __restrict__ canon, int n_experts, int top_k, int* __restrict__ ids,     \
        float* __restrict__ weights, int* __restrict__ bounds, int* __restrict__ sorted_token, \
        int* __restrict__ row_of) {                                                            \
        wait_prior_grid();                                                                     \
        route_one_pick_warp<NPL>(canon, n_experts, top_k, ids, weights, bounds, sorted_token,  \
                                 row_of);                                                      \
    }
ROUTE_ONE_PICK_KERNEL(1)
ROUTE_ONE_PICK_KERNEL(2)
ROUTE_ONE_PICK_KERNEL(4)
ROUTE_ONE_PICK_KERNEL(8)
ROUTE_ONE_PICK_KERNEL(16)
