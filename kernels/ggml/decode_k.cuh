// Decoders of the 256-value K-quants and IQ4_XS: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.
// Included by decode.cuh. Same contract as decode_legacy.cuh: values i and i + 1 (i even) of a
// block, bit for bit gguf.quants.dequantize, each operation rounded once in the reference's
// order. Values i and i + 1 share every scale (scales cover 16 or 32 values) and differ only in
// their quant bits.
//
// The gathers decode 8 values at a time (chunk8): values i .. i + 7 (i a multiple of 8) of every
// bit plane below lie in 8 consecutive bytes at one bit position, so each plane is one load8
// (decode_common.cuh) and one shift and mask of two words instead of 8 byte loads and shifts;
// value() and chunk8 then give the same quant to the same level(), so both do the same float
// arithmetic.
//
// Bit layouts, value j of a block (h = j / 128 selects a half, l = j % 32):
//   2-bit planes (Q2_K, Q3_K low bits): byte h*32 + l, bits 2*((j / 32) % 4)
//   4-bit planes (Q4_K, Q5_K): byte (j / 64)*32 + l, nibble (j / 32) % 2
//   high-bit masks (Q3_K, Q5_K): byte l, bit j / 32
#pragma once

namespace ggml {

GGML_HD uint32_t crumb256(const uint8_t* qs, int j) {
    return (qs[(j >> 7) * 32 + (j & 31)] >> (2 * ((j >> 5) & 3))) & 3u;
}

GGML_HD uint32_t nibble256(const uint8_t* qs, int j) {
    return (qs[(j >> 6) * 32 + (j & 31)] >> (4 * ((j >> 5) & 1))) & 15u;
}

// the 6-bit scale and min of sub-block k (0..7) in the 12 packed bytes of Q4_K / Q5_K: bytes
// 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7, bytes 4..7 the same
// for the mins, bytes 8..11 the low 4 bits of scales 4..7 (low nibble) and mins 4..7 (high)
GGML_HD void scale_min_k4(const uint8_t* s, int k, uint32_t& sc, uint32_t& mn) {
    if (k < 4) {
        sc = s[k] & 63u;
        mn = s[k + 4] & 63u;
    } else {
        sc = (s[k + 4] & 15u) | ((s[k - 4] >> 2) & 0x30u);
        mn = (s[k + 4] >> 4) | ((s[k] >> 2) & 0x30u);
    }
}

// a sub-block's factors: value = d * q - m (m = 0 where a type has no min)
struct DM {
    float d, m;
};

// value = d * q - m
GGML_HD float dm_level(uint32_t q, DM s) { return GGML_SUB(GGML_MUL(s.d, (float)q), s.m); }

// values i .. i + 7 of a chunk from their 8 quants (value i + k: byte k of q), each by D::level
template <class D, class S> GGML_HD void pairs8(Bytes8 q, const S& s, Pair (&out)[4]) {
GGML_UNROLL
    for (int p = 0; p < 4; ++p)
        out[p] = {D::level(byte8(q, 2 * p), s), D::level(byte8(q, 2 * p + 1), s)};
}

// the 8 crumbs (2-bit plane) or nibbles (4-bit plane) of values i .. i + 7 (layouts above)
GGML_HD Bytes8 crumbs8(const uint8_t* qs, int i) {
    return field8(load8(qs + (i >> 7) * 32 + (i & 31)), 2 * ((i >> 5) & 3), 3u);
}
GGML_HD Bytes8 nibbles8(const uint8_t* qs, int i) {
    return field8(load8(qs + (i >> 6) * 32 + (i & 31)), 4 * ((i >> 5) & 1), 15u);
}
// the high bits (mask bytes 0..31, bit j / 32) of values i .. i + 7
GGML_HD Bytes8 high_bits8(const uint8_t* mask, int i) {
    return field8(load8(mask + (i & 31)), i >> 5, 1u);
}

// scales (lo nibble: scale, hi: min) at 0, 2-bit quants at 16, d at 80, dmin at 82:
// value = (d * scale) * q - dmin * min
template <> struct Decode<Type::Q2_K> : Traits<Type::Q2_K>, SubBlock<Decode<Type::Q2_K>> {
    GGML_HD static DM scale(const uint8_t* b, int i) {
        const uint32_t sc = b[i >> 4];
        return {GGML_MUL(f16_at(b + 80), (float)(sc & 15u)), GGML_MUL(f16_at(b + 82), (float)(sc >> 4))};
    }
    GGML_HD static float level(uint32_t q, DM s) { return dm_level(q, s); }
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        return level(crumb256(b + 16, j), s);
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        pairs8<Decode>(crumbs8(b + 16, i), scale(b, i), out);
    }
};

