"""The CUDA backend's dense part: RMSNorm, the dense projections and the logits (`kernels`),
and dense weights kept in their GGUF types, decoded on the device where used (`decode`)."""
