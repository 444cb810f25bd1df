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
// Block: 64 tokens x 128 experts, K steps of 64; warpgroup w (0, 1) multiplies experts
// 64 w .. 64 w + 63. The fp16 tiles (x's hi and lo parts, the router's) are K-major in wgmma's
// 128-byte swizzle: a row's 16-byte chunks permuted by the row index, so coalesced copies and
// the split's stores hit every bank once. A STAGES-deep cp.async ring carries float32 x and the
// router tiles; each thread splits the x it copied itself (its own cp.async wait covers what it
// reads); the tensor cores multiply step s while the threads split step s + 1, and one barrier
// per K step publishes the next step's tiles and frees the last one's (router_gemm_split_sm90).
// The producer schedule (split_sm90_producer) gives the copies and the split to a third
// warpgroup that runs ahead through a ring of finished stages, handed over by named barriers,
// so the two multiplying warpgroups never wait on a block-wide barrier or on the split. (A
// schedule that keeps step s's products running while step s + 1's are issued needs the adds
// of `part` between them, and ptxas then serializes the wgmma, which undoes the overlap.)
// The presplit schedule (presplit_sm90) takes x's parts finished from the exact routing's
// RMSNorm, which writes them in place of float32 xn: the same bytes of input, no split at all.
//
// Compiled for sm_90a only (the launcher asks for it); other targets compile an empty file.

#include <cuda_fp16.h>
#include <stdint.h>

#include "common/mma.cuh"
#include "common/prior_grid.cuh"
#include "common/route_split.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "common/split_sm90.cuh"

// logits[t, e] and xnorm[t] as routing_exact.cu's router_gemm_split writes them (block (0, 0)
// zeroes the re-rank count); 256 threads. Dynamic shared memory: STAGES * (X_TILE + 2 B_TILE)
// + 2 * 2 A_TILE + 1024 (the launcher gives 1024 bytes more than the tiles take: the swizzle
// atoms need 1024-byte alignment, which the dynamic window's start does not promise).
template <int STAGES, int WARPS>
__device__ __forceinline__ void router_gemm_split_sm90(SPLIT_GEMM_PARAMS) {
    constexpr int NT = 256;
    static_assert(WARPS * 32 == NT, "two warpgroups that copy, split and multiply");
    using R = Roles<NT>;
    static_assert(STAGES >= 2, "the ring refills one stage while it reads another");
    static_assert(STAGES * (X_TILE + 2 * B_TILE) + 4 * A_TILE + 1024 <= 227 * 1024, "smem");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* Xs = wg::align1024(smem_raw);    // STAGES x [BM][BK] float32
    unsigned char* Bh = Xs + STAGES * X_TILE;       // STAGES x [BN][BK] fp16, swizzled
    unsigned char* Bl = Bh + STAGES * B_TILE;
    unsigned char* Ah = Bl + STAGES * B_TILE;       // 2 buffers x [hi, lo] [BM][BK], swizzled
    const R ro(threadIdx.x);
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, w = threadIdx.x >> 7;
    const int steps = hidden / BK;
    zero_rerank_count(n_rerank);
    const Copies<NT> cp(ro, m0, n0, xn, router_split, tokens, hidden, n_experts);
    const uint64_t d0 = wg::sw128_desc(Xs);  // the descriptors of every tile derive from it

    auto load = [&](int stage, int step) {
        cp.load_x(Xs + stage * X_TILE, step);
        cp.load_router(Bh + stage * B_TILE, Bl + stage * B_TILE, step);
    };
    float sq[R::PER];
#pragma unroll
    for (int p = 0; p < R::PER; ++p) sq[p] = 0.0f;
    auto split = [&](int stage, int buf) {
        unsigned char* hi = Ah + buf * 2 * A_TILE;
#pragma unroll
        for (int p = 0; p < R::PER; ++p) {
            const int r = ro.x_row(p);
            const float4 v =
                *reinterpret_cast<const float4*>(Xs + stage * X_TILE + (r * BK + 4 * ro.xf) * 4);
            split_store(ro.xf, v, r, hi, hi + A_TILE, sq[p]);
        }
    };

    float acc[32], part[32], cross[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = part[i] = cross[i] = 0.0f;
    ring_prologue<STAGES>(load, steps);
    wg::cp_wait_mem<STAGES - 2>();
    split(0, 0);
    wg::fence_async_smem();
    __syncthreads();

    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1, stage = step % STAGES;
        wg::pin(part);
        wg::pin(cross);
        const int a_at = (int)(Ah - Xs) + buf * 2 * A_TILE, b_at = (int)(Bh - Xs) + stage * B_TILE;
        issue_step<64>(w, part, cross, wg::desc_at(d0, a_at), wg::desc_at(d0, a_at + A_TILE),
                       wg::desc_at(d0, b_at), wg::desc_at(d0, b_at + STAGES * B_TILE));
        // while the tensor cores multiply: refill the stage step-1 used (every warpgroup
        // finished it before the last barrier) and split step+1
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next);
        cp_async_commit();
        if (step + 1 < steps) {
            wg::cp_wait_mem<STAGES - 2>();
            split((step + 1) % STAGES, buf ^ 1);
            wg::fence_async_smem();
        }
        wg::wait<0>();
        wg::pin(part);
        wg::pin(cross);
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
        __syncthreads();  // step+1's tiles are visible; nobody reads this step's any more
    }
    store_logits<64>(w, m0, n0, acc, cross, logits, tokens, n_experts, sigma);
    store_norms(ro, m0, sq, xnorm, tokens);
}

