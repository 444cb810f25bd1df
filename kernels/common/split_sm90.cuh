// The pieces every schedule of routing_split_sm90.cu shares: the block shape, the copy roles
// and sources of a K step, the split's stores into wgmma's swizzled tiles, the twelve products
// of a K step, and the stores of logits and token norms. Included by that file only, inside its
// sm_90a guard (wgmma.cuh), so each schedule's kernel is the same chain of the same pieces.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/route_split.cuh"
#include "common/wgmma.cuh"

namespace {

// The shape every schedule shares: 64 tokens x 128 experts, two multiplying warpgroups, K steps
// of 64.
constexpr int BM = 64, BN = 128, BK = 64;
constexpr int V4 = BK / 4;  // float4s per x row and K step
constexpr int CH = BK / 8;  // 16-byte fp16 chunks per router row
constexpr int X_TILE = BM * BK * 4, B_TILE = BN * BK * 2, A_TILE = BM * BK * 2;  // bytes
static_assert(BK == CHUNK_K, "one K step is one chunk of fresh hi-hi sums");
static_assert(X_TILE % 1024 == 0 && B_TILE % 1024 == 0 && A_TILE % 1024 == 0,
              "swizzle atoms stay 1024-byte aligned");

// The copy and split roles of thread `tid` of the NT threads that share them: float4 xf of x
// rows x_row(p), router chunk bc of rows b_row(p). The V4 lanes of one x row sit in one warp
// (their square sums meet in an xor tree), in the order routing_exact.cu's tiles add them.
template <int NT>
struct Roles {
    static constexpr int PER = BM * V4 / NT;   // x float4s per thread and K step
    static constexpr int BPER = BN * CH / NT;  // router chunks per thread and part
    static_assert(PER * NT == BM * V4 && BPER * NT == BN * CH && NT % 32 == 0, "K step");
    int xf, xr0, bc, br0;
    __device__ explicit Roles(int tid) : xf(tid % V4), xr0(tid / V4), bc(tid % CH), br0(tid / CH) {}
    __device__ int x_row(int p) const { return xr0 + p * (NT / V4); }
    __device__ int b_row(int p) const { return br0 + p * (NT / CH); }
};

// Where this thread's copies of every K step come from and go to, worked out once: x float4s
// (rows past the chunk's last read nothing: zero bytes from a valid address) and router chunks
// (rows past the last expert likewise); step k's sources are k * BK values further on.
template <int NT>
struct Copies {
    using R = Roles<NT>;
    const float* x[R::PER];
    const __half* b[R::BPER];
    int x_bytes[R::PER], b_bytes[R::BPER], x_at[R::PER], b_at[R::BPER];
    size_t lo_off;
    __device__ Copies(const R& ro, int m0, int n0, const float* __restrict__ xn,
                      const __half* __restrict__ router_split, int tokens, int hidden,
                      int n_experts)
        : lo_off((size_t)n_experts * hidden) {
#pragma unroll
        for (int p = 0; p < R::PER; ++p) {
            const int r = ro.x_row(p), t = m0 + r;
            x[p] = xn + (size_t)(t < tokens ? t : 0) * hidden + 4 * ro.xf;
            x_bytes[p] = t < tokens ? 16 : 0;
            x_at[p] = (r * BK + 4 * ro.xf) * 4;
        }
#pragma unroll
        for (int p = 0; p < R::BPER; ++p) {
            const int r = ro.b_row(p), e = n0 + r;
            b[p] = router_split + (size_t)(e < n_experts ? e : 0) * hidden + 8 * ro.bc;
            b_bytes[p] = e < n_experts ? 16 : 0;
            b_at[p] = wg::sw128(r, ro.bc);
        }
    }
    // x of K step `step` into the float32 tile xs ([BM][BK], unswizzled)
    __device__ void load_x(unsigned char* xs, int step) const {
#pragma unroll
        for (int p = 0; p < R::PER; ++p) cp_async16(xs + x_at[p], x[p] + step * BK, x_bytes[p]);
    }
    // the router chunks of K step `step` into the swizzled tiles bh / bl
    __device__ void load_router(unsigned char* bh, unsigned char* bl, int step) const {
#pragma unroll
        for (int p = 0; p < R::BPER; ++p) {
            cp_async16(bh + b_at[p], b[p] + step * BK, b_bytes[p]);
            cp_async16(bl + b_at[p], b[p] + lo_off + step * BK, b_bytes[p]);
        }
    }
};

// float4 v (float4 xf of row r), split into the swizzled hi / lo tiles (four halves: 8 bytes
// each, at half xf % 2 of chunk xf / 2); the square sum of the row's norm
__device__ __forceinline__ void split_store(int xf, float4 v, int r, unsigned char* hi,
                                            unsigned char* lo, float& sq) {
    uint2 h, l;
    split_float4(v, h, l, sq);
    const int off = wg::sw128(r, xf >> 1) + (xf & 1) * 8;
    *reinterpret_cast<uint2*>(hi + off) = h;
    *reinterpret_cast<uint2*>(lo + off) = l;
}

// one 16-column product of an N-column warpgroup tile (N = 64 or 128)
template <int N>
__device__ __forceinline__ void mma_step(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
    if constexpr (N == 128)
        wg::mma_64x128x16(d, da, db, acc);
    else
        wg::mma_64x64x16(d, da, db, acc);
}

// issues one K step's twelve products of warpgroup w, whose experts are rows N w .. N w + N - 1
// of the router tiles: per 16 columns part (+)= xh wh, cross += xh wl + xl wh. The tiles by
// their descriptors (each 16 columns: 32 bytes further on).
template <int N>
__device__ __forceinline__ void issue_step(int w, float (&part)[N / 2], float (&cross)[N / 2],
                                           uint64_t ah, uint64_t al, uint64_t bh,
                                           uint64_t bl) {
    bh = wg::desc_at(bh, w * N * 128);
    bl = wg::desc_at(bl, w * N * 128);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const uint64_t dah = wg::desc_at(ah, 32 * kk), dal = wg::desc_at(al, 32 * kk);
        const uint64_t dbh = wg::desc_at(bh, 32 * kk), dbl = wg::desc_at(bl, 32 * kk);
        mma_step<N>(part, dah, dbh, kk > 0);
        mma_step<N>(cross, dah, dbl, 1);
        mma_step<N>(cross, dal, dbh, 1);
    }
    wg::commit();
}

