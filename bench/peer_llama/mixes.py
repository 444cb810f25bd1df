"""The tensors of the two files both programs run, tensor by tensor, each made only when it is
written (so a 16 GB file never sits in memory).

- `iq3`: the synthetic whole model of configs/qwen3-30b-a3b-whole.yaml as the engine builds it
  (strata_rt.weights.whole_model.load_model: IQ3_XXS experts, F16 dense, seed 1), tensor for
  tensor what strata_rt.models.qwen3.write_qwen3_gguf writes of it (tests check the bytes).
- `q4km`: the type mix llama.cpp's quantizer gives a qwen3moe model for Q4_K_M, filled with
  seeded random valid blocks (strata_rt.formats.ggml_blocks.random_matrix, values of the spread
  the synthetic models use), router and norms drawn as Model.synthetic draws them.

The Q4_K_M rule for qwen3moe (128 experts, head not tied to the embedding), as llama.cpp's
quantizer applies it to a model of L layers: every 2-D and 3-D weight is Q4_K, except
  - output.weight: Q6_K;
  - blk.N.attn_v.weight and blk.N.ffn_down_exps.weight: Q6_K where N "gets more bits", i.e.
    N < L/8, or N >= 7L/8, or (N - L/8) is 2 more than a multiple of 3 (integer eighths); for
    L = 48 that is layers 0-5, 8, 11, ..., 41 and 42-47: 24 of the 48;
  - norms and the router (ffn_gate_inp) stay F32, as the quantizer never touches them.
The expert mix is what strata_rt runs as the down_typed(Q4_K, Q6_K) format on those layers.

Layer tensors are drawn from small pools and tiled (expert e of layer l takes pool entry
(e + 7 l) mod P, as Model.synthetic tiles its blobs; dense matrices repeat every DENSE_POOL
layers), so the file is written in about the time its bytes take to reach the disk.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from strata_rt.formats.ggml_blocks import random_matrix
from strata_rt.formats.ggml_types import BY_NAME
from strata_rt.models.qwen3.spec import Qwen3Spec
from strata_rt.models.qwen3.weights import LAYER_ROLES, expected_shapes, tensor_name
from strata_rt.weights.gguf_file.gguf_io import tensor_names

MIXES = ("iq3", "q4km")
#: distinct expert matrices per (part, type) in the q4km file, at most (64 MiB of blobs in all,
#: as Model.synthetic keeps)
EXPERT_POOL_BYTES = 16 << 20
#: distinct dense layers in the q4km file (layer l takes l mod DENSE_POOL)
DENSE_POOL = 4
#: rows of the embedding and head drawn at a time (bounds the float temporaries)
ROW_CHUNK = 8192
EXPERT_ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_PART = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file: name, logical shape (outermost first), GGUF type and how to make
    its data (float32/float16 values for F32/F16, else uint8 [..., row bytes] blocks)."""

    name: str
    shape: tuple[int, ...]
    type: str
    make: Callable[[], np.ndarray]

    @property
    def row_bytes(self) -> int:
        cols = self.shape[-1]
        if self.type in ("F32", "F16"):
            return cols * (4 if self.type == "F32" else 2)
        return BY_NAME[self.type].row_bytes(cols)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * self.row_bytes


# ---------------------------------------------------------------------- the Q4_K_M rule
def more_bits(layer: int, n_layers: int) -> bool:
    """Whether llama.cpp's K-quant mixes give this layer's tensor more bits (module doc)."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def q4km_type(role: str, layer: int | None, n_layers: int) -> str:
    """The GGUF type Q4_K_M gives a qwen3moe tensor of `role` (module doc)."""
    if role.endswith("_norm") or role == "ffn_gate_inp":
        return "F32"
    if role == "output":
        return "Q6_K"
    if role in ("attn_v", "ffn_down_exps"):
        assert layer is not None
        return "Q6_K" if more_bits(layer, n_layers) else "Q4_K"
    return "Q4_K"


# ---------------------------------------------------------------------- shared pieces
def _rng(seed: int, *key: Any) -> np.random.Generator:
    """A generator of its own for each tensor (or pool entry): any order draws the same."""
    words = [zlib.crc32(str(k).encode()) if isinstance(k, str) else int(k) for k in key]
    return np.random.default_rng([seed, *words])


def _router_norm(spec: Qwen3Spec, seed: int) -> list[PlannedTensor]:
    """Per layer ffn_gate_inp (N(0, (2/sqrt(hidden))^2): decisive, varied routing) and
    ffn_norm (1 + N(0, 0.1^2)), float32, in the order the project's writer puts them."""
    E, H = spec.n_experts, spec.hidden
    out = []
    for layer in range(spec.n_layers):
        names = tensor_names(layer)
        out.append(PlannedTensor(names["router"], (E, H), "F32",
                                 partial(_router, seed, layer, E, H)))
        out.append(PlannedTensor(names["norm"], (H,), "F32",
                                 partial(_norm_values, seed, f"ffn_norm.{layer}", H)))
    return out


