// What every GGML decoder shares: the host/device markers, float arithmetic that never fuses,
// little-endian loads from unaligned bytes, fp16 -> float32 and the table storage class.
//
// Exactness: the decoders reproduce `gguf.quants.dequantize` (numpy, float32, one rounding per
// operation) bit for bit, so every multiply and add is one IEEE round-to-nearest operation in
// the reference's order. nvcc contracts a*b+c into an FMA on the device by default (one
// rounding instead of two), so the device side spells each operation with its explicit
// round-to-nearest intrinsic, which the compiler never fuses; the host side is a plain
// expression, built with contraction off (-ffp-contract=off, as the CPU test builds it).
// (Every product in today's formulas is exact, an fp16 scale times small integers, so only a
// final add rounds and contraction could not change a value yet; the rule keeps a future
// formula from depending on that.)
#pragma once

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define GGML_HD __host__ __device__ __forceinline__
#else
#define GGML_HD inline
#endif

#ifdef __CUDA_ARCH__
#define GGML_MUL(a, b) __fmul_rn((a), (b))
#define GGML_ADD(a, b) __fadd_rn((a), (b))
#define GGML_SUB(a, b) __fsub_rn((a), (b))
// tables live in device global memory (cached reads that tolerate divergent indices)
#define GGML_TABLE static __device__ const
#define GGML_UNROLL _Pragma("unroll")
#else
#define GGML_MUL(a, b) ((a) * (b))
#define GGML_ADD(a, b) ((a) + (b))
#define GGML_SUB(a, b) ((a) - (b))
#define GGML_TABLE static const
#define GGML_UNROLL
#endif

namespace ggml {

// two consecutive values of a block, as the decoders return them (x: value i, y: i + 1)
struct Pair {
    float x, y;
};

GGML_HD uint32_t load_u16(const uint8_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8); }

GGML_HD uint32_t load_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

GGML_HD float bits_to_f32(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// fp16 bits -> float32, exact (every fp16 value is a float32 value). The host keeps a NaN's
// payload as numpy's conversion does; the device's conversion instruction may not, which
// only matters for NaN (never a finite scale's result).
GGML_HD float f16_to_f32(uint32_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half((unsigned short)h));
#else
    const uint32_t sign = (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return bits_to_f32(sign | 0x7f800000u | (man << 13));  // inf, NaN
    if (exp == 0) {
        if (man == 0) return bits_to_f32(sign);  // signed zero
        exp = 113;  // subnormal: normalize (value man * 2^-24)
        while (!(man & 0x400u)) {
            man <<= 1;
            --exp;
        }
        return bits_to_f32(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

GGML_HD float f16_at(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// 1 if bit `bit` of the 8-bit sign pattern of a 7-bit sign index (IQ2_XXS, IQ2_XS, IQ3_XXS)
// is set: bit 7 of the pattern is the index's parity, so every pattern has an even count
GGML_HD uint32_t parity_sign(uint32_t index7, int bit) {
    uint32_t p = index7 ^ (index7 >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    const uint32_t pattern = index7 | ((p & 1u) << 7);
    return (pattern >> bit) & 1u;
}

GGML_HD float sign_of(uint32_t negative) { return negative ? -1.0f : 1.0f; }

}  // namespace ggml
