// Batched dequantizing gather for every built-in GGML type: up to 16 experts' matrices of one
// type become fp16 images [position][row][col] in one launch, grid (blocks, experts). One
// kernel per type (ggml_gather_<TYPE>, from traits.cuh's list), each the shared template of
// templates.cuh over the type's decoder (decode.cuh): a type is its decoder and nothing more.
//
// Conventions (templates.cuh): as the IQ3_XXS dequantizing gather (kernels/iq3_xxs/dequant.cu),
// so this can replace the per-format gathers. Values: fp16 (round to nearest even) of the
// float32 value the decoder gives, which equals gguf.quants.dequantize bit for bit.
#include "decode.cuh"
#include "templates.cuh"

#define GGML_GATHER_KERNEL(name, id, qk, nbytes) \
    STRATA_GGML_GATHER(name, ggml::Decode<ggml::Type::name>)
GGML_TYPES(GGML_GATHER_KERNEL)
#undef GGML_GATHER_KERNEL
