// The decode step's matrix-vector products over a layer's routed experts, for every built-in
// type: ggml_gemv_gate_up_<TYPE> and ggml_gemv_down_<TYPE>, the shared template of gemv.cuh over
// the type's decoder (decode.cuh). A layer whose down projections are of another type than its
// gate and up launches the two kernels of two types.
//
// Built one type per module: -DSTRATA_GGML_ONLY=<TYPE> instantiates that type's kernels only
// (the launcher, strata_rt/gemm/ggml_gemv.py, compiles a type's module when it is first used);
// without it every type's kernels are built.
#include "decode.cuh"
#include "gemv.cuh"

#ifdef STRATA_GGML_ONLY
STRATA_GGML_GEMV(STRATA_GGML_ONLY, ggml::Decode<ggml::Type::STRATA_GGML_ONLY>)
#else
#define GGML_GEMV_KERNELS(name, id, qk, nbytes) \
    STRATA_GGML_GEMV(name, ggml::Decode<ggml::Type::name>)
GGML_TYPES(GGML_GEMV_KERNELS)
#undef GGML_GEMV_KERNELS
#endif
