// Decoders of the plain float types and the 32-value quants: F32, F16, BF16, Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4. Included by decode.cuh (which declares Decode<T>).
//
// Each Decode<T>::pair(b, i) returns values i and i + 1 (i even) of the block at b as float32,
// equal bit for bit to gguf.quants.dequantize: the same operations in the same order, each
// rounded once (GGML_MUL / GGML_ADD / GGML_SUB). Field offsets are bytes from the block start;
// a 32-value block packs value j in the low nibble of qs[j] (j < 16) or the high nibble of
// qs[j - 16], so values i and i + 1 always share a byte's half and every scale.
#pragma once

namespace ggml {

// the nibble of value j (0..31) in 16 packed bytes
GGML_HD uint32_t nibble32(const uint8_t* qs, int j) { return (qs[j & 15] >> ((j >> 4) << 2)) & 15u; }

// raw float32 words
template <> struct Decode<Type::F32> : Traits<Type::F32> {
    GGML_HD static Pair pair(const uint8_t* b, int) {
        return {bits_to_f32(load_u32(b)), bits_to_f32(load_u32(b + 4))};
    }
};

// fp16 words, widened exactly
template <> struct Decode<Type::F16> : Traits<Type::F16> {
    GGML_HD static Pair pair(const uint8_t* b, int) { return {f16_at(b), f16_at(b + 2)}; }
#ifndef STRATA_GGML_HOST
    // eight values as stored (an fp16 value is its own rounding; a NaN keeps its payload,
    // which the float32 path need not), from an even address in the widest loads it allows
    __device__ static void chunk8_h2(const uint8_t* b, int, unsigned (&out)[4]) {
        const uintptr_t a = (uintptr_t)b;
        if ((a & 15) == 0) {
            const uint4 v = load_aligned<uint4>(b);
            out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
        } else if ((a & 3) == 0) {
#pragma unroll
            for (int p = 0; p < 4; ++p) out[p] = load_aligned<uint32_t>(b + 4 * p);
        } else {
#pragma unroll
            for (int p = 0; p < 4; ++p)
                out[p] = load_aligned<uint16_t>(b + 4 * p) |
                         ((uint32_t)load_aligned<uint16_t>(b + 4 * p + 2) << 16);
        }
    }
#endif
};

// bfloat16: the top half of a float32 word
template <> struct Decode<Type::BF16> : Traits<Type::BF16> {
    GGML_HD static Pair pair(const uint8_t* b, int) {
        return {bits_to_f32(load_u16(b) << 16), bits_to_f32(load_u16(b + 2) << 16)};
    }
};

// d (fp16) at 0, 32 int8 at 2: value = q * d
template <> struct Decode<Type::Q8_0> : Traits<Type::Q8_0> {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b);
        return {GGML_MUL((float)(int8_t)b[2 + i], d), GGML_MUL((float)(int8_t)b[3 + i], d)};
    }
};

// d at 0, nibbles at 2: value = d * (q - 8)
template <> struct Decode<Type::Q4_0> : Traits<Type::Q4_0> {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b);
        return {GGML_MUL(d, (float)((int)nibble32(b + 2, i) - 8)),
                GGML_MUL(d, (float)((int)nibble32(b + 2, i + 1) - 8))};
    }
};

// d at 0, m at 2, nibbles at 4: value = d * q + m
template <> struct Decode<Type::Q4_1> : Traits<Type::Q4_1> {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b), m = f16_at(b + 2);
        return {GGML_ADD(GGML_MUL(d, (float)nibble32(b + 4, i)), m),
                GGML_ADD(GGML_MUL(d, (float)nibble32(b + 4, i + 1)), m)};
    }
};

// d at 0, fifth bits (u32) at 2, nibbles at 6: value = d * (q - 16)
template <> struct Decode<Type::Q5_0> : Traits<Type::Q5_0> {
    GGML_HD static int q(const uint8_t* b, uint32_t qh, int j) {
        return (int)(nibble32(b + 6, j) | (((qh >> j) & 1u) << 4));
    }
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b);
        const uint32_t qh = load_u32(b + 2);
        return {GGML_MUL(d, (float)(q(b, qh, i) - 16)), GGML_MUL(d, (float)(q(b, qh, i + 1) - 16))};
    }
};

// d at 0, m at 2, fifth bits at 4, nibbles at 8: value = d * q + m
template <> struct Decode<Type::Q5_1> : Traits<Type::Q5_1> {
    GGML_HD static float q(const uint8_t* b, uint32_t qh, int j) {
        return (float)(nibble32(b + 8, j) | (((qh >> j) & 1u) << 4));
    }
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b), m = f16_at(b + 2);
        const uint32_t qh = load_u32(b + 4);
        return {GGML_ADD(GGML_MUL(d, q(b, qh, i)), m), GGML_ADD(GGML_MUL(d, q(b, qh, i + 1)), m)};
    }
};

// d at 0, nibbles at 2 indexing the 16 non-linear levels: value = d * level
template <> struct Decode<Type::IQ4_NL> : Traits<Type::IQ4_NL> {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const float d = f16_at(b);
        return {GGML_MUL(d, (float)GGML_IQ4NL_VALUES[nibble32(b + 2, i)]),
                GGML_MUL(d, (float)GGML_IQ4NL_VALUES[nibble32(b + 2, i + 1)])};
    }
};

// e8m0 exponent at 0, nibbles at 1 indexing the doubled e2m1 values: value = half-scale * v,
// the half scale 2^(e - 128) built from its bits (e < 2: a subnormal float32)
template <> struct Decode<Type::MXFP4> : Traits<Type::MXFP4> {
    GGML_HD static Pair pair(const uint8_t* b, int i) {
        const uint32_t e = b[0];
        const float d = bits_to_f32(e < 2 ? 0x00200000u << e : (e - 1) << 23);
        return {GGML_MUL(d, (float)GGML_MXFP4_VALUES[nibble32(b + 1, i)]),
                GGML_MUL(d, (float)GGML_MXFP4_VALUES[nibble32(b + 1, i + 1)])};
    }
};

}  // namespace ggml
