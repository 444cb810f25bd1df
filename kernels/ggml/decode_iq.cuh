// Decoders of the grid i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.
// Included by decode.cuh. Same contract as decode_legacy.cuh (values i and i + 1, i even, bit
// for bit gguf.quants.dequantize). A grid index picks 8 (IQ2, IQ1) or 4 (IQ3) consecutive
// values from a generated table (tables.cuh), so values i and i + 1 share their grid entry,
// their scale and their sign byte. Signs multiply by +-1 as the reference does (exact).
#pragma once

namespace ggml {

// byte j of a packed grid entry
GGML_HD float grid_byte(uint64_t entry, int j) { return (float)((entry >> (8 * j)) & 0xffu); }

// what the eight values of a grid entry share: the scaled d, the entry (IQ2; IQ3 types look
// theirs up per 4 values in value()) and the sign bits
struct GridScale {
    float db;
    uint64_t entry;
    uint32_t signs;
};

// fp16 d at 0; per 32 values a u32 of four grid bytes and a u32 of four 7-bit sign indices and
// a 4-bit scale (top): value = ((d * (0.5 + scale)) * 0.25) * grid * sign
template <> struct Decode<Type::IQ2_XXS> : Traits<Type::IQ2_XXS>, SubBlock<Decode<Type::IQ2_XXS>> {
    GGML_HD static GridScale scale(const uint8_t* b, int i) {
        const uint8_t* sub = b + 2 + 8 * (i >> 5);
        const uint32_t aux = load_u32(sub + 4);
        const int g = (i >> 3) & 3;
        return {GGML_MUL(GGML_MUL(f16_at(b), GGML_ADD(0.5f, (float)(aux >> 28))), 0.25f),
                GGML_IQ2XXS_GRID[sub[g]], (aux >> (7 * g)) & 127u};
    }
    GGML_HD static float value(const uint8_t*, int j, const GridScale& s) {
        const int l = j & 7;
        return GGML_MUL(GGML_MUL(s.db, grid_byte(s.entry, l)), sign_of(parity_sign(s.signs, l)));
    }
};

// d at 0; per 8 values a u16 at 2 (low 9 bits: grid index, top 7: sign index); 4-bit scales
// per 16 values at 66: value = ((d * (0.5 + scale)) * 0.25) * grid * sign
template <> struct Decode<Type::IQ2_XS> : Traits<Type::IQ2_XS>, SubBlock<Decode<Type::IQ2_XS>> {
    GGML_HD static GridScale scale(const uint8_t* b, int i) {
        const int s = i >> 4;
        const uint32_t sc = (b[66 + (s >> 1)] >> (4 * (s & 1))) & 15u;
        const uint32_t q = load_u16(b + 2 + 2 * (i >> 3));
        return {GGML_MUL(GGML_MUL(f16_at(b), GGML_ADD(0.5f, (float)sc)), 0.25f),
                GGML_IQ2XS_GRID[q & 511u], q >> 9};
    }
    GGML_HD static float value(const uint8_t* b, int j, const GridScale& s) {
        return Decode<Type::IQ2_XXS>::value(b, j, s);
    }
};

// d at 0, low 8 bits of the grid indices at 2, sign bytes at 34, the indices' top 2 bits at 66
// (2 per index), 4-bit scales per 16 values at 74:
// value = ((d * (0.5 + scale)) * 0.25) * grid * sign
template <> struct Decode<Type::IQ2_S> : Traits<Type::IQ2_S>, SubBlock<Decode<Type::IQ2_S>> {
    GGML_HD static GridScale scale(const uint8_t* b, int i) {
        const int s = i >> 4, g = i >> 3;
        const uint32_t sc = (b[74 + (s >> 1)] >> (4 * (s & 1))) & 15u;
        const uint32_t idx = b[2 + g] | (((uint32_t)(b[66 + (g >> 2)] >> (2 * (g & 3))) & 3u) << 8);
        return {GGML_MUL(GGML_MUL(f16_at(b), GGML_ADD(0.5f, (float)sc)), 0.25f),
                GGML_IQ2S_GRID[idx], b[34 + g]};
    }
    GGML_HD static float value(const uint8_t*, int j, const GridScale& s) {
        const int l = j & 7;
        return GGML_MUL(GGML_MUL(s.db, grid_byte(s.entry, l)), sign_of((s.signs >> l) & 1u));
    }
};

// d at 0, grid indices (one per 4 values) at 2, per 32 values a u32 at 66 of four 7-bit sign
// indices and a 4-bit scale (top): value = ((d * (0.5 + scale)) * 0.5) * grid * sign
template <> struct Decode<Type::IQ3_XXS> : Traits<Type::IQ3_XXS>, SubBlock<Decode<Type::IQ3_XXS>> {
    GGML_HD static GridScale scale(const uint8_t* b, int i) {
        const uint32_t aux = load_u32(b + 66 + 4 * (i >> 5));
        return {GGML_MUL(GGML_MUL(f16_at(b), GGML_ADD(0.5f, (float)(aux >> 28))), 0.5f), 0,
                (aux >> (7 * ((i >> 3) & 3))) & 127u};
    }
    GGML_HD static float value(const uint8_t* b, int j, const GridScale& s) {
        const uint32_t entry = GGML_IQ3XXS_GRID[b[2 + (j >> 2)]];
        return GGML_MUL(GGML_MUL(s.db, grid_byte(entry, j & 3)), sign_of(parity_sign(s.signs, j & 7)));
    }
#ifndef STRATA_GGML_HOST
    // The eight values in fp16 arithmetic (decoder.cuh's chunk8_h2). Each float32 value above is
    // exact: d (11 significant bits) times (2 scale + 1) / 4 (5 bits) times the grid byte (at
    // most 62: 6 bits) needs at most 22 bits. So its fp16 rounding is one correctly rounded
    // fp16 product d * m with m = grid * (2 scale + 1) / 4, which fp16 holds exactly (at most
    // 480.5 in steps of 1/4): m is grid / 4 (at most 15.5 in steps of 1/4: exact in fp16) times
    // the integer 2 scale + 1, one exact fp16 product, and the signs flip bits 15 and 31 of
    // each word. The grid sits in the block's shared memory as those fp16 quarters (a warp's 32
    // lookups of random entries: fewer passes than through the L1 cache; two fp16x2 words an
    // entry, so no byte is moved under an exponent); the block's fields are read 16 bits at a
    // time (an even block address). tests/test_iq3_xxs_f16_decode.py checks the argument
    // against gguf in numpy.
    struct Shared {
        uint2 grid[256];  // entry t: its bytes 0, 1 (x) and 2, 3 (y), each / 4, as fp16 pairs
    };
    __device__ static void fill_shared(Shared& s) {
        for (int t = threadIdx.x; t < 256; t += blockDim.x) {
            const uint32_t entry = GGML_IQ3XXS_GRID[t];
            uint32_t w[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const __half2 v = __hmul2(__halves2half2(
                    __uint2half_rn((entry >> (16 * h)) & 0xffu),
                    __uint2half_rn((entry >> (16 * h + 8)) & 0xffu)), __float2half2_rn(0.25f));
                w[h] = *reinterpret_cast<const uint32_t*>(&v);
            }
            s.grid[t] = make_uint2(w[0], w[1]);
        }
    }
    __device__ static void chunk8_h2(const uint8_t* b, int i, unsigned (&out)[4], const Shared& s) {
        const uint8_t* a = b + 66 + 4 * (i >> 5);
        const uint32_t aux = load_aligned<uint16_t>(a) | ((uint32_t)load_aligned<uint16_t>(a + 2) << 16);
        const uint32_t idx = (aux >> (7 * ((i >> 3) & 3))) & 127u;
        const uint32_t pattern = idx | (((uint32_t)__popc(idx) & 1u) << 7);
        const __half2 sc2 = __half2half2(__uint2half_rn((aux >> 27) | 1u));  // 2 scale + 1
        const __half2 d2 = __half2half2(__ushort_as_half(load_aligned<uint16_t>(b)));
        const uint32_t q2 = load_aligned<uint16_t>(b + 2 + (i >> 2));  // the two grid indices
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint2 entry = s.grid[(q2 >> (8 * e)) & 0xffu];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 4 * e + 2 * h;  // the word's first value
                const uint32_t g = h ? entry.y : entry.x;
                const __half2 m = __hmul2_rn(*reinterpret_cast<const __half2*>(&g), sc2);
                // sign bits j, j + 1 of the 8 at bits 15 and 31: the two shifted copies of
                // the 8-bit pattern do not overlap, so one multiply places both
                const uint32_t sign = (pattern * ((1u << (15 - j)) | (1u << (30 - j)))) & 0x80008000u;
                const uint32_t ms = *reinterpret_cast<const uint32_t*>(&m) ^ sign;
                const __half2 w = __hmul2_rn(*reinterpret_cast<const __half2*>(&ms), d2);
                out[2 * e + h] = *reinterpret_cast<const unsigned*>(&w);
            }
        }
    }