// The same logits and norms from 128 (CWG + 1) threads: CWG multiplying warpgroups (two of 64
// experts each, or one of all 128: wgmma's N = 128 reads each x tile once per 128 experts,
// which halves the shared-memory reads of x per product), then a producer warpgroup that
// copies the router tiles, loads x into registers two steps ahead and splits it into a ring
// of STAGES stages [Bh, Bl, Ah, Al]. Stage s of step k is handed over on named barriers: the
// producer arrives on full(s, w) once the stage is written and fenced for the async proxy,
// warpgroup w syncs on it before its products; the multiplying warpgroups arrive on empty(s)
// once their products of the stage are done, and the producer syncs on it before it refills
// the stage for step k + STAGES (the last STAGES steps are never refilled, so nobody arrives
// on them: every barrier completes before the block exits). Dynamic shared memory:
// STAGES * (2 B_TILE + 2 A_TILE) + 1024.
template <int STAGES, int WARPS, int CWG = WARPS / 4 - 1>
__device__ __forceinline__ void split_sm90_producer(SPLIT_GEMM_PARAMS) {
    constexpr int STAGE = 2 * B_TILE + 2 * A_TILE, NT = 128, N = BN / CWG;
    constexpr int FULL_COUNT = 128 + NT, EMPTY_COUNT = 128 * CWG + NT;
    // the producers publish step i - 2 at iteration i and refill stage i % STAGES after step
    // i - STAGES: STAGES > 3 leaves the multiplying warpgroups a published step to work on
    static_assert(STAGES >= 3 && 3 * STAGES <= 15, "named barriers 1 .. 15");
    static_assert(STAGES * STAGE + 1024 <= 227 * 1024, "smem");
    static_assert(CWG == 1 || CWG == 2, "one or two multiplying warpgroups");
    using R = Roles<NT>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* ring = wg::align1024(smem_raw);
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, w = threadIdx.x >> 7;
    const int steps = hidden / BK;
    auto full = [](int s, int g) { return 1 + 2 * s + g; };
    auto empty = [](int s) { return 1 + 2 * STAGES + s; };
    zero_rerank_count(n_rerank);

    const uint64_t d0 = wg::sw128_desc(ring);
    if (w == CWG) {
        const R ro(threadIdx.x - 128 * CWG);
        const Copies<NT> cp(ro, m0, n0, xn, router_split, tokens, hidden, n_experts);
        float sq[R::PER];
        float4 xa[R::PER], xb[R::PER], xc[R::PER];
#pragma unroll
        for (int p = 0; p < R::PER; ++p) sq[p] = 0.0f;
        // iteration i: refill stage i % STAGES with step i's router tiles and load step i's x
        // into `nxt`, then split step i - 2's x (`cur`) into its stage and hand the stage over
        auto produce = [&](int i, float4 (&nxt)[R::PER], const float4 (&cur)[R::PER]) {
            if (i < steps) {
                const int s = i % STAGES;
                if (i >= STAGES) wg::bar_sync(empty(s), EMPTY_COUNT);
                unsigned char* st = ring + s * STAGE;
                cp.load_router(st, st + B_TILE, i);
                cp_async_commit();
#pragma unroll
                for (int p = 0; p < R::PER; ++p)
                    nxt[p] = cp.x_bytes[p] ? __ldg(reinterpret_cast<const float4*>(cp.x[p] +
                                                                                   i * BK))
                                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
            if (i >= 2 && i <= steps + 1) {
                const int s = (i - 2) % STAGES;
                unsigned char* ah = ring + s * STAGE + 2 * B_TILE;
#pragma unroll
                for (int p = 0; p < R::PER; ++p)
                    split_store(ro.xf, cur[p], ro.x_row(p), ah, ah + A_TILE, sq[p]);
                // step i - 2's router tiles (the groups of the steps after it may fly on)
                if (i < steps)
                    wg::cp_wait_mem<2>();
                else if (i == steps)
                    wg::cp_wait_mem<1>();
                else
                    wg::cp_wait_mem<0>();
                wg::fence_async_smem();
#pragma unroll
                for (int g = 0; g < CWG; ++g) wg::bar_arrive(full(s, g), FULL_COUNT);
            }
        };
        for (int i = 0; i <= steps + 1; i += 3) {
            produce(i, xa, xb);
            produce(i + 1, xb, xc);
            produce(i + 2, xc, xa);
        }
        store_norms(ro, m0, sq, xnorm, tokens);
        return;
    }

    float acc[N / 2], part[N / 2], cross[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = part[i] = cross[i] = 0.0f;
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        wg::bar_sync(full(s, w), FULL_COUNT);
        wg::pin(part);
        wg::pin(cross);
        const uint64_t d = wg::desc_at(d0, s * STAGE);
        issue_step<N>(w, part, cross, wg::desc_at(d, 2 * B_TILE),
                      wg::desc_at(d, 2 * B_TILE + A_TILE), d, wg::desc_at(d, B_TILE));
        wg::wait<0>();
        wg::pin(part);
        wg::pin(cross);
        if (step + STAGES < steps) wg::bar_arrive(empty(s), EMPTY_COUNT);
#pragma unroll
        for (int i = 0; i < N / 2; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
    }
    store_logits<N>(w, m0, n0, acc, cross, logits, tokens, n_experts, sigma);
}

// x's operands finished: the exact routing's RMSNorm (routing_norm_split.cu) wrote xn's fp16
// hi parts [T, H] and, T * H values further on, its scaled residuals, the bytes split_pair
// makes of xn, so the tiles need no split and every thread only copies. A STAGES-deep cp.async
// ring of [Bh, Bl, Ah, Al] stages, one barrier per K step: the barrier publishes step's stage
// (each thread waited for its own copies and fenced them for the async proxy) and frees the
// stage of step - 1, whose products every warpgroup finished before it, and which is then
// refilled with step + STAGES - 1 while the tensor cores multiply step. The token norms come
// from the RMSNorm too (xnorm is not written here). Same logits, bit for bit, as every tile.
// Dynamic shared memory: STAGES * (2 B_TILE + 2 A_TILE) + 1024.
template <int STAGES, int WARPS>
__device__ __forceinline__ void presplit_sm90(SPLIT_GEMM_PARAMS) {
    constexpr int NT = 256, STAGE = 2 * B_TILE + 2 * A_TILE;
    constexpr int APER = BM * CH / NT;  // 16-byte chunks of each x part per thread and K step
    static_assert(WARPS * 32 == NT && APER * NT == BM * CH, "two warpgroups that copy and multiply");
    static_assert(STAGES >= 2 && STAGES * STAGE + 1024 <= 227 * 1024, "smem");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* ring = wg::align1024(smem_raw);
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, w = threadIdx.x >> 7;
    const int steps = hidden / BK;
    zero_rerank_count(n_rerank);
    const Copies<NT> cp(Roles<NT>(threadIdx.x), m0, n0, xn, router_split, tokens, hidden,
                        n_experts);
    // this thread's chunks of the x parts: rows past the chunk's last copy zero bytes
    const __half* parts = reinterpret_cast<const __half*>(xn);
    const size_t lo_off = (size_t)tokens * hidden;
    const __half* a[APER];
    int a_bytes[APER], a_at[APER];
#pragma unroll
    for (int p = 0; p < APER; ++p) {
        const int r = threadIdx.x / CH + p * (NT / CH), c = threadIdx.x % CH, t = m0 + r;
        a[p] = parts + (size_t)(t < tokens ? t : 0) * hidden + 8 * c;
        a_bytes[p] = t < tokens ? 16 : 0;
        a_at[p] = wg::sw128(r, c);
    }
    auto load = [&](int stage, int step) {
        unsigned char* st = ring + stage * STAGE;
        cp.load_router(st, st + B_TILE, step);
#pragma unroll
        for (int p = 0; p < APER; ++p) {
            cp_async16(st + 2 * B_TILE + a_at[p], a[p] + step * BK, a_bytes[p]);
            cp_async16(st + 2 * B_TILE + A_TILE + a_at[p], a[p] + lo_off + step * BK,
                       a_bytes[p]);
        }
    };
    const uint64_t d0 = wg::sw128_desc(ring);
    float acc[32], part[32], cross[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = part[i] = cross[i] = 0.0f;
    ring_prologue<STAGES>(load, steps);
    for (int step = 0; step < steps; ++step) {
        const int stage = step % STAGES;
        wg::cp_wait_mem<STAGES - 2>();  // this thread's copies of `step` have landed
        wg::fence_async_smem();
        __syncthreads();  // everyone's have; nobody reads step - 1's stage any more
        wg::pin(part);
        wg::pin(cross);
        const uint64_t d = wg::desc_at(d0, stage * STAGE);
        issue_step<64>(w, part, cross, wg::desc_at(d, 2 * B_TILE),
                       wg::desc_at(d, 2 * B_TILE + A_TILE), d, wg::desc_at(d, B_TILE));
        const int next = step + STAGES - 1;
        if (next < steps) load(next % STAGES, next);
        cp_async_commit();
        wg::wait<0>();
        wg::pin(part);
        wg::pin(cross);
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], part[i]);
    }
    store_logits<64>(w, m0, n0, acc, cross, logits, tokens, n_experts, sigma);
}

// One kernel per tile line (backends/cuda/routing/exact.py reads these lines: name, block
// shape, warps, stages and the schedule, whose threads and shared memory the launcher knows).
#define SPLIT_SM90_KERNEL(NAME, BM_, BN_, WARPS, BK_, STAGES, FN)                              \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)                                \
        router_logits_split_##NAME(SPLIT_GEMM_PARAMS) {                                       \
        static_assert(BM_ == BM && BN_ == BN && BK_ == BK, "the one block shape");            \
        wait_prior_grid();                                                                    \
        FN<STAGES, WARPS>(SPLIT_GEMM_ARGS);                                                   \
    }

#else
#define SPLIT_SM90_KERNEL(NAME, BM_, BN_, WARPS, BK_, STAGES, FN)
#endif

SPLIT_SM90_KERNEL(wg64, 64, 128, 8, 64, 4, router_gemm_split_sm90)
SPLIT_SM90_KERNEL(wg64s3, 64, 128, 8, 64, 3, router_gemm_split_sm90)
SPLIT_SM90_KERNEL(wg64p, 64, 128, 12, 64, 4, split_sm90_producer)
SPLIT_SM90_KERNEL(wg128p, 64, 128, 8, 64, 4, split_sm90_producer)
SPLIT_SM90_KERNEL(wg64h3, 64, 128, 8, 64, 3, presplit_sm90)
SPLIT_SM90_KERNEL(wg64h4, 64, 128, 8, 64, 4, presplit_sm90)
