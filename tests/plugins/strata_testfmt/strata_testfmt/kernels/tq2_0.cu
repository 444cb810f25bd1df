// TQ2_0, a GGML type strata_rt does not build in, brought by a plugin as one decoder struct: the
// shared templates (strata_rt's kernels/ggml/templates.cuh) instantiate its dequantizing gather,
// its fused grouped GEMMs and its decode-step matrix-vector kernels (ggml_gather_TQ2_0,
// ggml_fused_TQ2_0_<tile>, ggml_fused_at_TQ2_0_<tile>, ggml_gemv_gate_up_TQ2_0,
// ggml_gemv_down_TQ2_0, ggml_gemv_dense_TQ2_0) from the one macro line at the end.
//
// Format (256 values, 66 bytes): 64 bytes of 2-bit codes, then the fp16 scale d at byte 64.
// Value j's code sits in byte (j / 128) * 32 + j % 32 at bits 2 * ((j / 32) % 4); the value is
// d * (code - 1), one float32 multiply as gguf.quants computes it (the product is exact).
#include "ggml/templates.cuh"

struct Tq2_0Decoder {
    static constexpr int block_values = 256;
    static constexpr int block_bytes = 66;

    GGML_HD static float code(const uint8_t* b, int j) {
        const uint32_t q = (b[(j >> 7) * 32 + (j & 31)] >> (2 * ((j >> 5) & 3))) & 3u;
        return (float)((int)q - 1);
    }

    // values i and i + 1 (i even) of the block at b
    GGML_HD static ggml::Pair pair(const uint8_t* b, int i) {
        const float d = ggml::f16_at(b + 64);
        return {GGML_MUL(d, code(b, i)), GGML_MUL(d, code(b, i + 1))};
    }
};

STRATA_GGML_KERNELS(TQ2_0, Tq2_0Decoder)