// logits of warpgroup w's 64 x N tile: accumulator d[4 j + v] is row 16 warp + lane / 4 (+8
// for v >= 2), column 8 j + 2 (lane % 4) (+1 for odd v)
template <int N>
__device__ __forceinline__ void store_logits(int w, int m0, int n0, const float (&acc)[N / 2],
                                             const float (&cross)[N / 2],
                                             float* __restrict__ logits, int tokens,
                                             int n_experts, float sigma) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const int e = n0 + w * N + 8 * j + 2 * q;
        const int t = m0 + 16 * warp + g;
        if (e >= n_experts) continue;
        const float2 top = make_float2(split_logit(acc[4 * j], cross[4 * j], sigma),
                                       split_logit(acc[4 * j + 1], cross[4 * j + 1], sigma));
        const float2 bot = make_float2(split_logit(acc[4 * j + 2], cross[4 * j + 2], sigma),
                                       split_logit(acc[4 * j + 3], cross[4 * j + 3], sigma));
        if (t < tokens) *reinterpret_cast<float2*>(logits + (size_t)t * n_experts + e) = top;
        if (t + 8 < tokens)
            *reinterpret_cast<float2*>(logits + (size_t)(t + 8) * n_experts + e) = bot;
    }
}

// the token norms of the rows this thread split: the V4 lanes of a row add their square sums
// in routing_exact.cu's xor tree (blocks with blockIdx.y == 0)
template <int NT>
__device__ __forceinline__ void store_norms(const Roles<NT>& ro, int m0,
                                            const float (&sq)[Roles<NT>::PER],
                                            float* __restrict__ xnorm, int tokens) {
    if (blockIdx.y != 0) return;
#pragma unroll
    for (int p = 0; p < Roles<NT>::PER; ++p) {
        float s = sq[p];
#pragma unroll
        for (int o = V4 / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
        const int t = m0 + ro.x_row(p);
        if (ro.xf == 0 && t < tokens) xnorm[t] = __fsqrt_rn(s);
    }
}

// the ring's first STAGES - 1 K steps asked for, one commit group each (an empty group past
// the last step, so the waits count groups alike for every hidden size)
template <int STAGES, class Load>
__device__ __forceinline__ void ring_prologue(Load& load, int steps) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
}

__device__ __forceinline__ void zero_rerank_count(int* __restrict__ n_rerank) {
    if (n_rerank != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2)
        n_rerank[threadIdx.x] = 0;
}

}  // namespace
