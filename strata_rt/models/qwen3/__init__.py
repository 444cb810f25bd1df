"""The whole Qwen3-MoE model: dimensions (spec), dense weights (weights), whole-model GGUF
files (gguf_full) and the numpy forward pass with its KV cache (reference).

    model = read_qwen3_gguf("model.gguf", "iq3_xxs")      # or Qwen3Model.synthetic(spec, seed)
    ref = Qwen3Reference(model)                            # float32; float64 for checks
    cache = ref.new_cache()
    last = ref.prefill(ids[:700], cache)                   # logits [vocab] of position 699
    every = ref.prefill(ids[700:], cache, all_logits=True) # [tokens, vocab], same bytes as one chunk
"""

from .gguf_full import read_qwen3_gguf, read_qwen3_spec, spec_keys, write_qwen3_gguf
from .reference import KVCache, Qwen3Reference, moe_block
from .spec import QWEN3_30B_A3B, QWEN3_235B_A22B, TINY_SPEC, Qwen3Spec
from .weights import DenseTensor, DenseWeights, LayerWeights, Qwen3Model

__all__ = ["DenseTensor", "DenseWeights", "KVCache", "LayerWeights", "QWEN3_235B_A22B",
           "QWEN3_30B_A3B", "Qwen3Model", "Qwen3Reference", "Qwen3Spec", "TINY_SPEC",
           "moe_block", "read_qwen3_gguf", "read_qwen3_spec", "spec_keys", "write_qwen3_gguf"]
