"""Launcher of kernels/model/attention_decode.cu: one query row per head (a decode step) over
the KV cache, split across the cache length and merged, so that a one-token step spreads over
the GPU instead of running one block per KV head.

The results are not attend_hd*'s bytes (that kernel rounds probabilities to fp16 for p.v; this
one keeps them in float32); both are within the tested tolerance of the float64 reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ....resources import KERNELS_ROOT
from .shapes import (
    DECODE_SPLITS,
    check_aligned,
    check_attention_shape,
    check_decode_shape,
    decode_part_bytes,
    scale_log2,
)

if TYPE_CHECKING:
    from ....runtime import Runtime, Stream

DECODE_SOURCE = KERNELS_ROOT / "model" / "attention_decode.cu"
#: warps per split block (attention_decode.cu's DEC_WARPS)
DECODE_WARPS = 4


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
        self._split = mod.kernel(f"decode_split_hd{head_dim}_g{self.group}", "PPPPiifP",
                                 overlap=True)
        self._merge = mod.kernel(f"decode_merge_hd{head_dim}", "PifP", overlap=True)
        self.scale_log2 = scale_log2(head_dim)

    def attend(self, stream: Stream, *, q: int, k_cache: int, v_cache: int, start: int,
               part: int, out: int, start_dev: int = 0) -> None:
        """out fp16 [n_heads * hd] = attention of q fp16 [n_heads, hd] at position `start`
        over cache rows 0..start (fp16 [context, n_kv_heads, hd] each); part: part_bytes of
        device scratch. start_dev: a device int32 holding the position (read instead of
        `start`; the caller checks it against the cache), or 0."""
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim, 1, start,
                              self.context)
        check_aligned({"q": q, "k_cache": k_cache, "v_cache": v_cache, "part": part})
        check_aligned({"out": out}, align=4)
        self._split.launch(grid=(self.n_kv_heads, self.splits, 1),
                           block=(32 * DECODE_WARPS, 1, 1), stream=stream,
                           args=(q, k_cache, v_cache, part, start, self.n_kv_heads,
                                 self.scale_log2, start_dev))
        self._merge.launch(grid=(self.n_heads, 1, 1), block=(self.head_dim, 1, 1),
                           stream=stream, args=(part, self.splits, self.scale_log2, out))