// high-bit mask at 0, 2-bit quants at 32, 6-bit scales at 96 (low nibbles in bytes 0..7, top
// 2 bits in bytes 8..11), d at 108: value = (d * (scale - 32)) * (q - (mask bit clear ? 4 : 0)),
// the factor being (q | mask bit << 2) - 4
template <> struct Decode<Type::Q3_K> : Traits<Type::Q3_K>, SubBlock<Decode<Type::Q3_K>> {
    GGML_HD static float scale(const uint8_t* b, int i) {
        const int k = i >> 4;
        const uint32_t lo = (b[96 + (k & 7)] >> (4 * (k >> 3))) & 15u;
        const uint32_t hi = (b[104 + (k & 3)] >> (2 * (k >> 2))) & 3u;
        return GGML_MUL(f16_at(b + 108), (float)((int)(lo | (hi << 4)) - 32));
    }
    // u: q | mask bit << 2
    GGML_HD static float level(uint32_t u, float dl) { return GGML_MUL(dl, (float)((int)u - 4)); }
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        return level(crumb256(b + 32, j) | (((b[j & 31] >> (j >> 5)) & 1u) << 2), dl);
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        pairs8<Decode>(merge8(crumbs8(b + 32, i), high_bits8(b, i), 2), scale(b, i), out);
    }
};

// d at 0, dmin at 2, packed scales/mins at 4, nibbles at 16:
// value = (d * scale) * q - dmin * min
template <> struct Decode<Type::Q4_K> : Traits<Type::Q4_K>, SubBlock<Decode<Type::Q4_K>> {
    GGML_HD static DM scale(const uint8_t* b, int i) {
        uint32_t sc, mn;
        scale_min_k4(b + 4, i >> 5, sc, mn);
        return {GGML_MUL(f16_at(b), (float)sc), GGML_MUL(f16_at(b + 2), (float)mn)};
    }
    GGML_HD static float level(uint32_t q, DM s) { return dm_level(q, s); }
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        return level(nibble256(b + 16, j), s);
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        pairs8<Decode>(nibbles8(b + 16, i), scale(b, i), out);
    }
};

// as Q4_K with a fifth bit: high-bit mask at 16, nibbles at 48
template <> struct Decode<Type::Q5_K> : Traits<Type::Q5_K>, SubBlock<Decode<Type::Q5_K>> {
    GGML_HD static DM scale(const uint8_t* b, int i) { return Decode<Type::Q4_K>::scale(b, i); }
    GGML_HD static float level(uint32_t q, DM s) { return dm_level(q, s); }
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        return level(nibble256(b + 48, j) | (((b[16 + (j & 31)] >> (j >> 5)) & 1u) << 4), s);
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        pairs8<Decode>(merge8(nibbles8(b + 48, i), high_bits8(b + 16, i), 4), scale(b, i), out);
    }
};

// low nibbles at 0 (value j: byte (j/128)*64 + j%64, nibble (j/64)%2), 2-bit highs at 128
// (a 2-bit plane), int8 scales per 16 values at 192, d at 208:
// value = (d * scale) * ((low | high << 4) - 32)
template <> struct Decode<Type::Q6_K> : Traits<Type::Q6_K>, SubBlock<Decode<Type::Q6_K>> {
    GGML_HD static float scale(const uint8_t* b, int i) {
        return GGML_MUL(f16_at(b + 208), (float)(int8_t)b[192 + (i >> 4)]);
    }
    // u: low | high << 4
    GGML_HD static float level(uint32_t u, float dl) { return GGML_MUL(dl, (float)((int)u - 32)); }
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        const uint32_t lo = (b[(j >> 7) * 64 + (j & 63)] >> (4 * ((j >> 6) & 1))) & 15u;
        return level(lo | (crumb256(b + 128, j) << 4), dl);
    }
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        const Bytes8 lo = field8(load8(b + (i >> 7) * 64 + (i & 63)), 4 * ((i >> 6) & 1), 15u);
        pairs8<Decode>(merge8(lo, crumbs8(b + 128, i), 4), scale(b, i), out);
    }
};

// d at 0, top 2 bits of the 8 scales (u16) at 2, their low nibbles at 4, nibbles at 8 (sub-block
// s: bytes 8 + 16s.., value l of it in nibble l / 16 of byte l % 16) indexing the IQ4_NL
// levels: value = (d * (scale - 32)) * level
template <> struct Decode<Type::IQ4_XS> : Traits<Type::IQ4_XS>, SubBlock<Decode<Type::IQ4_XS>> {
    GGML_HD static float scale(const uint8_t* b, int i) {
        const int s = i >> 5;
        const uint32_t lo = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 15u;
        const uint32_t hi = (load_u16(b + 2) >> (2 * s)) & 3u;
        return GGML_MUL(f16_at(b), (float)((int)(lo | (hi << 4)) - 32));
    }
    GGML_HD static float level(uint32_t q, float dl) {
        return GGML_MUL(dl, (float)GGML_IQ4NL_VALUES[q]);
    }
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        return level(nibble32(b + 8 + 16 * (j >> 5), j & 31), dl);
    }
    // values i .. i + 7 of sub-block i / 32: one nibble of bytes (i % 16) .. + 7 of its 16
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        const Bytes8 q = field8(load8(b + 8 + 16 * (i >> 5) + (i & 15)), 4 * ((i >> 4) & 1), 15u);
        pairs8<Decode>(q, scale(b, i), out);
    }
};

}  // namespace ggml