#endif
};

// d at 0, low 8 bits of the grid indices at 2, their ninth bits at 66, sign bytes at 74, 4-bit
// scales per 32 values at 106: value = (d * (1 + 2 * scale)) * grid * sign
template <> struct Decode<Type::IQ3_S> : Traits<Type::IQ3_S>, SubBlock<Decode<Type::IQ3_S>> {
    GGML_HD static GridScale scale(const uint8_t* b, int i) {
        const int s = i >> 5;
        const uint32_t sc = (b[106 + (s >> 1)] >> (4 * (s & 1))) & 15u;
        return {GGML_MUL(f16_at(b), (float)(1u + 2u * sc)), 0, b[74 + (i >> 3)]};
    }
    // value l (0..7) of the 8 that share s, from its 4-value grid entry
    GGML_HD static float level(uint32_t entry, int l, const GridScale& s) {
        return GGML_MUL(GGML_MUL(s.db, grid_byte(entry, l & 3)), sign_of((s.signs >> l) & 1u));
    }
    GGML_HD static float value(const uint8_t* b, int j, const GridScale& s) {
        const int gi = j >> 2;
        const uint32_t idx = b[2 + gi] | (((uint32_t)(b[66 + (gi >> 3)] >> (gi & 7)) & 1u) << 8);
        return level(GGML_IQ3S_GRID[idx], j & 7, s);
    }
    // the two entries of values i .. i + 7 from one u16 of low index bits (read a byte at a
    // time: an alignment test costs more than the load it saves) and one ninth-bit byte
    GGML_HD static void chunk8(const uint8_t* b, int i, Pair (&out)[4]) {
        const GridScale s = scale(b, i);
        const uint32_t lo = load_u16(b + 2 + (i >> 2));
        const uint32_t hi = (uint32_t)b[66 + (i >> 5)] >> ((i >> 2) & 7);
        const uint32_t e[2] = {GGML_IQ3S_GRID[(lo & 255u) | ((hi & 1u) << 8)],
                               GGML_IQ3S_GRID[(lo >> 8) | ((hi & 2u) << 7)]};
GGML_UNROLL
        for (int p = 0; p < 4; ++p)
            out[p] = {level(e[p >> 1], 2 * p, s), level(e[p >> 1], 2 * p + 1, s)};
    }
};

