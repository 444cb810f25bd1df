// MoE routing in four launches with no host sync: router logits on tensor cores, softmax top-k
// with one warp per token, and a counting sort by expert (per-tile scan, then scatter).
//
// Determinism. Every output is a fixed function of the inputs: each logit is one warp's chain
// of m16n8k16 mma steps in ascending k (the tile shape the launcher picks changes which warp
// owns an output, never the chain), the softmax sums run in a fixed lane order and xor tree,
// and the sort is integer arithmetic on bit masks built with atomicOr (order-independent).
// So a token's logits, ids, weights and row order do not depend on the chunk it sits in.
//
// Row conventions are the engine's: expert e owns rows bounds[e] .. bounds[e+1]-1, tokens
// ascending inside; sorted_token[row] is a row's token, row_of[t*k + j] the row of pair (t, j).
//
// Sort tiles: tokens are grouped in tiles of 32 (ROUTE_TILE). The top-k kernel also writes,
// per expert and tile, a 32-bit mask of the tile's tokens that chose the expert
// (masks[e * n_tiles + tile]). The scan turns the masks into per-expert prefix counts over
// tiles; the scatter gives pair (t, j) of expert e the row
//   bounds[e] + tile_off[e, tile] + popcount(mask[e, tile] & bits below t's lane).

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/prior_grid.cuh"
#include "common/route_keys.cuh"
#include "common/route_pick.cuh"
#define F16_LIMIT 65504.0f

