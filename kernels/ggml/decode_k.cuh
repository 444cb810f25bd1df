// Decoders of the 256-value K-quants and IQ4_XS: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS.
// Included by decode.cuh. Same contract as decode_legacy.cuh: values i and i + 1 (i even) of a
// block, bit for bit gguf.quants.dequantize, each operation rounded once in the reference's
// order. Values i and i + 1 share every scale (scales cover 16 or 32 values) and differ only in
// their quant bits.
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

// scales (lo nibble: scale, hi: min) at 0, 2-bit quants at 16, d at 80, dmin at 82:
// value = (d * scale) * q - dmin * min
template <> struct Decode<Type::Q2_K> : Traits<Type::Q2_K>, SubBlock<Decode<Type::Q2_K>> {
    GGML_HD static DM scale(const uint8_t* b, int i) {
        const uint32_t sc = b[i >> 4];
        return {GGML_MUL(f16_at(b + 80), (float)(sc & 15u)), GGML_MUL(f16_at(b + 82), (float)(sc >> 4))};
    }
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        return GGML_SUB(GGML_MUL(s.d, (float)crumb256(b + 16, j)), s.m);
    }
};

// high-bit mask at 0, 2-bit quants at 32, 6-bit scales at 96 (low nibbles in bytes 0..7, top
// 2 bits in bytes 8..11), d at 108: value = (d * (scale - 32)) * (q - (mask bit clear ? 4 : 0))
template <> struct Decode<Type::Q3_K> : Traits<Type::Q3_K>, SubBlock<Decode<Type::Q3_K>> {
    GGML_HD static float scale(const uint8_t* b, int i) {
        const int k = i >> 4;
        const uint32_t lo = (b[96 + (k & 7)] >> (4 * (k >> 3))) & 15u;
        const uint32_t hi = (b[104 + (k & 3)] >> (2 * (k >> 2))) & 3u;
        return GGML_MUL(f16_at(b + 108), (float)((int)(lo | (hi << 4)) - 32));
    }
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        const int high = (int)(((b[j & 31] >> (j >> 5)) & 1u) ^ 1u);
        return GGML_MUL(dl, (float)((int)crumb256(b + 32, j) - 4 * high));
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
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        return GGML_SUB(GGML_MUL(s.d, (float)nibble256(b + 16, j)), s.m);
    }
};

// as Q4_K with a fifth bit: high-bit mask at 16, nibbles at 48
template <> struct Decode<Type::Q5_K> : Traits<Type::Q5_K>, SubBlock<Decode<Type::Q5_K>> {
    GGML_HD static DM scale(const uint8_t* b, int i) { return Decode<Type::Q4_K>::scale(b, i); }
    GGML_HD static float value(const uint8_t* b, int j, DM s) {
        const uint32_t q = nibble256(b + 48, j) | (((b[16 + (j & 31)] >> (j >> 5)) & 1u) << 4);
        return GGML_SUB(GGML_MUL(s.d, (float)q), s.m);
    }
};

// low nibbles at 0 (value j: byte (j/128)*64 + j%64, nibble (j/64)%2), 2-bit highs at 128
// (a 2-bit plane), int8 scales per 16 values at 192, d at 208:
// value = (d * scale) * ((low | high << 4) - 32)
template <> struct Decode<Type::Q6_K> : Traits<Type::Q6_K>, SubBlock<Decode<Type::Q6_K>> {
    GGML_HD static float scale(const uint8_t* b, int i) {
        return GGML_MUL(f16_at(b + 208), (float)(int8_t)b[192 + (i >> 4)]);
    }
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        const uint32_t lo = (b[(j >> 7) * 64 + (j & 63)] >> (4 * ((j >> 6) & 1))) & 15u;
        return GGML_MUL(dl, (float)((int)(lo | (crumb256(b + 128, j) << 4)) - 32));
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
    GGML_HD static float value(const uint8_t* b, int j, float dl) {
        return GGML_MUL(dl, (float)GGML_IQ4NL_VALUES[nibble32(b + 8 + 16 * (j >> 5), j & 31)]);
    }
};

}  // namespace ggml
