"""The names of the two fp16 products every GGML format runs (STRATA_MMQ_KERNEL values), in a
module of their own: the format (formats.ggml_format) and its launchers (gemm.ggml_kernels)
both read them, and the launchers must not import the format module that imports them."""

F16_GEMM = "f16_gemm"
F16_FUSED = "f16_fused"
F16_VARIANTS = (F16_GEMM, F16_FUSED)
