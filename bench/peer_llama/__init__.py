"""Helpers of bench/bench_peer_llama.py: the seeded GGUF files both programs run (files,
mixes), llama.cpp's llama-bench (llama), strata_rt's own runs (strata) and the tables (report)."""
