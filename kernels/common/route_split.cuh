// The split of float32 values into fp16 parts that the exact routing's tensor-core GEMMs
// multiply (routing_exact.cu on mma.sync, routing_split_sm90.cu on wgmma): one definition, so
// every kernel of the split GEMM rounds the same way and gives the same bytes.
#pragma once
#include <cuda_fp16.h>

#define F16_LIMIT 65504.0f
#define LO_SCALE 2048.0f              // 2^11: the residual's scale-up
#define LO_UNSCALE 4.8828125e-4f      // 2^-11
#define CHUNK_K 64                    // the xh wh products of CHUNK_K columns sum in fresh registers

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

// The logit of one accumulator triple: sigma * (hi-hi sum + 2^-11 cross sum), rounded as
// every split kernel rounds it.
__device__ __forceinline__ float split_logit(float acc, float cross, float sigma) {
    return __fmul_rn(__fadd_rn(acc, __fmul_rn(cross, LO_UNSCALE)), sigma);
}
