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
// (the kernels' ABI: backends/cuda/routing_exact.py launches them with these arguments):
// logits[t, e] and xnorm[t] from xn [T, H] float32 and router_split (wh [E, H] fp16, then wl);
// n_rerank: the re-rank count the GEMM zeroes for the top-k launch after it (null: none).
#define SPLIT_GEMM_PARAMS                                                                     \
    const float *__restrict__ xn, const __half *__restrict__ router_split,                    \
        float *__restrict__ logits, float *__restrict__ xnorm, int *__restrict__ n_rerank,    \
        int tokens, int hidden, int n_experts, float sigma
#define SPLIT_GEMM_ARGS xn, router_split, logits, xnorm, n_rerank, tokens, hidden, n_experts, sigma

// x -> (fp16 hi, fp16 scaled residual); `bad` set when x cannot be split (beyond fp16's range,
// NaN): such a token's approximate logits are not trusted (its norm becomes +inf).
__device__ __forceinline__ void split_f16(float x, __half& hi, __half& lo, bool& bad) {
    bad = bad || !(fabsf(x) <= F16_LIMIT);
    const float xc = fabsf(x) <= F16_LIMIT ? x : 0.0f;
    hi = __float2half_rn(xc);
    lo = __float2half_rn(__fmul_rn(__fsub_rn(xc, __half2float(hi)), LO_SCALE));
}

__device__ __forceinline__ unsigned pack_h2(__half a, __half b) {
    const __half2 h = __halves2half2(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}

// A float4 of x split into four fp16 hi and four scaled-residual halves (two half2 words each,
// in order), its squares added to sq in order (the token norm of the bound)
__device__ __forceinline__ void split_float4(float4 v, uint2& hi, uint2& lo, float& sq,
                                             bool& bad) {
    __half h0, h1, h2, h3, l0, l1, l2, l3;
    split_f16(v.x, h0, l0, bad);
    split_f16(v.y, h1, l1, bad);
    split_f16(v.z, h2, l2, bad);
    split_f16(v.w, h3, l3, bad);
    sq = __fmaf_rn(v.x, v.x, sq);
    sq = __fmaf_rn(v.y, v.y, sq);
    sq = __fmaf_rn(v.z, v.z, sq);
    sq = __fmaf_rn(v.w, v.w, sq);
    hi = make_uint2(pack_h2(h0, h1), pack_h2(h2, h3));
    lo = make_uint2(pack_h2(l0, l1), pack_h2(l2, l3));
}

// The logit of one accumulator triple: sigma * (hi-hi sum + 2^-11 cross sum), rounded as
// every split kernel rounds it.
__device__ __forceinline__ float split_logit(float acc, float cross, float sigma) {
    return __fmul_rn(__fadd_rn(acc, __fmul_rn(cross, LO_UNSCALE)), sigma);
}
