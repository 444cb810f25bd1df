"""The MoE model and its expert store, per-layer formats and conversion; reading a GGUF file
is gguf_file/."""
