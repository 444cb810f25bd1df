// The grouped GEMM that decodes native GGML blocks in its main loop, for every built-in type:
// ggml_fused_<TYPE>_<tile> (weights in a group buffer), ggml_fused_at_<TYPE>_<tile> (each
// position's image read where it lies) and ggml_fused_tab_<TYPE>_<tile> (every expert of a
// layer in one launch, its image through a device table), the shared template of
// templates.cuh over the type's decoder (decode.cuh). Same bytes as ggml_gather_<TYPE>
// (gather.cu) followed by the grouped fp16 GEMM (kernels/common/gemm_f16.cu).
//
// Built one type per module: -DSTRATA_GGML_ONLY=<TYPE> instantiates that type's kernels only
// (the launcher, strata_rt/gemm/ggml_fused.py, compiles a type's module when it is first
// used); without it every type's kernels are built.
#include "decode.cuh"
#include "templates.cuh"

#ifdef STRATA_GGML_ONLY
STRATA_GGML_FUSED(STRATA_GGML_ONLY, ggml::Decode<ggml::Type::STRATA_GGML_ONLY>)
#else
#define GGML_FUSED_KERNELS(name, id, qk, nbytes) \
    STRATA_GGML_FUSED(name, ggml::Decode<ggml::Type::name>)
GGML_TYPES(GGML_FUSED_KERNELS)
#undef GGML_FUSED_KERNELS
#endif
