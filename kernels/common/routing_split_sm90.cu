// The exact routing's split GEMM on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a):
// the same logits, bit for bit, as routing_exact.cu's mma.sync tiles, at the tensor cores' rate.
//
// Why: the mma.sync split GEMM reads each fp16 hi and lo operand through ldmatrix for three
// products per fragment, and that shared-memory round trip, not the tensor cores, bounds it.
// Here both operands reach the tensor cores from shared memory through wgmma's descriptors,
// asynchronously, so the split of the next K step (ALU work) runs while they multiply this one.
//
// The chain of every logit is routing_exact.cu's: per 16 columns, part += xh wh, then cross +=
// xh wl, then cross += xl wh (xl, wl: residuals scaled by 2^11, route_split.cuh); part starts
// fresh every CHUNK_K (= BK) columns and is added to the running sum with one float32 add; the
// logit is sigma * (acc + 2^-11 cross). Each instruction computes a 16-column step of products
// exactly as mma.sync m16n8k16 does, so tiles of either kernel give the same bytes (tested).
//
// Block: 64 tokens x 128 experts, two warpgroups (warpgroup w: experts 64 w .. 64 w + 63), K
// steps of 64. The fp16 tiles (x's hi and lo parts, the router's) are K-major in wgmma's
// 128-byte swizzle: a row's 16-byte chunks permuted by the row index, so coalesced copies and
// the split's stores hit every bank once. A STAGES-deep cp.async ring carries float32 x and the
// router tiles; each thread splits the x it copied itself (its own cp.async wait covers what it
// reads); the tensor cores multiply step s while the threads split step s + 1, and one barrier
// per K step publishes the next step's tiles and frees the last one's. (A schedule that keeps
// step s's products running while step s + 1's are issued needs the adds of `part` between
// them, and ptxas then serializes the wgmma, which undoes the overlap.)
//
// Compiled for sm_90a only (the launcher asks for it); other targets compile an empty file.

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/route_split.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace {

// the waits below carry a memory clobber: a thread reads what its own cp.async wrote with no
// barrier in between, so the compiler must not hoist those reads above the wait
template <int N>
__device__ __forceinline__ void cp_wait_mem() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Ties the accumulator registers to program order around the asynchronous instructions: reads
// after the wait and writes before the issue cannot be moved across them.
__device__ __forceinline__ void pin(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle: rows of 64 halves
// (128 bytes) at a 128-byte stride, 16-byte chunk c of row r stored at chunk c ^ (r % 8), tiles
// 1024-byte aligned. SBO: 1024 bytes from one 8-row group to the next; LBO unused (1). A step
// of 16 columns inside the row adds 32 bytes to the start address.
__device__ __forceinline__ uint64_t sw128_desc(const void* p) {
    const uint64_t a = (smem_addr(p) & 0x3FFFFu) >> 4;
    return a | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

// byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile
__device__ __forceinline__ int sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// d (64 x 64 float32 over the warpgroup) = A (64 x 16, descriptor) * B (16 x 64, descriptor),
// both K-major, + (accumulate ? d : 0)
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint64_t da, uint64_t db,
                                               int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// The shape both schedules share: 64 tokens x 128 experts, two warpgroups, K steps of 64.
constexpr int BM = 64, BN = 128, BK = 64, THREADS = 256;
constexpr int V4 = BK / 4;               // float4s per x row and K step
constexpr int PER = BM * V4 / THREADS;   // x float4s per thread: float4 xf of rows xr0 + 16 p
constexpr int CH = BK / 8;               // 16-byte fp16 chunks per router row
constexpr int BPER = BN * CH / THREADS;  // router chunks per thread and part
constexpr int X_TILE = BM * BK * 4, B_TILE = BN * BK * 2, A_TILE = BM * BK * 2;  // bytes
static_assert(BK == CHUNK_K, "one K step is one chunk of fresh hi-hi sums");
static_assert(PER * THREADS == BM * V4 && BPER * THREADS == BN * CH, "K step");
static_assert(X_TILE % 1024 == 0 && B_TILE % 1024 == 0 && A_TILE % 1024 == 0,
              "swizzle atoms stay 1024-byte aligned");

// The block's place and the per-thread roles of its copies and its split.
struct Block {
    int m0, n0, wg, warp, lane, xf, xr0, bc, br0;
    __device__ Block()
        : m0(blockIdx.x * BM), n0(blockIdx.y * BN), wg(threadIdx.x >> 7),
          warp((threadIdx.x >> 5) & 3), lane(threadIdx.x & 31), xf(threadIdx.x % V4),
          xr0(threadIdx.x / V4), bc(threadIdx.x % CH), br0(threadIdx.x / CH) {}
};

__device__ __forceinline__ unsigned char* align1024(unsigned char* p) {
    return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(p) + 1023) &
                                            ~uintptr_t(1023));
}

// this thread's router chunks of K step `step` into swizzled tiles bh / bl
__device__ __forceinline__ void load_router(const Block& b, unsigned char* bh, unsigned char* bl,
                                            const __half* __restrict__ router_split, int step,
                                            int hidden, int n_experts) {
    const size_t lo_off = (size_t)n_experts * hidden;
#pragma unroll
    for (int p = 0; p < BPER; ++p) {
        const int r = b.br0 + p * (THREADS / CH), e = b.n0 + r;
        const size_t at = e < n_experts ? (size_t)e * hidden + step * BK + 8 * b.bc : 0;
        const int bytes = e < n_experts ? 16 : 0;
        cp_async16(bh + sw128(r, b.bc), router_split + at, bytes);
        cp_async16(bl + sw128(r, b.bc), router_split + lo_off + at, bytes);
    }
}

// float4 v of row r, split into the swizzled hi / lo tiles (four halves: 8 bytes each, at
// half xf % 2 of chunk xf / 2); the square sum and the bad flag of the row's norm
__device__ __forceinline__ void split_store(const Block& b, float4 v, int r, unsigned char* hi,
                                            unsigned char* lo, float& sq, bool& bad) {
    uint2 h, l;
    split_float4(v, h, l, sq, bad);
    const int off = sw128(r, b.xf >> 1) + (b.xf & 1) * 8;
    *reinterpret_cast<uint2*>(hi + off) = h;
    *reinterpret_cast<uint2*>(lo + off) = l;
}

// issues one K step's twelve products: per 16 columns part (+)= xh wh, cross += xh wl + xl wh
__device__ __forceinline__ void issue_step(const Block& b, float (&part)[32], float (&cross)[32],
                                           const unsigned char* ah, const unsigned char* al,
                                           const unsigned char* bh, const unsigned char* bl) {
    bh += b.wg * 64 * 128;  // this warpgroup's 64 router rows
    bl += b.wg * 64 * 128;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const uint64_t dah = sw128_desc(ah + 32 * kk), dal = sw128_desc(al + 32 * kk);
        const uint64_t dbh = sw128_desc(bh + 32 * kk), dbl = sw128_desc(bl + 32 * kk);
        wgmma_64x64x16(part, dah, dbh, kk > 0);
        wgmma_64x64x16(cross, dah, dbl, 1);
        wgmma_64x64x16(cross, dal, dbh, 1);
    }
    wg_commit();
}