// ---------------------------------------------------------------------------- router logits
// float32 -> fp16 (round to nearest even) with magnitudes beyond the fp16 range clamped to
// +-65504 (NaN stays NaN), so an outlier cannot turn a logit into inf.
__device__ __forceinline__ unsigned f16x2_clamped(float2 v) {
    const float lo = fabsf(v.x) > F16_LIMIT ? copysignf(F16_LIMIT, v.x) : v.x;
    const float hi = fabsf(v.y) > F16_LIMIT ? copysignf(F16_LIMIT, v.y) : v.y;
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// logits[t, e] = sum_c f16(xn[t, c]) * router16[e, c], float32 accumulation on tensor cores.
// Block tile BM tokens x BN experts, warps WARPS_M x WARPS_N, K steps of BK through a
// STAGES-deep cp.async ring. xn lands float32 in shared memory; each K step the block converts
// it once into an fp16 tile (Ah) that every warp reads with ldmatrix. Converting while each warp
// built its own A fragments repeated the conversion in all WARPS_N warps and left the kernel
// issue bound. hidden % BK == 0 and n_experts even (the launcher checks).
template <int BM, int BN, int WARPS_M, int WARPS_N, int BK, int STAGES>
__device__ __forceinline__ void router_gemm(const float* __restrict__ xn,
                                            const __half* __restrict__ router,
                                            float* __restrict__ logits, int tokens, int hidden,
                                            int n_experts) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MT = WM / 16, NT = WN / 8;
    constexpr int AS = BK + 8;  // floats per fp32 A row (16-byte aligned rows for cp.async)
    constexpr int BS = BK + 8;  // halves per B row and per Ah row: an odd number of 16-byte
                                // units (80, 144 or 272 bytes), so ldmatrix's 8 rows hit
                                // distinct banks
    static_assert(WM * WARPS_M == BM && WN * WARPS_N == BN, "warps must tile the block");
    static_assert(MT >= 1 && WM % 16 == 0 && NT % 2 == 0 && WN % 16 == 0, "warp tile shape");
    static_assert(BK % 16 == 0, "K step");
    static_assert(STAGES >= 2, "the ring refills one stage while it reads another");
    static_assert(STAGES * (BM * AS * 4 + BN * BS * 2) + BM * BS * 2 <= 227 * 1024,
                  "shared memory per block");
    extern __shared__ __align__(16) unsigned char smem[];
    float* As = reinterpret_cast<float*>(smem);
    __half* Bs = reinterpret_cast<__half*>(As + STAGES * BM * AS);
    __half* Ah = Bs + STAGES * BN * BS;  // this K step's A, fp16

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int g = lane >> 2, q = lane & 3;
    const int steps = hidden / BK;

    auto load = [&](int stage, int step) {
        const int k0 = step * BK;
        float* a = As + stage * BM * AS;
        for (int i = threadIdx.x; i < BM * (BK / 4); i += THREADS) {
            const int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            const int t = m0 + r;
            const float* src = t < tokens ? xn + (size_t)t * hidden + k0 + c : xn;
            cp_async16(a + r * AS + c, src, t < tokens ? 16 : 0);
        }
        __half* b = Bs + stage * BN * BS;
        for (int i = threadIdx.x; i < BN * (BK / 8); i += THREADS) {
            const int r = i / (BK / 8), c = (i % (BK / 8)) * 8;
            const int e = n0 + r;
            const __half* src = e < n_experts ? router + (size_t)e * hidden + k0 + c : router;
            cp_async16(b + r * BS + c, src, e < n_experts ? 16 : 0);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage `step` landed for all; stage step-1 is free to refill
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next);
        cp_async_commit();

        // the previous step's ldmatrix reads of Ah finished before the barrier above
        const float* a32 = As + (step % STAGES) * BM * AS;
        for (int i = threadIdx.x; i < BM * (BK / 4); i += THREADS) {
            const int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            const float4 v = *reinterpret_cast<const float4*>(a32 + r * AS + c);
            *reinterpret_cast<uint2*>(Ah + r * BS + c) =
                make_uint2(f16x2_clamped(make_float2(v.x, v.y)),
                           f16x2_clamped(make_float2(v.z, v.w)));
        }
        __syncthreads();  // Ah complete for every warp

        const __half* a = Ah + (wm * WM) * BS;
        const __half* b = Bs + (step % STAGES) * BN * BS + (wn * WN) * BS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            // matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
            // (rows 8-15, k 8-15): the m16n8k16 A fragment's four registers in order
            unsigned af[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                ldmatrix_x4(af[i], a + (i * 16 + (lane & 15)) * BS + kk + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                // matrices: (tile j, k 0-7), (tile j, k 8-15), (tile j+1, k 0-7), (tile j+1, k 8-15)
                const int mat = lane >> 3;
                const __half* row = b + ((j + (mat >> 1)) * 8 + (lane & 7)) * BS + kk + (mat & 1) * 8;
                unsigned bf[4];
                ldmatrix_x4(bf, row);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    mma_f16_16x8x16(acc[i][j], af[i], bf[0], bf[1], acc[i][j]);
                    mma_f16_16x8x16(acc[i][j + 1], af[i], bf[2], bf[3], acc[i][j + 1]);
                }
            }
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
            if (t < tokens)
                *reinterpret_cast<float2*>(logits + (size_t)t * n_experts + e) =
                    make_float2(acc[i][j][0], acc[i][j][1]);
            if (t + 8 < tokens)
                *reinterpret_cast<float2*>(logits + (size_t)(t + 8) * n_experts + e) =
                    make_float2(acc[i][j][2], acc[i][j][3]);
        }
    }
}

// Tile shapes, all with the same per-output chain (so the same bytes); the launcher picks one by
// chunk length (backends/cuda/routing/kernels.py: GEMM_TILES, GEMM_TILE_RULE). Each block walks
// hidden in serial K steps, and a step costs about one memory latency however little it moves, so
// the tiles trade the number of steps a block takes against how many blocks fill the chip.
// Dynamic shared memory: STAGES * (BM * (BK + 8) * 4 + BN * (BK + 8) * 2) + BM * (BK + 8) * 2
// bytes. The second __launch_bounds__ argument, where given, is the blocks per SM the tile is
// sized for on sm_90: their shared memory fits the SM's 228 KB (1 KB of it reserved per block),
// and it caps the registers so that they fit too.

// 64 tokens x 128 experts, 8 warps: the long-chunk tile.
extern "C" __global__ void __launch_bounds__(256)
router_logits_f16_m64(const float* __restrict__ xn, const __half* __restrict__ router,
                      float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    router_gemm<64, 128, 2, 4, 32, 4>(xn, router, logits, tokens, hidden, n_experts);
}