// value j of an IQ1 grid entry: -1, 0 or 1
GGML_HD float iq1_grid(uint32_t idx, int j) {
    return (float)((int)((GGML_IQ1_GRID[idx] >> (2 * j)) & 3u) - 1);
}

// what the eight values of an IQ1 grid entry share: the scaled d, the entry index, the delta
struct Iq1Scale {
    float dl;
    uint32_t idx;
    float delta;
};

// d at 0, low 8 bits of the grid indices at 2, per 32 values a u16 at 34 (3 high index bits
// per 8 values, a 3-bit scale at bit 12, the delta's sign at bit 15):
// value = (d * (2 * scale + 1)) * (grid + delta)
template <> struct Decode<Type::IQ1_S> : Traits<Type::IQ1_S>, SubBlock<Decode<Type::IQ1_S>> {
    GGML_HD static Iq1Scale scale(const uint8_t* b, int i) {
        const uint32_t h = load_u16(b + 34 + 2 * (i >> 5));
        const int g = i >> 3;
        return {GGML_MUL(f16_at(b), (float)(2u * ((h >> 12) & 7u) + 1u)),
                b[2 + g] | (((h >> (3 * (g & 3))) & 7u) << 8),
                (h & 0x8000u) ? -GGML_IQ1_DELTA : GGML_IQ1_DELTA};
    }
    GGML_HD static float value(const uint8_t*, int j, const Iq1Scale& s) {
        return GGML_MUL(s.dl, GGML_ADD(iq1_grid(s.idx, j & 7), s.delta));
    }
};

// low 8 bits of the grid indices at 0, per 8 values a nibble at 32 (3 high index bits, the
// delta's sign), four u16 at 48 holding 3-bit scales per 16 values in bits 0..11 and the fp16
// d in their top nibbles (word k: bits 4k..4k+3 of d):
// value = (d * (2 * scale + 1)) * (grid + delta)
template <> struct Decode<Type::IQ1_M> : Traits<Type::IQ1_M>, SubBlock<Decode<Type::IQ1_M>> {
    GGML_HD static Iq1Scale scale(const uint8_t* b, int i) {
        const uint32_t s0 = load_u16(b + 48), s1 = load_u16(b + 50);
        const uint32_t s2 = load_u16(b + 52), s3 = load_u16(b + 54);
        const float d = f16_to_f32((s0 >> 12) | ((s1 >> 8) & 0xf0u) | ((s2 >> 4) & 0xf00u) |
                                   (s3 & 0xf000u));
        const int t = i >> 4, g = i >> 3;
        const uint32_t sc = (load_u16(b + 48 + 2 * (t >> 2)) >> (3 * (t & 3))) & 7u;
        const uint32_t qh = (uint32_t)(b[32 + (g >> 1)] >> (4 * (g & 1)));
        return {GGML_MUL(d, (float)(2u * sc + 1u)), b[g] | ((qh & 7u) << 8),
                (qh & 8u) ? -GGML_IQ1_DELTA : GGML_IQ1_DELTA};
    }
    GGML_HD static float value(const uint8_t* b, int j, const Iq1Scale& s) {
        return Decode<Type::IQ1_S>::value(b, j, s);
    }
};

}  // namespace ggml
