// The split of float32 values into fp16 parts that the exact routing's tensor-core GEMMs
// multiply (routing_exact.cu on mma.sync, routing_split_sm90.cu on wgmma): one definition, so
// every kernel of the split GEMM rounds the same way and gives the same bytes.
#pragma once
#include <cuda_fp16.h>

#define F16_LIMIT 65504.0f
#define LO_SCALE 2048.0f              // 2^11: the residual's scale-up
#define LO_UNSCALE 4.8828125e-4f      // 2^-11
#define CHUNK_K 64                    // the xh wh products of CHUNK_K columns sum in fresh registers

// The split GEMM's parameters, the one list every tile's device function and kernel takes
// (the kernels' ABI: backends/cuda/routing/exact.py launches them with these arguments):
// logits[t, e] and xnorm[t] from xn [T, H] float32 and router_split (wh [E, H] fp16, then wl);
// n_rerank: the re-rank count the GEMM zeroes for the top-k launch after it (null: none).
#define SPLIT_GEMM_PARAMS                                                                     \
    const float *__restrict__ xn, const __half *__restrict__ router_split,                    \
        float *__restrict__ logits, float *__restrict__ xnorm, int *__restrict__ n_rerank,    \
        int tokens, int hidden, int n_experts, float sigma
#define SPLIT_GEMM_ARGS xn, router_split, logits, xnorm, n_rerank, tokens, hidden, n_experts, sigma

// Two values x0, x1 -> one half2 word of fp16 hi parts and one of scaled residuals (x0 in the
// low half). No clamp: a token whose norm is at most F16_LIMIT has no value beyond fp16's range,
// and any other token (a larger norm, or NaN / inf, which the norm carries) is re-ranked whole
// from its canonical logits, so its approximate ones are never read.
__device__ __forceinline__ void split_pair(float x0, float x1, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn(__fmul_rn(__fsub_rn(x0, hf.x), LO_SCALE),
                                        __fmul_rn(__fsub_rn(x1, hf.y), LO_SCALE));
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
}

// A float4 of x split into four fp16 hi and four scaled-residual halves (two half2 words each,
// in order), its squares added to sq in order (the token norm of the bound)
__device__ __forceinline__ void split_float4(float4 v, uint2& hi, uint2& lo, float& sq) {
    split_pair(v.x, v.y, hi.x, lo.x);
    split_pair(v.z, v.w, hi.y, lo.y);
    sq = __fmaf_rn(v.x, v.x, sq);
    sq = __fmaf_rn(v.y, v.y, sq);
    sq = __fmaf_rn(v.z, v.z, sq);
    sq = __fmaf_rn(v.w, v.w, sq);
}

// The logit of one accumulator triple: sigma * (hi-hi sum + 2^-11 cross sum), rounded as
// every split kernel rounds it.
__device__ __forceinline__ float split_logit(float acc, float cross, float sigma) {
    return __fmul_rn(__fadd_rn(acc, __fmul_rn(cross, LO_UNSCALE)), sigma);
}
