// The engine's own kernels: everything of an MoE layer that is not a format's gather or MMQ.
//
// Every kernel here is deterministic: a fixed reduction order per output, no float atomics,
// and integer atomics only where the result does not depend on their order (histograms). That
// is what lets two runs of one prompt, and the two gather modes, agree byte for byte.
//
// Row conventions (formats/contract.py): the k routed (token, expert) pairs of a chunk are sorted
// by expert into "rows"; expert e owns rows bounds[e] .. bounds[e+1]-1, tokens ascending inside.
// sorted_token[row] names the token of a row, row_of[t*k + j] the row of the pair (t, j).

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/prior_grid.cuh"
#include "common/q8_1.cuh"
#include "common/row_norm.cuh"
#include "common/swiglu.cuh"

#define ROUTER_BM 64
#define ROUTER_BN 64
#define ROUTER_BK 16

// xn[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w.  One block per token.
// A row whose sum of squares is not finite (it holds NaN or Inf, or its squares overflow, which
// would normalise it to zeros) lowers *bad to (layer << 32 | row): the host reads the earliest
// such layer and row after the chunk (one word, reset to all ones before it) and refuses the
// result. The check costs one compare per row.
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ xn, int hidden, float eps,
                                        unsigned long long* __restrict__ bad, int layer) {
    __shared__ float scratch[32];
    const float* row = x + (size_t)blockIdx.x * hidden;
    const float r = row_rms_scale(row, hidden, eps, scratch, bad, layer, blockIdx.x, true);
    float* out = xn + (size_t)blockIdx.x * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) out[c] = row[c] * r * w[c];
}

// logits[t, e] = sum_c xn[t, c] * router[e, c], float32, each output accumulated in ascending c
// by one thread (tiles of 64 tokens x 64 experts, 4x4 outputs per thread, 256 threads).
// hidden must be a multiple of ROUTER_BK.
extern "C" __global__ void __launch_bounds__(256)
router_logits(const float* __restrict__ xn, const float* __restrict__ router,
              float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    __shared__ float as[ROUTER_BK][ROUTER_BM + 4];
    __shared__ float bs[ROUTER_BK][ROUTER_BN + 4];
    const int t0 = blockIdx.x * ROUTER_BM, e0 = blockIdx.y * ROUTER_BN;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    // loader: thread loads 4 consecutive k of one row of each tile
    const int lr = threadIdx.x >> 2, lk = (threadIdx.x & 3) * 4;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < hidden; k0 += ROUTER_BK) {
        const int t = t0 + lr, e = e0 + lr;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (t < tokens) a = *reinterpret_cast<const float4*>(xn + (size_t)t * hidden + k0 + lk);
        if (e < n_experts)
            b = *reinterpret_cast<const float4*>(router + (size_t)e * hidden + k0 + lk);
        as[lk + 0][lr] = a.x; as[lk + 1][lr] = a.y; as[lk + 2][lr] = a.z; as[lk + 3][lr] = a.w;
        bs[lk + 0][lr] = b.x; bs[lk + 1][lr] = b.y; bs[lk + 2][lr] = b.z; bs[lk + 3][lr] = b.w;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < ROUTER_BK; ++kk) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = as[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + ty * 4 + i;
        if (t >= tokens) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int e = e0 + tx * 4 + j;
            if (e < n_experts) logits[(size_t)t * n_experts + e] = acc[i][j];
        }
    }
}

// Softmax over the experts, top-k by probability (ties -> lower expert id), weights
// renormalised over the k chosen. One thread per token; pass j picks the largest p strictly
// after pick j-1 in the order (p descending, id ascending), so no mask is needed.
extern "C" __global__ void topk_softmax(const float* __restrict__ logits, int tokens,
                                        int n_experts, int top_k, int* __restrict__ ids,
                                        float* __restrict__ weights) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (size_t)t * n_experts;
    float m = l[0];
    for (int e = 1; e < n_experts; ++e) m = fmaxf(m, l[e]);
    float s = 0.0f;
    for (int e = 0; e < n_experts; ++e) s = __fadd_rn(s, expf(l[e] - m));
    float prev_p = INFINITY, sum_top = 0.0f;
    int prev_id = -1;
    for (int j = 0; j < top_k; ++j) {
        float best_p = -1.0f;
        int best = -1;
        for (int e = 0; e < n_experts; ++e) {
            const float p = __fdiv_rn(expf(l[e] - m), s);
            const bool after = p < prev_p || (p == prev_p && e > prev_id);
            if (after && p > best_p) { best_p = p; best = e; }
        }
        ids[t * top_k + j] = best;
        weights[t * top_k + j] = best_p;
        sum_top = __fadd_rn(sum_top, best_p);
        prev_p = best_p;
        prev_id = best;
    }
    for (int j = 0; j < top_k; ++j)
        weights[t * top_k + j] = __fdiv_rn(weights[t * top_k + j], sum_top);
}

