"""Attention on the CUDA backend: the chunk kernels (q/k norms, RoPE, flash attention), the
decode step's split attention, and which head layouts they serve."""
