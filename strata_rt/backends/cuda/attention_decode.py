"""Launcher of kernels/model/attention_decode.cu: one query row per head (a decode step) over
the KV cache, split across the cache length and merged, so that a one-token step spreads over
the GPU instead of running one block per KV head.

The results are not attend_hd*'s bytes (that kernel rounds probabilities to fp16 for p.v; this
one keeps them in float32); both are within the tested tolerance of the float64 reference.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ...errors import ConfigError
from ...resources import KERNELS_ROOT
from .attention_shapes import (
    DECODE_SPLITS,
    check_attention_shape,
    check_decode_shape,
    decode_part_bytes,
    scale_log2,
)

if TYPE_CHECKING:
    from ...runtime import Runtime, Stream

DECODE_SOURCE = KERNELS_ROOT / "model" / "attention_decode.cu"


def _warps_of(text: str) -> int:
    found = re.search(r"#define DEC_WARPS (\d+)", text)
    if found is None:
        raise ConfigError(f"{DECODE_SOURCE.name}: no DEC_WARPS line", source="GPU attention")
    return int(found.group(1))


#: warps per split block (attention_decode.cu's DEC_WARPS)
DECODE_WARPS = _warps_of(DECODE_SOURCE.read_text())


class DecodeAttention:
    """Prepared launches for one head layout; device addresses in, nothing synchronizes (a
    step's launches can be captured in a graph)."""

    def __init__(self, rt: Runtime, n_heads: int, n_kv_heads: int, head_dim: int,
                 splits: int = DECODE_SPLITS, context: int | None = None):
        check_decode_shape(n_heads, n_kv_heads, head_dim, splits)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.splits, self.context = splits, context
        self.group = n_heads // n_kv_heads
        self.part_bytes = decode_part_bytes(n_heads, head_dim, splits)
        mod = rt.module(DECODE_SOURCE)
        self._split = mod.kernel(f"decode_split_hd{head_dim}_g{self.group}", "PPPPiifP")
        self._merge = mod.kernel(f"decode_merge_hd{head_dim}", "PifP")
        self.scale_log2 = scale_log2(head_dim)

    def attend(self, stream: Stream, *, q: int, k_cache: int, v_cache: int, start: int,
               part: int, out: int, start_dev: int = 0) -> None:
        """out fp16 [n_heads * hd] = attention of q fp16 [n_heads, hd] at position `start`
        over cache rows 0..start (fp16 [context, n_kv_heads, hd] each); part: part_bytes of
        device scratch. start_dev: a device int32 holding the position (read instead of
        `start`; the caller checks it against the cache), or 0."""
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim, 1, start,
                              self.context)
        bad = [f"{n}=0x{p:x}" for n, p in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                            ("part", part)) if p % 16] + \
            ([f"out=0x{out:x} (4-byte aligned)"] if out % 4 else [])
        if bad:
            raise ConfigError([f"{b} is not aligned" for b in bad], source="GPU attention")
        self._split.launch(grid=(self.n_kv_heads, self.splits, 1),
                           block=(32 * DECODE_WARPS, 1, 1), stream=stream,
                           args=(q, k_cache, v_cache, part, start, self.n_kv_heads,
                                 self.scale_log2, start_dev))
        self._merge.launch(grid=(self.n_heads, 1, 1), block=(self.head_dim, 1, 1),
                           stream=stream, args=(part, self.splits, self.scale_log2, out))
