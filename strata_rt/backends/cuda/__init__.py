"""The CUDA executor and the engine's own kernels: routing, the layer, attention and the dense
part."""