// logits and norms: accumulator d[4 j + v] is row 16 warp + lane / 4 (+8 for v >= 2), column
// 8 j + 2 (lane % 4) (+1 for odd v) of the warpgroup's 64 x 64 tile; the V4 lanes that split a
// row add their square sums in routing_exact.cu's xor tree (blocks with blockIdx.y == 0)
__device__ __forceinline__ void epilogue(const Block& b, const float (&acc)[32],
                                         const float (&cross)[32], const float (&sq)[PER],
                                         const bool (&bad)[PER], float* __restrict__ logits,
                                         float* __restrict__ xnorm, int tokens, int n_experts,
                                         float sigma) {
    const int g = b.lane >> 2, q = b.lane & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int e = b.n0 + b.wg * 64 + 8 * j + 2 * q;
        const int t = b.m0 + 16 * b.warp + g;
        if (e >= n_experts) continue;
        const float2 top = make_float2(split_logit(acc[4 * j], cross[4 * j], sigma),
                                       split_logit(acc[4 * j + 1], cross[4 * j + 1], sigma));
        const float2 bot = make_float2(split_logit(acc[4 * j + 2], cross[4 * j + 2], sigma),
                                       split_logit(acc[4 * j + 3], cross[4 * j + 3], sigma));
        if (t < tokens) *reinterpret_cast<float2*>(logits + (size_t)t * n_experts + e) = top;
        if (t + 8 < tokens)
            *reinterpret_cast<float2*>(logits + (size_t)(t + 8) * n_experts + e) = bot;
    }
    if (blockIdx.y != 0) return;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        float s = bad[p] ? __int_as_float(0x7f800000) : sq[p];
#pragma unroll
        for (int o = V4 / 2; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
        const int t = b.m0 + b.xr0 + p * (THREADS / V4);
        if (b.xf == 0 && t < tokens) xnorm[t] = __fsqrt_rn(s);
    }
}

}  // namespace

