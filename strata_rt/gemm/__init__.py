"""The expert GEMMs: grouped fp16 (own kernels and CUTLASS on sm_90), the GEMM that decodes IQ3_XXS
in its main loop, the dequantizing gathers, cuBLAS."""
