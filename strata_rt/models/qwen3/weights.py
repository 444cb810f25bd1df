"""The dense weights of a Qwen3-MoE model, and the whole model (dense weights + MoE experts).

Dense weights are kept as GGUF stores them (DenseTensor: a ggml type and its raw bytes), so a
model read from a downloaded file keeps its Q4_K/Q6_K/Q8_0 attention as it is, a GPU backend
can upload the bytes it likes and the numpy reference dequantizes exactly what the file holds.
The router and ffn_norm of each layer live in the MoE `Model` (strata_rt.weights.model) beside the
experts, as the MoE-only runtime already keeps them.

Roles name a dense weight without its layer: token_embd, output_norm, output (absent = tied to
token_embd), and per layer attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm,
attn_k_norm. Matrices are [out, in] (GGUF lists dimensions innermost first, so it stores them
with ne0 = in); attn_q rows are head-major (head h owns rows h*head_dim .. (h+1)*head_dim - 1)
and are not permuted: Qwen3 rotates the two halves of each head.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError, FormatError
from ...formats.contract import QuantFormat
from ...host.host_copy import run_each
from ...weights.model import Model
from .spec import Qwen3Spec

if TYPE_CHECKING:
    from ...weights.gguf_file.opened_file import TensorBytes

log = logging.getLogger(__name__)

LAYER_ROLES = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
               "attn_k_norm")
GLOBAL_ROLES = ("token_embd", "output_norm", "output")
ROLES = GLOBAL_ROLES + LAYER_ROLES


def resolve_format(fmt: QuantFormat | str) -> QuantFormat:
    """A loaded expert format by name (or the format itself)."""
    if isinstance(fmt, QuantFormat):
        return fmt
    from ...formats.registry import registry

    return registry()[fmt]


def ggml_type(t: Any):
    """A GGMLQuantizationType from a type, its id or its name ("Q8_0", "bf16")."""
    from gguf import GGMLQuantizationType

    if isinstance(t, str):
        try:
            return GGMLQuantizationType[t.upper()]
        except KeyError:
            raise FormatError(f"unknown GGUF tensor type {t!r}; expected one of "
                              f"{', '.join(q.name for q in GGMLQuantizationType)}") from None
    return GGMLQuantizationType(int(t))


@dataclass(frozen=True)
class DenseTensor:
    """One dense weight as GGUF holds it. `data` is float32 [shape] for F32, float16 [shape]
    for F16 and uint8 [rows, row bytes] (the type's blocks) for every other type.

    A tensor read from a GGUF has a `source`: `data` then views the file's memory map, read
    there by what runs while the model opens (the checks, the CUDA uploads) and by whole-model
    helpers (`digest`, writing the model out); `f32` and `rows`, which a run calls after open,
    read the file through `source` (opened_file), so a file cut short since it opened is a
    GGUFChangedError, not SIGBUS."""

    name: str
    shape: tuple[int, ...]
    type: Any  # GGMLQuantizationType
    data: np.ndarray
    source: TensorBytes | None = field(default=None, repr=False, compare=False)

    @property
    def type_name(self) -> str:
        return self.type.name

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def stored(self) -> np.ndarray:
        """`data`'s values: read from the file now for a tensor with a source, else `data`
        itself (no copy)."""
        if self.source is None:
            return self.data
        return self.source.read().view(self.data.dtype).reshape(self.data.shape)

    def f32(self) -> np.ndarray:
        """The float32 values (F32 held in memory: the stored array itself, no copy)."""
        return self._decode(self.stored())

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """float32 rows idx of a matrix, dequantizing only those rows (embedding lookups)."""
        idx = np.asarray(idx)
        if self.source is None:
            return self._decode(self.data[idx])
        row = self.data.shape[1:]
        raw = self.source.rows(idx, self.data.dtype.itemsize * int(np.prod(row)))
        return self._decode(raw.view(self.data.dtype).reshape(*idx.shape, *row))

    def _decode(self, raw: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if self.type == GGMLQuantizationType.F32:
            return np.asarray(raw, dtype=np.float32)
        if self.type == GGMLQuantizationType.F16:
            return np.asarray(raw).astype(np.float32)
        return np.asarray(dequantize(np.asarray(raw), self.type), dtype=np.float32)

    @classmethod
    def from_float(cls, name: str, values: np.ndarray, type_: Any = "F32") -> DenseTensor:
        """Stores float values as `type_` (quantized by the gguf package where it can)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        qt = ggml_type(type_)
        v = np.ascontiguousarray(values, dtype=np.float32)
        if not np.isfinite(v).all():
            raise FormatError(f"{name}: {int((~np.isfinite(v)).sum())} NaN/Inf value(s)")
        if qt == GGMLQuantizationType.F32:
            return cls(name, v.shape, qt, v)
        if qt == GGMLQuantizationType.F16:
            return cls(name, v.shape, qt, v.astype(np.float16))
        from gguf import GGML_QUANT_SIZES

        block = GGML_QUANT_SIZES[qt][0]
        if v.shape[-1] % block:
            raise FormatError(f"{name}: rows of {v.shape[-1]} values do not divide into "
                              f"{qt.name} blocks of {block}")
        try:
            raw = quantize(v, qt)
        except NotImplementedError:
            raise FormatError(f"{name}: the gguf package cannot quantize to {qt.name}; store "
                              "F32, F16, BF16, Q8_0 (or Q4_0/Q4_1/Q5_0/Q5_1), or pass raw "
                              "bytes as DenseTensor(name, shape, type, raw)") from None
        return cls(name, v.shape, qt, raw)


#: a synthetic dense tensor of at least this many values is drawn in row blocks, each from a
#: stream of its own (seeded by the model's seed, the tensor and the block), on the host
#: threads: one sequential stream made opening a large shape wait on one core
DRAWN_IN_BLOCKS = 1 << 24


def normal_blocks(shape: tuple[int, ...], std: float, key: tuple[int, ...],
                  dtype: type[np.floating]) -> np.ndarray:
    """N(0, std^2) values of `shape` as `dtype`, row block b drawn as float32 from
    default_rng([*key, b]) and scaled before the cast, so the values do not depend on the
    threads."""
    out = np.empty(shape, dtype)
    rows = out.reshape(shape[0], -1)
    per = max(1, DRAWN_IN_BLOCKS // 4 // rows.shape[1])

    def draw(block: int) -> None:
        lo = block * per
        part = rows[lo: lo + per]
        v = np.random.default_rng([*key, block]).standard_normal(part.shape, np.float32)
        v *= np.float32(std)
        part[...] = v

    run_each(draw, list(range(-(-shape[0] // per))))
    return out


@dataclass(frozen=True)
class LayerWeights:
    """The dense weights of one layer (router and ffn_norm live with the experts)."""

    attn_norm: DenseTensor    # [hidden]
    attn_q: DenseTensor       # [n_heads * head_dim, hidden]
    attn_k: DenseTensor       # [n_kv_heads * head_dim, hidden]
    attn_v: DenseTensor       # [n_kv_heads * head_dim, hidden]
    attn_output: DenseTensor  # [hidden, n_heads * head_dim]
    attn_q_norm: DenseTensor  # [head_dim]
    attn_k_norm: DenseTensor  # [head_dim]


@dataclass(frozen=True)
class DenseWeights:
    token_embd: DenseTensor          # [vocab, hidden]
    output_norm: DenseTensor         # [hidden]
    output: DenseTensor | None       # [vocab, hidden]; None: tied to token_embd
    layers: tuple[LayerWeights, ...]


def tensor_name(role: str, layer: int | None = None) -> str:
    """The GGUF name of a dense weight (llama.cpp's names)."""
    return f"{role}.weight" if layer is None else f"blk.{layer}.{role}.weight"


def expected_shapes(spec: Qwen3Spec) -> dict[str, tuple[int, ...]]:
    """Logical shape (outermost first) of each role."""
    H, V = spec.hidden, spec.vocab
    return {"token_embd": (V, H), "output_norm": (H,), "output": (V, H), "attn_norm": (H,),
            "attn_q": (spec.q_dim, H), "attn_k": (spec.kv_dim, H), "attn_v": (spec.kv_dim, H),
            "attn_output": (H, spec.q_dim), "attn_q_norm": (spec.head_dim,),
            "attn_k_norm": (spec.head_dim,)}


class Qwen3Model:
    """A whole Qwen3-MoE model: spec, dense weights and the MoE `Model` (router, ffn_norm and
    expert blobs in a registered format)."""

    def __init__(self, spec: Qwen3Spec, dense: DenseWeights, moe: Model):
        self.spec = spec
        self.dense = dense
        self.moe = moe
        #: the tokenizer keys (tokenizer.*, with their GGUF types) of the file the model was
        #: read from, so writing it again keeps its tokenizer; empty for a synthetic model
        self.tokenizer_keys: dict[str, Any] = {}
        want = expected_shapes(spec)
        ms = moe.spec
        if (ms.n_layers, ms.hidden, ms.ffn, ms.n_experts, ms.top_k) != (
                spec.n_layers, spec.hidden, spec.ffn, spec.n_experts, spec.top_k):
            raise ConfigError(f"MoE part {ms} does not match {spec}", source="Qwen3Model")
        if len(dense.layers) != spec.n_layers:
            raise ConfigError(f"{len(dense.layers)} dense layers for n_layers={spec.n_layers}",
                              source="Qwen3Model")
        bad = [f"{t.name}: shape {list(t.shape)}, expected {list(want[role])}"
               for role, t in self.named_roles() if tuple(t.shape) != want[role]]
        if bad:
            raise ConfigError(bad, source="Qwen3Model")

    @property
    def fmt(self) -> QuantFormat:
        return self.moe.fmt

    @property
    def tied(self) -> bool:
        return self.dense.output is None

    @property
    def output_weight(self) -> DenseTensor:
        """The output head: `output`, or the embedding when tied."""
        return self.dense.token_embd if self.dense.output is None else self.dense.output

    def named_roles(self) -> Iterator[tuple[str, DenseTensor]]:
        """(role, tensor) of every dense weight present, globals first, then layer by layer."""
        d = self.dense
        for role in GLOBAL_ROLES:
            t = getattr(d, role)
            if t is not None:
                yield role, t
        for lw in d.layers:
            for f in fields(LayerWeights):
                yield f.name, getattr(lw, f.name)

    def check_file(self, what: str) -> None:
        """GGUFChangedError when the GGUF the model was read from (each shard holding a dense
        weight) changed after it opened, or its path names another file now (`what` names
        what was about to be read from it by path); nothing for a model in memory."""
        files = {id(t.source.file): t.source.file for _, t in self.named_roles()
                 if t.source is not None}
        for file in files.values():
            file.check_path(what)

    def dense_bytes(self) -> int:
        """Bytes of the dense weights as stored (router and norms of the MoE part excluded)."""
        return sum(t.nbytes for _, t in self.named_roles())

    # ------------------------------------------------------------------ conversions
    def with_dense_types(self, types: Mapping[str, Any]) -> Qwen3Model:
        """The same model with the dense weights of the named roles stored as other GGUF types
        (role -> type, e.g. {"attn_q": "Q8_0", "token_embd": "F16"}); values become exactly
        what the new type holds, so the model equals the file it is written to."""
        unknown = sorted(set(types) - set(ROLES))
        if unknown:
            raise ConfigError([f"dense role {r!r} is unknown; roles: {', '.join(ROLES)}"
                               for r in unknown], source="dense types")

        def conv(role: str, t: DenseTensor) -> DenseTensor:
            if role not in types:
                return t
            if ggml_type(types[role]) == t.type:
                return t
            return DenseTensor.from_float(t.name, t.f32(), types[role])

        d = self.dense
        layers = tuple(LayerWeights(**{f.name: conv(f.name, getattr(lw, f.name))
                                       for f in fields(LayerWeights)}) for lw in d.layers)
        output = None if d.output is None else conv("output", d.output)
        dense = DenseWeights(conv("token_embd", d.token_embd), conv("output_norm", d.output_norm),
                             output, layers)
        return Qwen3Model(self.spec, dense, self.moe)

    def digest(self) -> str:
        """SHA-256 over every weight (dense: name, type and bytes; MoE: router, norms, expert
        blobs): equal digests mean equal models, whatever file holds them."""
        h = hashlib.sha256()
        for _, t in sorted(self.named_roles(), key=lambda rt: rt[1].name):
            h.update(f"{t.name}:{t.type_name}:{list(t.shape)}".encode())
            h.update(np.ascontiguousarray(t.data).tobytes())
        h.update(np.ascontiguousarray(self.moe.router).tobytes())
        h.update(np.ascontiguousarray(self.moe.norm).tobytes())
        for layer in range(self.spec.n_layers):
            for e in range(self.spec.n_experts):
                h.update(np.ascontiguousarray(self.moe.expert_blob(layer, e)).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def synthetic(cls, spec: Qwen3Spec, seed: int, fmt: QuantFormat | str = "fp16", *,
                  tied: bool = False, dense_type: Any = "F32",
                  pool_layers: int | None = None) -> Qwen3Model:
        """A seeded random model. Experts, router and ffn_norm from `Model.synthetic(seed)`;
        dense weights from their own stream: embedding ~ N(0, 1/sqrt(hidden)), projections
        ~ N(0, 1/in), norm weights 1 + N(0, 0.1^2), stored as `dense_type` (norms stay F32);
        tensors of DRAWN_IN_BLOCKS values or more are drawn in row blocks on the host threads
        (normal_blocks), the rest from one sequential stream. `pool_layers` draws that many
        distinct dense layers and repeats them (large shapes)."""
        fmt = resolve_format(fmt)
        moe = Model.synthetic(spec.moe_spec(fmt.name), seed, fmt)
        rng = np.random.default_rng([seed, 0x51E3])
        H = spec.hidden
        shapes = expected_shapes(spec)

        big = iter(range(1 << 30))  # the large tensors' keys, in the order they are drawn

        def mat(name: str, role: str, std: float) -> DenseTensor:
            shape = shapes[role]
            if int(np.prod(shape)) < DRAWN_IN_BLOCKS:
                v = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
                return DenseTensor.from_float(name, v, dense_type)
            stored = ggml_type(dense_type)
            plain = stored.name in ("F16", "F32")
            v = normal_blocks(shape, std, (seed, 0x51E3, next(big)),
                              np.float16 if stored.name == "F16" else np.float32)
            return DenseTensor(name, v.shape, stored, v) if plain else \
                DenseTensor.from_float(name, v, dense_type)

        def norm(name: str, role: str) -> DenseTensor:
            return DenseTensor.from_float(
                name, (1.0 + 0.1 * rng.standard_normal(shapes[role])).astype(np.float32))

        embd = mat(tensor_name("token_embd"), "token_embd", H ** -0.25)
        n_distinct = spec.n_layers if pool_layers is None else max(1, min(pool_layers,
                                                                           spec.n_layers))
        distinct = []
        for i in range(n_distinct):
            distinct.append(LayerWeights(
                attn_norm=norm(tensor_name("attn_norm", i), "attn_norm"),
                attn_q=mat(tensor_name("attn_q", i), "attn_q", H ** -0.5),
                attn_k=mat(tensor_name("attn_k", i), "attn_k", H ** -0.5),
                attn_v=mat(tensor_name("attn_v", i), "attn_v", H ** -0.5),
                attn_output=mat(tensor_name("attn_output", i), "attn_output",
                                spec.q_dim ** -0.5),
                attn_q_norm=norm(tensor_name("attn_q_norm", i), "attn_q_norm"),
                attn_k_norm=norm(tensor_name("attn_k_norm", i), "attn_k_norm")))
        layers = tuple(distinct[i] if i < n_distinct else _renamed(distinct[i % n_distinct], i)
                       for i in range(spec.n_layers))
        out_norm = norm(tensor_name("output_norm"), "output_norm")
        output = None if tied else mat(tensor_name("output"), "output", H ** -0.5)
        log.debug("synthetic Qwen3 model: %s, seed %d, %s experts", spec, seed, fmt.name)
        return cls(spec, DenseWeights(embd, out_norm, output, layers), moe)


def _renamed(lw: LayerWeights, layer: int) -> LayerWeights:
    """A pooled layer's tensors under layer `layer`'s names (the arrays are shared)."""
    return LayerWeights(**{f.name: replace(getattr(lw, f.name),
                                           name=tensor_name(f.name, layer))
                           for f in fields(LayerWeights)})