// 16 x 64: the short-chunk tile (more blocks, fewer idle SMs).
extern "C" __global__ void __launch_bounds__(128)
router_logits_f16_m16(const float* __restrict__ xn, const __half* __restrict__ router,
                      float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    router_gemm<16, 64, 1, 4, 64, 3>(xn, router, logits, tokens, hidden, n_experts);
}

// m16 with K steps of 128: half the serial steps of m16 for short chunks, where each block
// walks all of hidden alone. Only where hidden % 128 == 0.
extern "C" __global__ void __launch_bounds__(128, 2)
router_logits_f16_m16k128(const float* __restrict__ xn, const __half* __restrict__ router,
                          float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    router_gemm<16, 64, 1, 4, 128, 4>(xn, router, logits, tokens, hidden, n_experts);
}

// 64 x 128 with K steps of 64 and of 128: the long-chunk tile's block count (one wave of
// blocks at 8K tokens on 132 SMs) with a half or a quarter of its serial K steps, each moving
// more of xn per wait. Only where hidden is a multiple of the K step.
extern "C" __global__ void __launch_bounds__(256)
router_logits_f16_m64k64(const float* __restrict__ xn, const __half* __restrict__ router,
                         float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    router_gemm<64, 128, 2, 4, 64, 4>(xn, router, logits, tokens, hidden, n_experts);
}

extern "C" __global__ void __launch_bounds__(256)
router_logits_f16_m64k128(const float* __restrict__ xn, const __half* __restrict__ router,
                          float* __restrict__ logits, int tokens, int hidden, int n_experts) {
    router_gemm<64, 128, 2, 4, 128, 3>(xn, router, logits, tokens, hidden, n_experts);
}

// ---------------------------------------------------------------------------- top-k softmax
// One warp per token, 32 tokens (one sort tile) per block of 1024 threads. Lane L holds the
// logits of experts L, L+32, ... (NPL of them). Pick j is the largest logit not yet picked,
// ties to the lower expert id (two warp reductions: max key, then min id among the holders);
// softmax is monotone, so this is top-k by probability with ties to the lower id, decided on
// the exact logits rather than on rounded probabilities. Then, in float32:
//   m = largest logit, s = sum_e expf(l_e - m) (each lane in ascending e, then an xor tree),
//   p_j = expf(l_j - m) / s, w_j = p_j / (p_0 + ... + p_{k-1}) (summed in pick order).
// Lane j < k writes ids[t*k + j] and weights[t*k + j], and sets bit t%32 of the expert's tile
// mask. n_experts <= 32*NPL, top_k <= min(32, n_experts).
template <int NPL>
__device__ __forceinline__ void topk_softmax_warp(const float* __restrict__ logits, int tokens,
                                                  int n_experts, int top_k, int* __restrict__ ids,
                                                  float* __restrict__ weights,
                                                  unsigned* __restrict__ masks, int n_tiles) {
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
            // a logit never maps to key 0 (the NaN pattern), which marks an absent entry
            key[i] = e < n_experts ? max(float_key(v[i]), 1u) : 0u;
        }
        int my_id = 0;
        unsigned my_key = 0u;
        warp_pick<NPL, unsigned>(key, top_k, lane, my_id, my_key);
        const float m = key_float(__shfl_sync(0xffffffffu, my_key, 0));
        const float w = pick_weight<NPL>(v, n_experts, top_k, m, my_id, lane);
        if (lane < top_k) {
            ids[(size_t)t * top_k + lane] = my_id;
            weights[(size_t)t * top_k + lane] = w;
            atomicOr(&tile_mask[my_id], 1u << (t & (ROUTE_TILE - 1)));
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x)
        masks[(size_t)e * n_tiles + blockIdx.x] = tile_mask[e];
}