// logits[t, e] and xnorm[t] as routing_exact.cu's router_gemm_split writes them (block (0, 0)
// zeroes the re-rank count). Dynamic shared memory: STAGES * (X_TILE + 2 B_TILE) + 2 * 2 A_TILE
// + 1024 (the launcher gives 1024 bytes more than the tiles take: the swizzle atoms need
// 1024-byte alignment, which the dynamic window's start does not promise).
template <int STAGES>
__device__ __forceinline__ void router_gemm_split_sm90(const float* __restrict__ xn,
                                                       const __half* __restrict__ router_split,
                                                       float* __restrict__ logits,
                                                       float* __restrict__ xnorm,
                                                       int* __restrict__ n_rerank, int tokens,
                                                       int hidden, int n_experts, float sigma) {
    static_assert(STAGES >= 2, "the ring refills one stage while it reads another");
    static_assert(STAGES * (X_TILE + 2 * B_TILE) + 4 * A_TILE + 1024 <= 227 * 1024, "smem");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* Xs = align1024(smem_raw);        // STAGES x [BM][BK] float32
    unsigned char* Bh = Xs + STAGES * X_TILE;       // STAGES x [BN][BK] fp16, swizzled
    unsigned char* Bl = Bh + STAGES * B_TILE;
    unsigned char* Ah = Bl + STAGES * B_TILE;       // 2 buffers x [hi, lo] [BM][BK], swizzled
    const Block b;
    const int steps = hidden / BK;
    if (n_rerank != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2)
        n_rerank[threadIdx.x] = 0;

    auto load = [&](int stage, int step) {
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int r = b.xr0 + p * (THREADS / V4), t = b.m0 + r;
            const float* src = t < tokens ? xn + (size_t)t * hidden + step * BK + 4 * b.xf : xn;
            cp_async16(Xs + stage * X_TILE + (r * BK + 4 * b.xf) * 4, src, t < tokens ? 16 : 0);
        }
        load_router(b, Bh + stage * B_TILE, Bl + stage * B_TILE, router_split, step, hidden,
                    n_experts);
    };
    float sq[PER];
    bool bad[PER];
#pragma unroll
    for (int p = 0; p < PER; ++p) {
        sq[p] = 0.0f;
        bad[p] = false;
    }
    auto split = [&](int stage, int buf) {
        unsigned char* hi = Ah + buf * 2 * A_TILE;
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int r = b.xr0 + p * (THREADS / V4);
            const float4 v =
                *reinterpret_cast<const float4*>(Xs + stage * X_TILE + (r * BK + 4 * b.xf) * 4);
            split_store(b, v, r, hi, hi + A_TILE, sq[p], bad[p]);
        }
    };

    float acc[32], part[32], cross[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = part[i] = cross[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s);
        cp_async_commit();
    }
    cp_wait_mem<STAGES - 2>();
    split(0, 0);
    fence_async_smem();
    __syncthreads();

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1, stage = step % STAGES;
        pin(part);
        pin(cross);
        issue_step(b, part, cross, Ah + buf * 2 * A_TILE, Ah + buf * 2 * A_TILE + A_TILE,
                   Bh + stage * B_TILE, Bl + stage * B_TILE);
        // while the tensor cores multiply: refill the stage step-1 used (every warpgroup
        // finished it before the last barrier) and split step+1
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next);
        cp_async_commit();
        if (step + 1 < steps) {
            cp_wait_mem<STAGES - 2>();
            split((step + 1) % STAGES, buf ^ 1);
            fence_async_smem();
        }
        wg_wait<0>();
        pin(part);
        pin(cross);
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
        __syncthreads();  // step+1's tiles are visible; nobody reads this step's any more
    }
    epilogue(b, acc, cross, sq, bad, logits, xnorm, tokens, n_experts, sigma);
}

#define SPLIT_SM90_KERNEL(NAME, BM_, BN_, WARPS_M, WARPS_N, BK_, STAGES, FN)                  \
    extern "C" __global__ void __launch_bounds__(WARPS_M * WARPS_N * 32, 1)                   \
        router_logits_split_##NAME(const float* __restrict__ xn,                              \
                                   const __half* __restrict__ router_split,                   \
                                   float* __restrict__ logits, float* __restrict__ xnorm,     \
                                   int* __restrict__ n_rerank, int tokens, int hidden,        \
                                   int n_experts, float sigma) {                              \
        static_assert(BM_ == BM && BN_ == BN && BK_ == BK && WARPS_M * WARPS_N * 32 == THREADS, \
                      "the one block shape");                                                 \
        FN<STAGES>(xn, router_split, logits, xnorm, n_rerank, tokens, hidden, n_experts,      \
                   sigma);                                                                    \
    }

#else
#define SPLIT_SM90_KERNEL(NAME, BM_, BN_, WARPS_M, WARPS_N, BK_, STAGES, FN)
#endif

// Tiles (backends/cuda/routing_exact.py reads these lines: name, block shape, stages and the
// schedule, whose shared memory the launcher computes).
SPLIT_SM90_KERNEL(wg64, 64, 128, 4, 2, 64, 4, router_gemm_split_sm90)
SPLIT_SM90_KERNEL(wg64s3, 64, 128, 4, 2, 64, 3, router_gemm_split_sm90)