// Histogram of the routed ids and its exclusive scan: bounds[0..n_experts]. One block; shared
// integer atomics are order-independent. Dynamic shared memory: n_experts ints.
extern "C" __global__ void expert_bounds(const int* __restrict__ ids, int pairs, int n_experts,
                                         int* __restrict__ bounds) {
    extern __shared__ int counts[];
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&counts[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int e = 0; e < n_experts; ++e) {
            bounds[e] = run;
            run += counts[e];
        }
        bounds[n_experts] = run;
    }
}

#define SCATTER_THREADS 1024
#define SCATTER_ITEMS 4

// Stable scatter: block e walks the (token, k) pairs in order and hands expert e's pairs
// consecutive rows from bounds[e], so tokens ascend within an expert. Writes sorted_token[row]
// and row_of[pair].
extern "C" __global__ void __launch_bounds__(SCATTER_THREADS)
expert_scatter(const int* __restrict__ ids, int pairs, int top_k, const int* __restrict__ bounds,
               int* __restrict__ sorted_token, int* __restrict__ row_of) {
    __shared__ int warp_tot[2][32];
    const int e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int base_row = bounds[e];
    const int end_row = bounds[e + 1];
    if (base_row == end_row) return;
    int buf = 0;
    for (int i0 = 0; i0 < pairs; i0 += SCATTER_THREADS * SCATTER_ITEMS, buf ^= 1) {
        const int first = i0 + threadIdx.x * SCATTER_ITEMS;
        bool hit[SCATTER_ITEMS];
        int mine = 0;
#pragma unroll
        for (int u = 0; u < SCATTER_ITEMS; ++u) {
            hit[u] = first + u < pairs && ids[first + u] == e;
            mine += hit[u];
        }
        // inclusive scan of `mine` inside the warp, then across warps
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) warp_tot[buf][warp] = incl;
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < (SCATTER_THREADS >> 5); ++w) {
            const int c = warp_tot[buf][w];
            before += w < warp ? c : 0;
            total += c;
        }
        int row = base_row + before + incl - mine;
#pragma unroll
        for (int u = 0; u < SCATTER_ITEMS; ++u) {
            if (hit[u]) {
                sorted_token[row] = (first + u) / top_k;
                row_of[first + u] = row;
                ++row;
            }
        }
        base_row += total;
        if (base_row == end_row) return;  // uniform across the block
    }
}

// SwiGLU over the rows of experts lo..hi-1 (rows bounds[lo] .. bounds[hi]-1): v = silu(gate)*up
// from gu = float32 [rows, 2*ffn] (gate then up), written as q8_1 (144 bytes per 128 values).
// One warp per 128 values; blocks stride over the rows, so a fixed grid covers any row count.
extern "C" __global__ void swiglu_q8_1(const float* __restrict__ gu, const int* __restrict__ bounds,
                                       int lo, int hi, int ffn, char* __restrict__ out) {
    const int r0 = bounds[lo], r1 = bounds[hi];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int blocks = ffn / Q8_1_VALUES;
    for (int r = r0 + blockIdx.x; r < r1; r += gridDim.x) {
        const float4* g = reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ffn);
        const float4* u = reinterpret_cast<const float4*>(gu + (size_t)r * 2 * ffn + ffn);
        for (int kb = warp; kb < blocks; kb += nwarps) {
            const float4 a = g[kb * 32 + lane], b = u[kb * 32 + lane];
            const float4 v = make_float4(swiglu(a.x, b.x), swiglu(a.y, b.y), swiglu(a.z, b.z),
                                         swiglu(a.w, b.w));
            q8_1_quantize_warp128(v, lane, out + ((size_t)r * blocks + kb) * Q8_1_BYTES);
        }
    }
}

// The same SwiGLU written as float16 [rows, ffn] (round to nearest even).
extern "C" __global__ void swiglu_f16(const float* __restrict__ gu, const int* __restrict__ bounds,
                                      int lo, int hi, int ffn, __half* __restrict__ out) {
    const int r0 = bounds[lo], r1 = bounds[hi];
    for (int r = r0 + blockIdx.x; r < r1; r += gridDim.x) {
        const float* g = gu + (size_t)r * 2 * ffn;
        for (int c = threadIdx.x; c < ffn; c += blockDim.x) {
            out[(size_t)r * ffn + c] = __float2half_rn(swiglu(g[c], g[ffn + c]));
        }
    }
}

// x[t] += sum_j w[t,j] * y[row_of[t,j]], the sum taken in top-k order with separate rounding
// of every product and sum (no FMA contraction), then one rounded residual add. Grid (tokens,
// column blocks): a short chunk spreads each row's columns over gridDim.y blocks (every column
// is summed alike, so the bytes do not depend on the grid).
extern "C" __global__ void combine_residual(const float* __restrict__ y, const int* __restrict__ row_of,
                                           const float* __restrict__ weights, int top_k,
                                           int hidden, float* __restrict__ x) {
    wait_prior_grid();
    const int t = blockIdx.x;
    const int* rows = row_of + (size_t)t * top_k;
    const float* w = weights + (size_t)t * top_k;
    float* xt = x + (size_t)t * hidden;
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < hidden; c += gridDim.y * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < top_k; ++j)
            acc = __fadd_rn(acc, __fmul_rn(w[j], y[(size_t)rows[j] * hidden + c]));
        xt[c] = __fadd_rn(xt[c], acc);
    }
}
