"""The reference backend's Attention and Logits ops: a whole model's dense part in numpy.

The arithmetic is Qwen3Reference's (strata_rt.models.qwen3.reference, held to Hugging Face
transformers by the golden tests): float32 RMSNorm, einsum projections in a fixed summation
order, per-head q/k norms, RoPE from float64 angles, each query's softmax over exactly its
causal prefix. So a token's result does not depend on its chunk, and the reference engine gives
the same bytes for any chunking. The KV cache is float32 and holds `context` positions; the
engine says where each chunk starts, and every position before it must have been prefilled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...models.qwen3.reference import KVCache, Qwen3Reference, rope_tables
from ...schedule.plan import LogitRows

if TYPE_CHECKING:
    from ...models.qwen3.weights import Qwen3Model


class ReferenceDense:
    """Attention of one layer over (cache + chunk) and the output head, on host arrays."""

    def __init__(self, whole: Qwen3Model, context: int | None = None, first: int = 0):
        #: the first layer this executor runs (a layer split's part starts past 0)
        self.first = first
        self.ref = Qwen3Reference(whole, np.float32)
        self.spec = whole.spec
        self.cache: KVCache = self.ref.new_cache(context)
        #: positions the cache holds at most
        self.kv_capacity = self.cache.max_tokens
        self._tables: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """float32 [T, hidden] embedding rows of token ids, decoded on the host (the bytes
        the engine's host path uploads and the CUDA backend's row gather writes)."""
        return self.ref.model.dense.token_embd.rows(ids).astype(np.float32)

    def _rope(self, start: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of the chunk's positions (computed once per chunk, shared by its layers)."""
        t = self._tables
        if t is None or t[0] != start or t[1] != tokens:
            cos, sin = rope_tables(self.spec, np.arange(start, start + tokens), np.float32)
            t = self._tables = (start, tokens, cos, sin)
        return t[2], t[3]

    def attention(self, layer: int, h: np.ndarray, start: int) -> None:
        """h [T, hidden] += the layer's attention output (after Wo); stores the chunk's keys
        and values at positions start.. of the cache."""
        T = h.shape[0]
        if layer == self.first:
            # positions < start hold what earlier chunks wrote; growing keeps exactly those
            self.cache.length = min(self.cache.length, start)
            self.cache.reserve(start + T)
            self.cache.length = start
        cos, sin = self._rope(start, T)
        h += self.ref.attention(layer, h, self.cache, start, cos, sin)

    def reserve(self, start: int, tokens: int) -> None:
        """Room for a layer pass's positions start..start+tokens before its first chunk: each
        chunk's first-layer Attention grows the cache only up to its own rows, and a growth
        keeps the positions below `length`, which a pass moves chunk by chunk."""
        self.cache.length = min(self.cache.length, start)
        self.cache.reserve(start + tokens)

    def end_chunk(self, start: int, tokens: int) -> None:
        """Marks the chunk's positions as cached (the next chunk's attention reads them)."""
        self.cache.length = start + tokens

    def logits(self, h: np.ndarray, rows: LogitRows) -> np.ndarray:
        """float32 [rows, vocab] over the last row of h or all of them."""
        return self.ref.logits(h[-1:] if rows == "last" else h).astype(np.float32)