def _router(seed: int, layer: int, n_experts: int, hidden: int) -> np.ndarray:
    return (_rng(seed, "router", layer).standard_normal((n_experts, hidden), dtype=np.float32)
            * np.float32(2.0 / np.sqrt(hidden)))


def _norm_values(seed: int, name: str, n: int) -> np.ndarray:
    return (1.0 + 0.1 * _rng(seed, name).standard_normal(n)).astype(np.float32)


def _rows(seed: int, name: str, type_: str, rows: int, cols: int, std: float) -> np.ndarray:
    """A [rows, cols] matrix of random valid blocks, ROW_CHUNK rows at a time."""
    t = BY_NAME[type_]
    out = np.empty((rows, t.row_bytes(cols)), np.uint8)
    for lo in range(0, rows, ROW_CHUNK):
        hi = min(rows, lo + ROW_CHUNK)
        out[lo:hi] = random_matrix(_rng(seed, name, lo), t, hi - lo, cols, std)
    return out


# ---------------------------------------------------------------------- q4km
def q4km_plan(spec: Qwen3Spec, seed: int) -> list[PlannedTensor]:
    """The Q4_K_M file's tensors (module doc), in the project writer's order: router and
    norms, experts layer by layer, then the embedding, output norm, head and dense layers."""
    L, E, H, F = spec.n_layers, spec.n_experts, spec.hidden, spec.ffn
    shapes = expected_shapes(spec)
    plan = _router_norm(spec, seed)
    pools: dict[tuple[str, str], np.ndarray] = {}

    def expert_pool(role: str, type_: str, rows: int, cols: int) -> np.ndarray:
        key = (role, type_)
        if key not in pools:
            t = BY_NAME[type_]
            n = max(1, min(L * E, EXPERT_POOL_BYTES // (rows * t.row_bytes(cols))))
            pools[key] = np.stack([random_matrix(_rng(seed, role, type_, k), t, rows, cols,
                                                 cols ** -0.5) for k in range(n)])
        return pools[key]

    for layer in range(L):
        for role in EXPERT_ROLES:
            type_ = q4km_type(role, layer, L)
            rows, cols = (H, F) if role == "ffn_down_exps" else (F, H)

            def experts(layer: int = layer, role: str = role, type_: str = type_,
                        rows: int = rows, cols: int = cols) -> np.ndarray:
                pool = expert_pool(role, type_, rows, cols)
                return pool[(np.arange(E) + 7 * layer) % len(pool)]

            plan.append(PlannedTensor(tensor_names(layer)[_PART[role]], (E, rows, cols), type_,
                                      experts))
    std = {"token_embd": H ** -0.25, "output": H ** -0.5, "attn_q": H ** -0.5,
           "attn_k": H ** -0.5, "attn_v": H ** -0.5, "attn_output": spec.q_dim ** -0.5}
    for role in ("token_embd", "output_norm", "output"):
        plan.append(_dense(seed, tensor_name(role), role, shapes[role],
                           q4km_type(role, None, L), std.get(role, 0.0)))
    dense_pool: dict[tuple[str, str, int], np.ndarray] = {}
    for layer in range(L):
        for role in LAYER_ROLES:
            type_ = q4km_type(role, layer, L)
            name = tensor_name(role, layer)
            if type_ == "F32":
                plan.append(_dense(seed, name, role, shapes[role], type_, 0.0))
                continue
            rows, cols = shapes[role]

            def matrix(role: str = role, type_: str = type_, rows: int = rows, cols: int = cols,
                       k: int = layer % DENSE_POOL) -> np.ndarray:
                key = (role, type_, k)
                if key not in dense_pool:
                    dense_pool[key] = _rows(seed, f"{role}.{k}", type_, rows, cols, std[role])
                return dense_pool[key]

            plan.append(PlannedTensor(name, (rows, cols), type_, matrix))
    return plan


def _dense(seed: int, name: str, role: str, shape: tuple[int, ...], type_: str,
           std: float) -> PlannedTensor:
    if type_ == "F32":  # norms
        return PlannedTensor(name, shape, type_, partial(_norm_values, seed, name, shape[-1]))
    rows, cols = shape
    return PlannedTensor(name, shape, type_, partial(_rows, seed, name, type_, rows, cols, std))


# ---------------------------------------------------------------------- iq3
def iq3_plan(spec: Qwen3Spec, options: dict[str, Any], seed: int) -> list[PlannedTensor]:
    """The config's synthetic whole model (IQ3_XXS experts, dense as options["dense_type"]),
    built on the first tensor made; each tensor what write_qwen3_gguf writes of it, in its
    order. Needs the model's memory (the 30B shape: 3 GB of F16 dense weights and a 64 MiB
    pool of expert blobs) plus one layer's expert tensors."""
    from strata_rt.models.qwen3.gguf_full import _as_writer_tensor
    from strata_rt.weights.gguf_file.gguf_io import _expert_tensors
    from strata_rt.weights.whole_model import load_model

    held: dict[str, Any] = {}

    def model() -> Any:
        if "model" not in held:
            held["model"] = load_model({"qwen3": spec, "seed": seed, "format": "iq3_xxs",
                                        **options})[1]
        return held["model"]

    def router(layer: int) -> np.ndarray:
        return model().moe.router[layer]

    def norm(layer: int) -> np.ndarray:
        return model().moe.norm[layer]

    def experts(layer: int, part: str) -> np.ndarray:
        if held.get("layer") != layer:  # one layer's three tensors at a time
            one = _expert_tensors(model().moe.slice_layers(layer, layer + 1))
            held["layer"] = layer
            held["experts"] = {p: one[n][0] for p, n in tensor_names(0).items() if n in one}
        return held["experts"][part]

    def dense(name: str) -> np.ndarray:
        for _, t in model().named_roles():
            if t.name == name:
                return _as_writer_tensor(t)[0]
        raise KeyError(name)

    L, E, H, F = spec.n_layers, spec.n_experts, spec.hidden, spec.ffn
    dense_type = str(options.get("dense_type", "F32")).upper()
    plan = []
    for layer in range(L):
        names = tensor_names(layer)
        plan.append(PlannedTensor(names["router"], (E, H), "F32", partial(router, layer)))
        plan.append(PlannedTensor(names["norm"], (H,), "F32", partial(norm, layer)))
    for layer in range(L):
        names = tensor_names(layer)
        for part in ("gate", "up", "down"):
            shape = (E, H, F) if part == "down" else (E, F, H)
            plan.append(PlannedTensor(names[part], shape, "IQ3_XXS",
                                      partial(experts, layer, part)))
    shapes = expected_shapes(spec)
    roles = [r for r in ("token_embd", "output_norm", "output")
             if not (r == "output" and options.get("tied"))]
    named = [(tensor_name(r), r) for r in roles]
    named += [(tensor_name(r, layer), r) for layer in range(L) for r in LAYER_ROLES]
    for name, role in named:
        type_ = "F32" if role.endswith("_norm") else dense_type
        plan.append(PlannedTensor(name, shapes[role], type_, partial(dense, name)))
    return plan


def plan_for(mix: str, spec: Qwen3Spec, options: dict[str, Any], seed: int
             ) -> list[PlannedTensor]:
    if mix == "iq3":
        return iq3_plan(spec, options, seed)
    if mix == "q4km":
        return q4km_plan(spec, seed)
    raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIXES)}")
