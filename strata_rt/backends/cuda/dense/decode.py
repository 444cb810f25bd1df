"""The fp16 operands of the dense GEMMs, decoded on the GPU from the weights' own GGUF types.

A layer slot and the head keep the file's bytes (strata_rt.models.qwen3.whole_memory); before
a GEMM whose weight is not F16, one GgmlGather launch per tensor (a single-member batch is a
dequantizer of one rows x cols matrix) writes its fp16 image into the dense scratch: q rows,
then k rows, then v rows for Wqkv (exactly the stacked fp16 matrix one GEMM reads), Wo alone,
or a slice of the head's vocabulary rows. An F16 weight is read in place and decodes nothing.
Each value is fp16 (round to nearest even) of gguf.quants.dequantize's float32 value, the
matrix a host-side fp16 upload of the dequantized weights would hold, so the GEMMs see the same
operands whatever type the file stores.

Everything is enqueued on the caller's stream (the compute stream): the scratch is reused by
the next decode only after the GEMM that reads it, in stream order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ....formats.ggml_types import ggml_type
from ....gemm.ggml_gather import GgmlGather
from ....models.qwen3.whole_memory import (
    DIRECT,
    HEAD_SLICE_ROWS,
    DenseLayout,
    DenseSlot,
    tensor_bytes,
)

if TYPE_CHECKING:
    from ....models.qwen3.spec import Qwen3Spec
    from ....runtime import Runtime, Stream


def head_slices(vocab: int, direct: bool) -> list[tuple[int, int]]:
    """(first row, rows) of each head GEMM: the whole vocabulary for an F16 head read in
    place, else slices of at most HEAD_SLICE_ROWS rows."""
    step = vocab if direct else HEAD_SLICE_ROWS
    return [(v0, min(step, vocab - v0)) for v0 in range(0, vocab, step)]


class DenseDecode:
    """Decodes the dense weights of `layout` into the fp16 scratch at `scratch` (device
    address, layout.scratch_bytes long). The gather's kernels for every type the layout
    decodes are loaded here, at open: a type without a decoder fails before any prompt, and
    nothing is loaded inside a captured graph. A model whose dense matrices are all F16 loads
    none."""

    def __init__(self, rt: Runtime, spec: Qwen3Spec, layout: DenseLayout, scratch: int):
        self.spec, self.scratch = spec, scratch
        decoded = {t for s in layout.slots
                   for t in ((s.types.q, s.types.k, s.types.v) if not s.qkv_direct else ())
                   + ((s.types.o,) if not s.o_direct else ())}
        if not layout.head_direct:
            decoded.add(layout.head_type)
        self._gather: GgmlGather | None = None
        if decoded:
            self._gather = GgmlGather(rt)
            for name in sorted(decoded):
                self._gather.kernel(ggml_type(name))

    def _one(self, stream: Stream, type_name: str, src: int, dst: int, rows: int,
             cols: int) -> None:
        assert self._gather is not None, "a decode the layout did not announce"
        self._gather.gather(stream, type_name, [src], dst, rows, cols)

    def wqkv(self, stream: Stream, base: int, slot: DenseSlot) -> int:
        """The fp16 Wqkv [q_dim + 2 kv_dim, hidden] of the slot at `base`: the slot's own
        bytes when q, k, v are F16, else the scratch after decoding into it."""
        if slot.qkv_direct:
            return base + slot.q
        spec, t = self.spec, slot.types
        H, at = spec.hidden, self.scratch
        for type_name, offset, rows in ((t.q, slot.q, spec.q_dim), (t.k, slot.k, spec.kv_dim),
                                        (t.v, slot.v, spec.kv_dim)):
            self._one(stream, type_name, base + offset, at, rows, H)
            at += rows * H * 2
        return self.scratch

    def wo(self, stream: Stream, base: int, slot: DenseSlot) -> int:
        """The fp16 Wo [hidden, q_dim] of the slot at `base` (in place when F16)."""
        if slot.o_direct:
            return base + slot.o
        self._one(stream, slot.types.o, base + slot.o, self.scratch, self.spec.hidden,
                  self.spec.q_dim)
        return self.scratch

    def head_slice(self, stream: Stream, head: int, head_type: str, first: int,
                   rows: int) -> int:
        """The fp16 rows first..first+rows of the head [vocab, hidden] at `head` stored as
        `head_type` (in place when F16)."""
        H = self.spec.hidden
        src = head + tensor_bytes(head_type, first, H)
        if head_type == DIRECT:
            return src
        self._one(stream, head_type, src, self.scratch, rows, H)
        return self.scratch
