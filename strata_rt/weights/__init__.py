"""The MoE model and its expert store, GGUF reading and checks, conversion."""
