"""The MoE model: dims (MoESpec), router and norm weights, and every expert as one blob.

Layer math (Qwen3-MoE): xn = RMSNorm(h) * norm; logits = xn @ router.T; p = softmax(logits);
top-k by p (ties -> lower expert id); w = p_topk / sum(p_topk);
y = sum_k w_k * down(silu(gate xn) * up xn); h = h + y. MoE layers have no attention, so every
token (and every chunk) is independent.

`reference_moe_f64` is the plain float64 MoE on the dequantized weights (no quantized
activations), the yardstick every backend is measured against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ConfigError, GGUFError, StrataError
from ..formats.contract import ExpertLayout, QuantFormat
from ..host import host_copy
from ..report.eta import Eta
from .layer_formats import LayerFormats

#: bytes of distinct synthetic blobs generated at most; larger models tile them (see synthetic)
SYNTHETIC_POOL_BYTES = 64 << 20


@dataclass(frozen=True)
class MoESpec:
    n_layers: int
    hidden: int
    ffn: int
    n_experts: int
    top_k: int
    rms_eps: float = 1e-6
    format: str = "iq3_xxs"

    def __post_init__(self) -> None:
        problems = [f"{k}={getattr(self, k)} must be a positive integer"
                    for k in ("n_layers", "hidden", "ffn", "n_experts", "top_k")
                    if not isinstance(getattr(self, k), int) or getattr(self, k) <= 0]
        if not problems and self.top_k > self.n_experts:
            problems.append(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if not self.rms_eps > 0:
            problems.append(f"rms_eps={self.rms_eps} must be > 0")
        if problems:
            raise ConfigError(problems, source="MoESpec")

    @property
    def total_experts(self) -> int:
        return self.n_layers * self.n_experts


#: the small test/demo config and the Qwen3-30B-A3B MoE shape
SMALL_SPEC = MoESpec(n_layers=4, hidden=512, ffn=256, n_experts=32, top_k=4)
QWEN3_30B_SPEC = MoESpec(n_layers=48, hidden=2048, ffn=768, n_experts=128, top_k=8)


def _resolve_format(fmt: QuantFormat | str) -> QuantFormat:
    if isinstance(fmt, QuantFormat):
        return fmt
    from ..formats.registry import registry

    return registry()[fmt]


class ExpertSource(Protocol):
    """Where a model's expert blobs come from: arrays in memory (ArrayExperts) or a GGUF
    file read through its memory map (convert.GGUFExperts)."""

    def blob(self, layer: int, e: int) -> np.ndarray: ...

    def write_layer(self, layer: int, out: np.ndarray) -> None: ...

    def write_layers(self, grid: np.ndarray) -> None: ...

    def layers(self, lo: int, hi: int) -> ExpertSource: ...


class ArrayExperts:
    """Blobs in memory: a full [n_layers, n_experts, blob_bytes] array, or (large synthetic
    models) a pool of distinct blobs that each layer tiles, `index[layer, e]` naming the pool
    entry."""

    def __init__(self, blobs: np.ndarray, index: np.ndarray | None = None):
        self.pool = blobs
        self.index = index

    def full(self) -> np.ndarray:
        """The [n_layers, n_experts, blob_bytes] array (materialised once from a pool)."""
        if self.index is not None:
            self.pool = self.pool[self.index]
            self.index = None
        return self.pool

    def blob(self, layer: int, e: int) -> np.ndarray:
        if self.index is not None:
            return self.pool[self.index[layer, e]]
        return self.pool[layer, e]

    def write_layer(self, layer: int, out: np.ndarray) -> None:
        src = self.pool[self.index[layer]] if self.index is not None else self.pool[layer]
        out[:, : src.shape[-1]] = src

    def write_layers(self, grid: np.ndarray) -> None:
        """Every layer into grid[n_layers, n_experts, >= blob_bytes], rows spread over the
        host threads (host_copy.gather_rows: the bytes a layer-by-layer copy writes), with a
        progress line when it takes a while."""
        L, E = grid.shape[:2]
        if not grid.flags.c_contiguous:
            for layer in range(L):
                self.write_layer(layer, grid[layer])
            return
        eta = Eta("synthetic model: writing experts into the store", L * E, "experts",
                  delay_s=2.0)
        rows = grid.reshape(L * E, grid.shape[2])
        try:
            if self.index is not None:
                host_copy.gather_rows(rows, self.pool, self.index[:L], eta.advance)
            else:
                host_copy.gather_rows(rows, self.pool[:L].reshape(L * E, -1), None, eta.advance)
        finally:
            eta.close()

    def layers(self, lo: int, hi: int) -> ArrayExperts:
        if self.index is not None:
            return ArrayExperts(self.pool, self.index[lo:hi])
        return ArrayExperts(self.pool[lo:hi])


class Model:
    """Weights of an MoE model: dims, router and norm arrays, and the experts' blobs from an
    ExpertSource. Blobs given as an array (`blobs`, optionally tiled by `blob_index`) are
    kept in memory; a model loaded from a GGUF reads them from the file's memory map when the
    store is built (`write_layers`), so the experts are never held twice. `.blobs`
    materialises the full [n_layers, n_experts, blob_bytes] array on first use;
    `expert_blob`, `write_layer` and `write_layers` never do.

    `formats` gives each layer's expert format when they differ (a mixed file); `fmt` is then
    layer 0's, and `layout` the largest layer's, which sizes every slot (blob_bytes above is
    that layout's: a smaller layer's blobs sit at the start of their rows, zero-padded)."""

    def __init__(self, spec: MoESpec, fmt: QuantFormat, router: np.ndarray, norm: np.ndarray,
                 blobs: np.ndarray | None = None, blob_index: np.ndarray | None = None, *,
                 experts: ExpertSource | None = None, formats: LayerFormats | None = None):
        self.spec = spec
        L, E, H = spec.n_layers, spec.n_experts, spec.hidden
        if formats is None:
            formats = LayerFormats.uniform(fmt, L, H, spec.ffn)
        assert len(formats) == L and formats.format(0) is fmt, "formats[0] must be fmt"
        self.fmt = fmt
        self.formats = formats
        self.layout: ExpertLayout = formats.slot_layout
        self.router = np.ascontiguousarray(router, dtype=np.float32)
        self.norm = np.ascontiguousarray(norm, dtype=np.float32)
        assert self.router.shape == (L, E, H), self.router.shape
        assert self.norm.shape == (L, H), self.norm.shape
        if experts is None:
            assert blobs is not None, "give blobs or experts"
            assert blobs.dtype == np.uint8 and blobs.shape[-1] == self.layout.blob_bytes
            if blob_index is None:
                assert blobs.shape == (L, E, self.layout.blob_bytes), blobs.shape
            else:
                assert blob_index.shape == (L, E)
            experts = ArrayExperts(blobs, blob_index)
        self.experts: ExpertSource = experts

    # ------------------------------------------------------------------ access
    @property
    def blobs(self) -> np.ndarray:
        if isinstance(self.experts, ArrayExperts):
            return self.experts.full()
        spec = self.spec
        full = np.zeros((spec.n_layers, spec.n_experts, self.layout.blob_bytes), np.uint8)
        self.experts.write_layers(full)
        self.experts = ArrayExperts(full)
        return full

    def expert_blob(self, layer: int, e: int) -> np.ndarray:
        return self.experts.blob(layer, e)

    def write_layer(self, layer: int, out: np.ndarray) -> None:
        """Copies the layer's blobs into out[n_experts, >= blob_bytes] (the store's arena)."""
        self.experts.write_layer(layer, out)

    def write_layers(self, grid: np.ndarray) -> None:
        """Copies every layer's blobs into grid[n_layers, n_experts, >= blob_bytes] (the
        store's arena); a GGUF source converts the layers of another type on every core."""
        self.experts.write_layers(grid)

    def slice_layers(self, lo: int, hi: int) -> Model:
        """The model made of layers lo..hi-1 (shares the weights): per-layer comparisons."""
        from dataclasses import replace

        spec = replace(self.spec, n_layers=hi - lo)
        formats = self.formats.sliced(lo, hi)
        return Model(spec, formats.format(0), self.router[lo:hi], self.norm[lo:hi],
                     experts=self.experts.layers(lo, hi), formats=formats)

    def dequantized(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [ffn, hidden], up [ffn, hidden], down [hidden, ffn]) float32."""
        return self.formats.format(layer).unpack_expert(self.expert_blob(layer, e),
                                                        self.spec.hidden, self.spec.ffn)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def synthetic(cls, spec: MoESpec, seed: int, fmt: QuantFormat | str | None = None,
                  pool_bytes: int = SYNTHETIC_POOL_BYTES,
                  layer_formats: Sequence[QuantFormat | str] | None = None) -> Model:
        """A seeded random model. Router ~ N(0, 1/hidden) * 2 (logits of a unit-RMS input
        have std ~2, so routing is decisive but varied); norm weights 1 + N(0, 0.1^2);
        experts from `fmt.random_expert`.

        Distinct expert blobs are generated up to `pool_bytes` (at least one per expert of
        the small configs; every expert of a model whose experts fit the pool is distinct).
        A larger model (the Qwen3-30B shape is 11 GB of IQ3_XXS) draws a pool of P distinct
        blobs and tiles it: layer l expert e uses pool[(e + 7*l) % P], so neighbouring layers
        differ and a layer repeats a blob only every P experts.

        `layer_formats` (one per layer) makes a mixed model: every expert distinct, drawn by
        its layer's format (no pool: such models are small test models)."""
        L, E, H = spec.n_layers, spec.n_experts, spec.hidden
        rng = np.random.default_rng(seed)
        router = rng.standard_normal((L, E, H), dtype=np.float32) * np.float32(2.0 / np.sqrt(H))
        norm = (1.0 + 0.1 * rng.standard_normal((L, H))).astype(np.float32)
        if layer_formats is not None:
            if len(layer_formats) != L:
                raise ConfigError(f"{len(layer_formats)} layer formats for {L} layers",
                                  source="MoESpec")
            formats = LayerFormats.of([_resolve_format(f) for f in layer_formats], H, spec.ffn)
            blobs = np.zeros((L, E, formats.slot_layout.blob_bytes), dtype=np.uint8)
            for layer, f in enumerate(formats.formats):
                n = formats.layout(layer).blob_bytes
                for e in range(E):
                    blobs[layer, e, :n] = f.random_expert(rng, H, spec.ffn)
            return cls(spec, formats.format(0), router, norm, blobs, formats=formats)
        fmt = _resolve_format(fmt if fmt is not None else spec.format)
        lay = fmt.layout(spec.hidden, spec.ffn)
        total = L * E
        pool_n = total if total * lay.blob_bytes <= pool_bytes else max(
            1, min(total, pool_bytes // lay.blob_bytes))
        pool = np.empty((pool_n, lay.blob_bytes), dtype=np.uint8)
        for i in range(pool_n):
            pool[i] = fmt.random_expert(rng, H, spec.ffn)
        if pool_n == total:
            return cls(spec, fmt, router, norm, pool.reshape(L, E, lay.blob_bytes))
        index = (np.arange(E)[None, :] + 7 * np.arange(L)[:, None]) % pool_n
        return cls(spec, fmt, router, norm, pool, index)

    @classmethod
    def from_gguf(cls, path: str | Path, fmt: QuantFormat | str | None = None, *,
                  workers: int | None = None) -> Model:
        """Opens a qwen3moe-style GGUF (blk.N.ffn_*_exps, ffn_gate_inp, ffn_norm; <arch>.*
        keys) and checks it: every problem is a GGUFError, NaN/Inf in router and norm
        included. Router and norm are read now; the experts stay in the file until the store
        is built (`write_layers`). `fmt` None: each layer runs the format of its tensors' types
        as stored (weights.gguf_file.gguf_format; a ConfigError says why a file cannot); a format:
        every expert copied raw where the type is the format's own, else converted on
        `workers` processes (default: every core for a large conversion), checked for NaN/Inf
        either way."""
        from .convert import GGUFExperts
        from .gguf_file.gguf_io import open_moe

        moe = open_moe(Path(path))
        formats: LayerFormats | None = None
        if fmt is None:
            from ..formats.registry import registry
            from .gguf_file.gguf_format import file_layer_formats
            from .gguf_file.gguf_io import open_reader

            formats, why = file_layer_formats(open_reader(Path(path)), registry(),
                                              moe.dims["hidden"], moe.dims["ffn"])
            if formats is None:
                raise ConfigError(f"model: no `format` given, and the GGUF {path} cannot "
                                  f"decide it: {why}")
            fmt = formats.format(0)
        fmt = _resolve_format(fmt)
        try:
            spec = MoESpec(format=fmt.name, **moe.dims)
            fmt.layout(spec.hidden, spec.ffn)
        except StrataError as e:
            raise GGUFError(f"{path}: dims from the keys do not fit format {fmt.name}: "
                            f"{e}") from None
        experts = GGUFExperts.open(moe, formats if formats is not None else fmt, workers)
        return cls(spec, fmt, moe.router, moe.norm, experts=experts, formats=experts.formats)


# ---------------------------------------------------------------------- layer math (numpy)
def rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """float32 RMSNorm: h / sqrt(mean(h^2) + eps) * weight (in h's dtype)."""
    dt = h.dtype
    ms = np.mean(np.square(h), axis=-1, keepdims=True, dtype=dt)
    return (h / np.sqrt(ms + dt.type(eps))) * weight.astype(dt)


def route(xn: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax top-k with renormalised weights, in xn's dtype. Returns (ids int32 [T, k] in
    descending probability, ties to the lower id; weights [T, k]).

    The logits use einsum, whose per-element summation order does not depend on how many
    rows there are (BLAS matmul's does): a token routes identically whatever its chunk."""
    logits = np.einsum("th,eh->te", xn, router.astype(xn.dtype))
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    # stable sort of -p keeps the lower id first among equal probabilities
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in x's dtype (exp overflow for very negative x correctly gives -0)."""
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def reference_moe_f64(model: Model, h: np.ndarray,
                      routes: list[np.ndarray] | None = None) -> np.ndarray:
    """The plain MoE in float64 on the dequantized weights, all layers: the yardstick.

    `routes` (top-k ids per layer) imposes another run's expert choice, with the weights
    still computed here: over several layers, float32 and float64 runs drift apart by the
    activation quantization and then pick different experts where two probabilities nearly
    tie, which says nothing about the arithmetic under test."""
    spec = model.spec
    h = np.asarray(h, dtype=np.float64).copy()
    for layer in range(spec.n_layers):
        xn = rms_norm(h, model.norm[layer].astype(np.float64), spec.rms_eps)
        ids, w = route(xn, model.router[layer].astype(np.float64), spec.top_k)
        if routes is not None:
            ids = np.asarray(routes[layer], dtype=np.int64)
            logits = np.einsum("th,eh->te", xn, model.router[layer].astype(np.float64))
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            w = np.take_along_axis(p, ids, axis=-1)
            w = w / w.sum(axis=-1, keepdims=True)
        y = np.zeros_like(h)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            gate, up, down = (m.astype(np.float64) for m in model.dequantized(layer, int(e)))
            x = xn[rows]
            act = silu(x @ gate.T) * (x @ up.T)
            y[rows] += w[rows, slot][:, None] * (act @ down.T)
        h += y
    return h


