"""Gathers for native formats: an expert blob is plain byte ranges, so any native format's
gathers are the same two copies, driven only by its ExpertLayout (kernels/common/gather.cu).

A format's launcher class subclasses NativeKernels and adds its MMQ.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .errors import PluginError
from .formats import (
    KERNELS_ROOT,
    MMQ_GROUP,
    ExpertLayout,
    FormatKernels,
    QuantFormat,
    first_misaligned,
)

if TYPE_CHECKING:
    from .runtime import Runtime

GATHER_SOURCE = KERNELS_ROOT / "common" / "gather.cu"
GATHER_THREADS = 256
#: uint4 words one thread copies per pass (GATHER_UNROLL in gather.cu)
GATHER_UNROLL = 4
#: cap on blocks per expert: enough to fill the GPU with one expert, few enough to keep a
#: batch's launch small
GATHER_MAX_BLOCKS = 256


def gather_blocks(nbytes: int) -> int:
    """Blocks along x for a copy of nbytes (16-byte words, GATHER_UNROLL per thread)."""
    words = -(-nbytes // 16)
    return max(1, min(GATHER_MAX_BLOCKS, -(-words // (GATHER_THREADS * GATHER_UNROLL))))


class NativeKernels(FormatKernels):
    """gather and gather_batch for any native format.

    `fallbacks` counts gather_batch calls that could not use the batched kernel (an address or
    size not a multiple of 16) and ran one gather per expert instead; the first such call also
    warns, naming the offending value, so a slow path never goes unnoticed.
    """

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        if not fmt.native:
            raise PluginError(f"format {fmt.name} is not native; NativeKernels copies plain "
                              "byte ranges and cannot gather it")
        mod = runtime.module(GATHER_SOURCE)
        self._one = mod.kernel("gather_one", "PPPqqqq")
        self._batch = mod.kernel("gather_batch", "P" * MMQ_GROUP + "PPqqqqqqi")
        lay = layout
        self._ranges = (lay.gate_up_offset, lay.gate_up_bytes, lay.down_offset, lay.down_bytes)
        self._blocks_one = gather_blocks(lay.gate_up_bytes + lay.down_bytes)
        self._blocks_batch = gather_blocks(max(lay.gate_up_bytes, lay.down_bytes))
        self.fallbacks = 0

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        lay = self.layout
        self._one.launch(
            grid=(self._blocks_one, 1, 1), block=(GATHER_THREADS, 1, 1), stream=stream,
            args=(src, gu_buf + pos * lay.gate_up_image_bytes,
                  down_buf + pos * lay.down_image_bytes, *self._ranges))

    def misaligned(self, srcs: list[int], first_pos: int, gu_buf: int,
                   down_buf: int) -> str | None:
        """Why the batched kernel cannot copy this batch (None when it can)."""
        lay = self.layout
        named = {"gate/up bytes": lay.gate_up_bytes, "down bytes": lay.down_bytes,
                 "gate/up offset": lay.gate_up_offset, "down offset": lay.down_offset,
                 "gate/up image bytes": lay.gate_up_image_bytes,
                 "down image bytes": lay.down_image_bytes,
                 "gate/up buffer": gu_buf + first_pos * lay.gate_up_image_bytes,
                 "down buffer": down_buf + first_pos * lay.down_image_bytes}
        named.update({f"source {i}": src for i, src in enumerate(srcs)})
        return first_misaligned(named)

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        n = len(srcs)
        if not 1 <= n <= MMQ_GROUP or not 0 <= first_pos <= MMQ_GROUP - n:
            raise PluginError(
                f"gather_batch of {n} experts at position {first_pos}: a batch holds 1.."
                f"{MMQ_GROUP} experts and must end by position {MMQ_GROUP - 1}")
        why = self.misaligned(srcs, first_pos, gu_buf, down_buf)
        if why is not None:
            if self.fallbacks == 0:
                warnings.warn(f"{self.fmt.name}: gather_batch falls back to one gather per "
                              f"expert: {why}", RuntimeWarning, stacklevel=2)
            self.fallbacks += 1
            for i, src in enumerate(srcs):
                self.gather(stream, src, first_pos + i, gu_buf, down_buf)
            return
        lay = self.layout
        ptrs = list(srcs) + [0] * (MMQ_GROUP - n)
        self._batch.launch(
            grid=(self._blocks_batch, n, 1), block=(GATHER_THREADS, 1, 1), stream=stream,
            args=(*ptrs, gu_buf, down_buf, *self._ranges, lay.gate_up_image_bytes,
                  lay.down_image_bytes, first_pos))
