// Order-preserving keys of the routing kernels' top-k selections (routing.cu, routing_exact.cu):
// a larger value maps to a larger unsigned key, so a warp picks the largest logit with integer
// max reductions and breaks ties on the expert id.
#pragma once

// Order-preserving map of float32 onto uint32 (larger float -> larger key).
__device__ __forceinline__ unsigned float_key(float v) {
    const unsigned u = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 -> +0: equal logits tie
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The same for float64 (the exact logits of routing_exact.cu); -0 -> +0 first, as above.
__device__ __forceinline__ unsigned long long double_key(double v) {
    const unsigned long long u = (unsigned long long)__double_as_longlong(__dadd_rn(v, 0.0));
    return (u & 0x8000000000000000ull) ? ~u : (u | 0x8000000000000000ull);
}