#define TOPK_KERNEL(NPL)                                                                    \
    extern "C" __global__ void __launch_bounds__(1024) topk_softmax_w##NPL(                 \
        const float* __restrict__ logits, int tokens, int n_experts, int top_k,             \
        int* __restrict__ ids, float* __restrict__ weights, unsigned* __restrict__ masks,   \
        int n_tiles) {                                                                      \
        topk_softmax_warp<NPL>(logits, tokens, n_experts, top_k, ids, weights, masks,       \
                               n_tiles);                                                    \
    }
TOPK_KERNEL(1)
TOPK_KERNEL(2)
TOPK_KERNEL(4)
TOPK_KERNEL(8)
TOPK_KERNEL(16)

// ---------------------------------------------------------------------------- counting sort
#define SCAN_THREADS 256

// Exclusive scan over the block (SCAN_THREADS threads), fixed shuffle pattern; returns the
// exclusive prefix of v and sets *total. Integer: any order gives the same result.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total) {
    __shared__ int warp_sum[SCAN_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) warp_sum[warp] = incl;
    __syncthreads();
    int before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < SCAN_THREADS / 32; ++w) {
        before += w < warp ? warp_sum[w] : 0;
        all += warp_sum[w];
    }
    __syncthreads();  // warp_sum is reused by the next call
    *total = all;
    return before + incl - v;
}

// Block e: tile_off[e * n_tiles + tile] = tokens of expert e in tiles before `tile`, and
// totals[e] = all of them. Grid: n_experts blocks of SCAN_THREADS.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
route_tile_scan(const unsigned* __restrict__ masks, int n_tiles, int* __restrict__ tile_off,
                int* __restrict__ totals) {
    wait_prior_grid();
    const unsigned* m = masks + (size_t)blockIdx.x * n_tiles;
    int* off = tile_off + (size_t)blockIdx.x * n_tiles;
    int carry = 0;
    for (int base = 0; base < n_tiles; base += SCAN_THREADS) {
        const int tile = base + threadIdx.x;
        const int c = tile < n_tiles ? __popc(m[tile]) : 0;
        int round_total;
        const int before = block_exclusive_scan(c, &round_total);
        if (tile < n_tiles) off[tile] = carry + before;
        carry += round_total;
    }
    if (threadIdx.x == 0) totals[blockIdx.x] = carry;
}

// Block = one tile of 32 tokens, one thread per (token, k) pair (32 * top_k threads). Each block
// turns totals into bounds in shared memory (warp 0; block 0 also writes bounds[0..E]), then
// places its pairs. n_experts <= 512.
extern "C" __global__ void __launch_bounds__(512)
route_scatter(const int* __restrict__ ids, int tokens, int top_k, int n_experts,
              const unsigned* __restrict__ masks, const int* __restrict__ tile_off,
              const int* __restrict__ totals, int n_tiles, int* __restrict__ bounds,
              int* __restrict__ sorted_token, int* __restrict__ row_of) {
    wait_prior_grid();
    __shared__ int start[512 + 1];
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per = (n_experts + 31) / 32;
        const int e0 = min(lane * per, n_experts), e1 = min(e0 + per, n_experts);
        int mine = 0;
        for (int e = e0; e < e1; ++e) mine += totals[e];
        int incl = mine;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += u;
        }
        int run = incl - mine;
        for (int e = e0; e < e1; ++e) {
            start[e] = run;
            run += totals[e];
        }
        if (lane == 31) start[n_experts] = incl;
    }
    __syncthreads();
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e <= n_experts; e += blockDim.x) bounds[e] = start[e];
    const int tile = blockIdx.x;
    const long long pair = (long long)tile * ROUTE_TILE * top_k + threadIdx.x;
    if (pair >= (long long)tokens * top_k) return;
    const int e = ids[pair];
    const int t = (int)(pair / top_k);
    const size_t at = (size_t)e * n_tiles + tile;
    const unsigned below = (1u << (t & (ROUTE_TILE - 1))) - 1u;
    const int row = start[e] + tile_off[at] + __popc(masks[at] & below);
    sorted_token[row] = t;
    row_of[pair] = row;
}
