"""The whole Qwen3-MoE forward pass in numpy: the yardstick for the GPU backend.

Computes what Hugging Face transformers' Qwen3MoeForCausalLM computes (the parity tests hold
it to transformers' logits): embedding; per layer x = RMSNorm(h) * attn_norm; q, k, v = x Wq,
x Wk, x Wv; per-head RMSNorm of q and k (over head_dim, before RoPE); RoPE rotating the two
halves of each head (NEOX), frequencies theta^(-2i/head_dim) at absolute positions; causal
grouped-query attention (query head j reads key/value head j // group), scale head_dim^-0.5,
softmax in the compute dtype; h += attn Wo; then the MoE block (RMSNorm * ffn_norm, softmax over
all experts, top-k with ties to the lower id, weights renormalised, SwiGLU experts on the
dequantized weights) and h += moe; finally RMSNorm * output_norm and the output head.

Chunking is exact: a prompt prefilled in one chunk or in several gives identical bytes. Every
product is an einsum (its per-element summation order does not depend on how many rows there
are; BLAS matmul's does), each query's softmax runs over exactly its own causal prefix (never
over masked padding, which would change the summation), RoPE angles depend only on the
absolute position, and the KV cache keeps what a longer chunk would have computed.

The per-head RMSNorms of queries and keys refuse an input that holds NaN or infinity or whose
mean square overflows (NonFiniteError naming the layer and the row), as the backends' norms do:
such a head would otherwise normalise to zeros and attend uniformly, silently.

float32 is the default; float64 runs the same code in double precision for checks. The
reference keeps float copies of the weights it touches, so it is for small models.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ...backends.cuda.routing.exact import route_exact
from ...backends.nonfinite import NonFiniteError, check_rms_input
from ...config.run.prompts import check_token_ids
from ...errors import BudgetError, ConfigError
from ...weights.model import Model, rms_norm, route, silu
from .spec import Qwen3Spec
from .weights import DenseTensor, Qwen3Model


class KVCache:
    """Keys (after q/k norm and RoPE) and values of every layer for the positions prefilled so
    far, in the reference's dtype. `length` is the next position; at most `max_tokens`."""

    def __init__(self, spec: Qwen3Spec, dtype: npt.DTypeLike = np.float32,
                 max_tokens: int | None = None):
        self.spec = spec
        self.dtype = np.dtype(dtype)
        self.max_tokens = spec.context if max_tokens is None else int(max_tokens)
        self.length = 0
        self._cap = 0
        shape = (spec.n_layers, 0, spec.n_kv_heads, spec.head_dim)
        self._k = np.zeros(shape, self.dtype)
        self._v = np.zeros(shape, self.dtype)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in all (grows geometrically, keeps what is cached)."""
        if tokens > self.max_tokens:
            raise BudgetError(f"the KV cache holds at most {self.max_tokens} tokens (context "
                              f"length); {self.length} are cached and {tokens - self.length} "
                              f"more were asked for")
        if tokens <= self._cap:
            return
        cap = min(self.max_tokens, max(tokens, 2 * self._cap, 256))
        s = self.spec
        for attr in ("_k", "_v"):
            new = np.zeros((s.n_layers, cap, s.n_kv_heads, s.head_dim), self.dtype)
            new[:, : self.length] = getattr(self, attr)[:, : self.length]
            setattr(self, attr, new)
        self._cap = cap

    def keys(self, layer: int, end: int | None = None) -> np.ndarray:
        """[positions, n_kv_heads, head_dim] of `layer` up to `end` (default: length)."""
        return self._k[layer, : self.length if end is None else end]

    def values(self, layer: int, end: int | None = None) -> np.ndarray:
        return self._v[layer, : self.length if end is None else end]

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Stores keys and values of positions start.. (reserve first; `length` is the
        caller's to advance once every layer holds them)."""
        self._k[layer, start: start + len(k)] = k
        self._v[layer, start: start + len(v)] = v

    def truncate(self, length: int) -> None:
        """Forgets every position from `length` on (a later prefill overwrites them)."""
        if not 0 <= length <= self.length:
            raise ConfigError(f"truncate to {length}: the cache holds {self.length} positions",
                              source="KV cache")
        self.length = length


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in] times w [out, in] transposed, row by row in a fixed summation order."""
    return np.einsum("ti,oi->to", x, w)


def rope_tables(spec: Qwen3Spec, positions: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, head_dim/2] of the absolute positions: angles in float64, then rounded
    to `dtype` (a position's values never depend on its chunk)."""
    ang = np.asarray(positions, dtype=np.float64)[:, None] * spec.rope_inv_freq()[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotates the halves of each head: x [T, heads, d] -> (x1 cos - x2 sin, x2 cos + x1 sin)
    with x1, x2 the first and second halves (transformers' rotate_half, llama.cpp's NEOX)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def moe_block(moe: Model, layer: int, h: np.ndarray, experts: dict | None = None) -> np.ndarray:
    """The MoE output (without the residual) of `layer` for residual rows h, in h's dtype:
    RMSNorm * ffn_norm, route (softmax, top-k, renormalised), SwiGLU experts on the
    dequantized weights, summed per token in ascending expert id. `experts` caches the
    dequantized weights across calls ((layer, e) -> (gate, up, down) in h's dtype)."""
    dt = h.dtype
    spec = moe.spec
    xn = rms_norm(h, moe.norm[layer], spec.rms_eps)
    # float32 runs route as the engine does (the canonical picks); float64 is a yardstick
    ids, w = (route_exact(xn, moe.router[layer], spec.top_k) if dt == np.float32
              else route(xn, moe.router[layer].astype(dt), spec.top_k))
    y = np.zeros_like(h)
    cache = {} if experts is None else experts
    for e in np.unique(ids):
        key = (layer, int(e))
        if key not in cache:
            cache[key] = tuple(m.astype(dt) for m in moe.dequantized(layer, int(e)))
        gate, up, down = cache[key]
        rows, slot = np.nonzero(ids == e)
        x = xn[rows]
        act = silu(mm(x, gate)) * mm(x, up)
        y[rows] += w[rows, slot][:, None] * mm(act, down)
    return y


class Qwen3Reference:
    """Runs a Qwen3Model on the CPU. `prefill(ids, cache)` appends the tokens to the cache
    and returns the logits of the last position ([vocab]) or of every position of the chunk
    ([tokens, vocab]) in the reference's dtype."""

    def __init__(self, model: Qwen3Model, dtype: type = np.float32):
        self.model = model
        self.spec = model.spec
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ConfigError(f"dtype {self.dtype} is not float32 or float64",
                              source="Qwen3Reference")
        self._w: dict[str, np.ndarray] = {}
        self._experts: dict = {}

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return KVCache(self.spec, self.dtype, max_tokens)

    def _f(self, t: DenseTensor) -> np.ndarray:
        a = self._w.get(t.name)
        if a is None:
            a = self._w[t.name] = t.f32().astype(self.dtype)
        return a

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.model.dense.token_embd.rows(ids).astype(self.dtype)

    def prefill(self, token_ids, cache: KVCache | None = None, *,
                all_logits: bool = False) -> np.ndarray:
        """Runs the tokens at positions cache.length.. and appends their keys and values to
        `cache` (a new one when None). Returns the last position's logits, or every
        position's with all_logits=True."""
        ids = check_token_ids(token_ids, self.spec.vocab, source="prompt")
        cache = self.new_cache() if cache is None else cache
        if cache.dtype != self.dtype or cache.spec != self.spec:
            raise ConfigError("the KV cache was made for another model or dtype",
                              source="Qwen3Reference")
        start, T = cache.length, len(ids)
        cache.reserve(start + T)
        h = self.embed(ids)
        cos, sin = rope_tables(self.spec, np.arange(start, start + T), self.dtype)
        try:
            for layer in range(self.spec.n_layers):
                h = h + self.attention(layer, h, cache, start, cos, sin)
                h = h + moe_block(self.model.moe, layer, h, self._experts)
        except NonFiniteError as e:  # rows of this call -> positions in the cache
            raise e.shifted(start) from None
        cache.length = start + T
        if all_logits:
            return self.logits(h)
        return self.logits(h[-1:])[0]

    def attention(self, layer: int, h: np.ndarray, cache: KVCache, start: int,
                  cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Self-attention output (after Wo) of the chunk h at positions start.., storing its
        keys and values in `cache`."""
        lw = self.model.dense.layers[layer]
        x = rms_norm(h, self._f(lw.attn_norm), self.spec.rms_eps)
        q, k, v = self.qkv(layer, x, cos, sin)
        cache.write(layer, start, k, v)
        end = start + len(h)
        out = self.attend(q, cache.keys(layer, end), cache.values(layer, end), start)
        return mm(out.reshape(len(h), self.spec.q_dim), self._f(lw.attn_output))

    def qkv(self, layer: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """Projections of the normed rows x: q [T, n_heads, hd] and k [T, n_kv_heads, hd]
        after the per-head RMSNorm and then RoPE; v [T, n_kv_heads, hd]."""
        s, lw = self.spec, self.model.dense.layers[layer]
        T = len(x)
        q = mm(x, self._f(lw.attn_q)).reshape(T, s.n_heads, s.head_dim)
        k = mm(x, self._f(lw.attn_k)).reshape(T, s.n_kv_heads, s.head_dim)
        v = mm(x, self._f(lw.attn_v)).reshape(T, s.n_kv_heads, s.head_dim)
        heads = np.arange(T)
        check_rms_input(q.reshape(-1, s.head_dim), "the RMSNorm of the queries", layer,
                        np.repeat(heads, s.n_heads))
        check_rms_input(k.reshape(-1, s.head_dim), "the RMSNorm of the keys", layer,
                        np.repeat(heads, s.n_kv_heads))
        q = apply_rope(rms_norm(q, self._f(lw.attn_q_norm), s.rms_eps), cos, sin)
        k = apply_rope(rms_norm(k, self._f(lw.attn_k_norm), s.rms_eps), cos, sin)
        return q, k, v

    def attend(self, q: np.ndarray, keys: np.ndarray, vals: np.ndarray,
               start: int) -> np.ndarray:
        """Causal grouped-query attention of queries q [T, n_heads, hd] at positions start..
        over keys/values [start + T, n_kv_heads, hd]; query head j reads key/value head
        j // group. Returns [T, n_heads, hd]. Each query's softmax covers exactly its own
        prefix, so the result does not depend on how the prompt was chunked."""
        s, dt = self.spec, self.dtype
        T, hd = len(q), s.head_dim
        qg = q.reshape(T, s.n_kv_heads, s.group, hd)
        scale = dt.type(hd ** -0.5)
        out = np.empty((T, s.n_kv_heads, s.group, hd), dt)
        for t in range(T):
            n = start + t + 1  # this query's causal prefix
            sc = np.einsum("kgd,skd->kgs", qg[t], keys[:n]) * scale
            p = np.exp(sc - sc.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[t] = np.einsum("kgs,skd->kgd", p, vals[:n])
        return out.reshape(T, s.n_heads, hd)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Final RMSNorm and output head over the residual rows h -> [rows, vocab]."""
        d = self.model.dense
        x = rms_norm(h, self._f(d.output_norm), self.spec.rms_eps)
        return mm(x, self._f(self.model.output_weight))
