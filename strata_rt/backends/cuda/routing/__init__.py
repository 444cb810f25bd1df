"""The CUDA backend's routing: the router GEMM, top-k and counting-sort launchers
(`kernels`), and the exact routing's definition, bound and launchers (`exact`)."""
