// What every GGML decoder shares: the host/device markers, float arithmetic that never fuses,
// little-endian loads from unaligned bytes (one byte at a time, or 8 bytes as wide as their
// address allows), fp16 -> float32 and the table storage class.
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

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "load8 reads words as little-endian: a big-endian host is not supported"
#endif

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
#define GGML_NO_UNROLL _Pragma("unroll 1")
#else
#define GGML_MUL(a, b) ((a) * (b))
#define GGML_ADD(a, b) ((a) + (b))
#define GGML_SUB(a, b) ((a) - (b))
#define GGML_TABLE static const
#define GGML_UNROLL
#define GGML_NO_UNROLL
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

// Eight bytes as two little-endian words (lo: bytes 0..3), or eight 8-bit lanes of quant bits.
struct Bytes8 {
    uint32_t lo, hi;
};

// A T from p, whose address the caller has checked is a multiple of sizeof(T): one load of that
// width on the device (memcpy there may split it), memcpy in the host build.
template <class T> GGML_HD T load_aligned(const uint8_t* p) {
#ifdef __CUDA_ARCH__
    return *static_cast<const T*>(__builtin_assume_aligned(p, sizeof(T)));
#else
    T v;
    memcpy(&v, p, sizeof v);
    return v;
#endif
}

// Bytes p[0..7] with the widest loads p's address allows: one 8-byte load at a multiple of 8,
// else 4 + 4, 2 + 4 + 2 or eight 1-byte loads. No width is always legal: a gather's source may
// start at any byte (its launcher checks only the addresses it writes) and a block lies a
// multiple of its size after it (Q3_K's 110 bytes: every other block starts 2 bytes past a
// multiple of 4 even in an aligned source). The branch does not diverge where the callers read
// at offsets from a block start that are multiples of 8: the gathers' 32 lanes of a warp decode
// the 32 chunks of one 256-value block.
GGML_HD Bytes8 load8(const uint8_t* p) {
    const uintptr_t a = (uintptr_t)p;
    if ((a & 7) == 0) {
        const uint64_t v = load_aligned<uint64_t>(p);
        return {(uint32_t)v, (uint32_t)(v >> 32)};
    }
    if ((a & 3) == 0) return {load_aligned<uint32_t>(p), load_aligned<uint32_t>(p + 4)};
    if ((a & 1) == 0) {  // 2 past a multiple of 4: bytes 2..5 are one aligned word
        const uint32_t mid = load_aligned<uint32_t>(p + 2);
        return {load_aligned<uint16_t>(p) | (mid << 16),
                (mid >> 16) | ((uint32_t)load_aligned<uint16_t>(p + 6) << 16)};
    }
    // odd (no source in practice): a byte at a time, in a loop, which unrolled would be
    // predicated into the even cases and cost them its 8 loads
    uint64_t v = 0;
GGML_NO_UNROLL
    for (int k = 0; k < 8; ++k) v |= (uint64_t)p[k] << (8 * k);
    return {(uint32_t)v, (uint32_t)(v >> 32)};
}

// the field of `mask` (its low bits) at bit `shift` of each byte, in place: whole words are
// shifted, so shift + the field's width must not exceed 8
GGML_HD Bytes8 field8(Bytes8 w, int shift, uint32_t mask) {
    const uint32_t m = mask * 0x01010101u;
    return {(w.lo >> shift) & m, (w.hi >> shift) & m};
}

// lanes lo | hi << shift (the fields of lo and hi << shift do not overlap, nor cross a byte)
GGML_HD Bytes8 merge8(Bytes8 lo, Bytes8 hi, int shift) {
    return {lo.lo | (hi.lo << shift), lo.hi | (hi.hi << shift)};
}

// byte k (0..7) of w (on the device one byte permute, where a shift and a mask would be two)
GGML_HD uint32_t byte8(Bytes8 w, int k) {
#ifdef __CUDA_ARCH__
    return __byte_perm(k < 4 ? w.lo : w.hi, 0u, 0x4440u | (k & 3));
#else
    return ((k < 4 ? w.lo : w.hi) >> (8 * (k & 3))) & 0xffu;
#endif
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
