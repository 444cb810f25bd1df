"""Whole synthetic models whose dense matrices are stored in a chosen GGML type, and the fp16
matrices a host-side fp16 upload of them holds: what the tests of the dense part in its own
type (tests/test_dense_types.py, tests/test_dense_types_gpu.py) compare the device with.

The gguf package quantizes F32, F16, BF16 and Q8_0 but not the K-quants or the i-quants, so
those are drawn as random blocks with small finite fp16 scales (values of the size of trained
projections: a forward pass stays finite), as a downloaded file would hold them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_rt.formats.ggml_blocks import scale_fields, set_scale_fields
from strata_rt.formats.ggml_types import ggml_type
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.models.qwen3.weights import DenseTensor, DenseWeights, LayerWeights

#: the matrices the GPU holds in their type for the dense GEMMs (the embedding is held in its
#: type too, but its rows are gathered by token id, not multiplied: with_embedding sets its type)
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output")
#: the types the gguf package quantizes; the others are drawn as blocks
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0")
#: the dense types of downloaded files the tests cover
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS")


def block_tensor(name: str, shape: tuple[int, int], type_name: str,
                 rng: np.random.Generator) -> DenseTensor:
    """A [rows, cols] tensor of random blocks of `type_name`, every fp16 scale in
    [1e-4, 3e-4)."""
    qt = GGMLQuantizationType[type_name]
    values, nbytes = GGML_QUANT_SIZES[qt]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    blocks = raw.reshape(-1, nbytes)
    t = ggml_type(type_name)
    set_scale_fields(t, blocks, [(1e-4 + 2e-4 * rng.random(len(blocks))).astype(np.float16)
                                 .view(np.uint16) for _ in scale_fields(t, blocks)])
    return DenseTensor(name, shape, qt, raw.reshape(rows, -1))


def _as(t: DenseTensor, type_name: str, rng: np.random.Generator) -> DenseTensor:
    if type_name in QUANTIZABLE:
        return DenseTensor.from_float(t.name, t.f32(), type_name)
    assert len(t.shape) == 2
    return block_tensor(t.name, (int(t.shape[0]), int(t.shape[1])), type_name, rng)


def dense_model(spec: Qwen3Spec, seed: int, layer_types: list[dict[str, str]],
                head: str | None, fmt: str = "fp16", tied: bool = False) -> Qwen3Model:
    """A synthetic model whose layer i stores role r as layer_types[i % len][r] (roles not
    named keep F32) and whose own head is `head` (None: F32); tied: the head is the embedding,
    stored as `head`."""
    base = Qwen3Model.synthetic(spec, seed, fmt, tied=tied)
    rng = np.random.default_rng([seed, 0xD7])
    d = base.dense
    layers = []
    for i, lw in enumerate(d.layers):
        types = layer_types[i % len(layer_types)]
        layers.append(replace(lw, **{r: _as(getattr(lw, r), types[r], rng)
                                     for r in MATRICES if r in types}))
    embd, output = d.token_embd, d.output
    if head is not None:
        if tied:
            embd = _as(embd, head, rng)
        else:
            assert output is not None
            output = _as(output, head, rng)
    return Qwen3Model(spec, DenseWeights(embd, d.output_norm, output, tuple(layers)), base.moe)


def with_embedding(model: Qwen3Model, type_name: str, rng: np.random.Generator) -> Qwen3Model:
    """The model with its token embedding stored as `type_name` (quantized by the gguf package
    where it can, else random blocks; a tied head is the same tensor, so it changes too)."""
    d = model.dense
    return Qwen3Model(model.spec, replace(d, token_embd=_as(d.token_embd, type_name, rng)),
                      model.moe)


def uniform(spec: Qwen3Spec, seed: int, type_name: str, **kw) -> Qwen3Model:
    """Every projection and the head in one type."""
    return dense_model(spec, seed, [dict.fromkeys(MATRICES, type_name)], type_name, **kw)


def fp16_images(lw: LayerWeights) -> tuple[np.ndarray, np.ndarray]:
    """(Wqkv, Wo) as fp16: the dequantized float32 values rounded to fp16, q rows then k rows
    then v rows (what the fp16 dense slot held before the weights kept their types)."""
    wqkv = np.concatenate([lw.attn_q.f32(), lw.attn_k.f32(), lw.attn_v.f32()], axis=0)
    return wqkv.astype(np.float16), lw.attn_output.f32().astype(np.float16)


def as_fp16_model(model: Qwen3Model) -> Qwen3Model:
    """The model with every matrix the GPU holds stored as F16 holding exactly its fp16
    image: the GEMMs read these in place, as they read the fp16 slot and head before."""
    roles = {r: "F16" for r in MATRICES}
    if not model.tied:
        roles["output"] = "F16"
    return model.with_dense_types(roles)


__all__ = ["MATRICES", "TYPES", "as_fp16_model", "block_tensor", "dense_model", "fp16_images",
           "uniform", "with_embedding"]
