"""Launcher of the batched dequantizing gather for every GGML type (kernels/ggml/gather.cu), or
for a plugin's own decoders (its .cu instantiating kernels/ggml/templates.cuh; see
GgmlGather's `source` and `decoders`).

One launch turns up to 16 experts' matrices of one GGML type (each `rows` x `cols` values,
stored as whole blocks, row after row) into fp16 images [position][row][col]: the conventions
of the IQ3_XXS dequantizing gather (GroupedGemm.dequant_gather_iq3), so a format built on the
GGML decoders can gather with it. A gate/up image of a file whose gate and up tensors are
separate is two launches: gate rows at the image's start, up rows `ffn * hidden * 2` bytes in,
both with the image's stride.

Numerics: each value is fp16 (round to nearest even) of gguf.quants.dequantize's float32
value, bit for bit (`images_reference` is the numpy twin the GPU test compares with).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from ..formats.contract import MMQ_GROUP, first_misaligned
from ..formats.ggml_types import TYPES, GgmlType, ggml_type
from ..resources import KERNELS_ROOT
from .ggml_decoders import DecoderModule, DecoderSpec, GgmlKey

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

    from ..runtime import Runtime

GATHER_SOURCE = KERNELS_ROOT / "ggml" / "gather.cu"
#: the gather's body, whose #defines below are the one source of its block and step sizes
GATHER_BODY = KERNELS_ROOT / "ggml" / "gather_run.cuh"
#: argument types: 16 source addresses, dst, image bytes, values, first_pos, bounds,
#: first_expert
GATHER_ARG_TYPES = "P" * MMQ_GROUP + "PqqiPi"


def _define(name: str) -> int:
    found = re.search(rf"^#define {name} (\d+)$", GATHER_BODY.read_text(), re.MULTILINE)
    if found is None:
        raise FormatError(f"{GATHER_BODY.name}: no #define {name}")
    return int(found.group(1))


GATHER_THREADS = _define("GGML_GATHER_THREADS")
#: bytes of source a warp aims to stage per step
GATHER_STEP_BYTES = _define("GGML_GATHER_STEP_BYTES")
#: fp16 values one thread writes per group (one 16-byte store)
GATHER_VALUES = 8
#: values of a group: 32 lanes x 8
GROUP_VALUES = 256
#: CUDA blocks one launch aims for, spread over its experts
GATHER_TARGET_BLOCKS = 2048


def groups_per_step(t: GgmlType | DecoderSpec) -> int:
    """256-value groups a warp stages and decodes per step (GatherStep::GROUPS)."""
    span = GROUP_VALUES // t.block_values * t.block_bytes
    return max(1, min(8, GATHER_STEP_BYTES // span))


def gather_blocks(t: GgmlType | DecoderSpec, values: int, members: int) -> int:
    """CUDA blocks along x of one launch: enough for one step per warp over a member's groups,
    at most GATHER_TARGET_BLOCKS over the launch's members."""
    groups = -(-values // GROUP_VALUES)
    warps = GATHER_THREADS // 32
    return max(1, min(-(-GATHER_TARGET_BLOCKS // members),
                      -(-groups // (warps * groups_per_step(t)))))


def image_bytes(rows: int, cols: int) -> int:
    """Bytes of one fp16 image of rows x cols values."""
    return 2 * rows * cols


def check_geometry(t: GgmlType | DecoderSpec, rows: int, cols: int) -> int:
    """The values of one expert's matrix; FormatError unless rows x cols is whole blocks per
    row and whole 8-value steps."""
    t.row_bytes(cols)  # whole blocks per row
    values = rows * cols
    if rows <= 0 or values % GATHER_VALUES:
        raise FormatError(f"{t.name} gather of {rows} x {cols}: the gather writes "
                          f"{GATHER_VALUES} values per step, so rows * cols must be a positive "
                          f"multiple of {GATHER_VALUES}")
    return values


class GgmlGather(DecoderModule):
    """The dequantizing gathers of every built-in GGML type, from one module loaded at once.
    With `source` (a plugin's .cu) and `decoders` (the specs of its STRATA_GGML_KERNELS
    lines): that module's gathers, named by the specs (or passed as them)."""

    def __init__(self, runtime: Runtime, *, source: str | Path | None = None,
                 decoders: Iterable[DecoderSpec] = ()):
        super().__init__(runtime, "GgmlGather", GATHER_SOURCE, source=source,
                         decoders=decoders)
        self._kernels: dict[str, Any] = {}

    def kernel(self, t: GgmlType | DecoderSpec) -> Any:
        if t.name not in self._kernels:
            self._kernels[t.name] = self.module_of(t.name).kernel(f"ggml_gather_{t.name}",
                                                                  GATHER_ARG_TYPES)
        return self._kernels[t.name]

    def gather(self, stream: Any, gtype: GgmlKey, srcs: Sequence[int], dst: int, rows: int,
               cols: int, *, first_pos: int = 0, image_stride: int | None = None,
               bounds: int = 0, first_expert: int = 0) -> None:
        """One launch: member i's blocks at srcs[i] (a device address; 0 skips the member,
        leaving its image as it was) become the fp16 image at dst + (first_pos + i) *
        image_stride (default: the image's own bytes). bounds (a layer's device row offsets;
        0: none) skips a member whose expert first_expert + i has no rows, as the routed
        gathers do (FormatKernels.gather_routed)."""
        t = self.decoder(gtype)
        values = check_geometry(t, rows, cols)
        n = len(srcs)
        if not 1 <= n <= MMQ_GROUP or not 0 <= first_pos <= MMQ_GROUP - n:
            raise FormatError(f"{t.name} gather of {n} experts at position {first_pos}: a "
                              f"batch holds 1..{MMQ_GROUP} experts and must end by position "
                              f"{MMQ_GROUP - 1}")
        stride = image_bytes(rows, cols) if image_stride is None else int(image_stride)
        if stride < image_bytes(rows, cols):
            raise FormatError(f"{t.name} gather: image stride {stride} is less than one "
                              f"{rows} x {cols} fp16 image ({image_bytes(rows, cols)} bytes)")
        why = first_misaligned({"image stride": stride, "image": dst + first_pos * stride})
        if why is not None:
            raise FormatError(f"{t.name} gather writes 16-byte words: {why}")
        if any(int(s) < 0 for s in srcs):
            raise FormatError(f"{t.name} gather: a source address is negative: {list(srcs)}")
        gx = gather_blocks(t, values, n)
        ptrs = [int(s) for s in srcs] + [0] * (MMQ_GROUP - n)
        self.kernel(t).launch(grid=(gx, n, 1), block=(GATHER_THREADS, 1, 1), stream=stream,
                              args=(*ptrs, dst, stride, values, first_pos, bounds,
                                    first_expert))


def images_reference(gtype: str | int | GGMLQuantizationType | GgmlType, raw: np.ndarray,
                     rows: int, cols: int) -> np.ndarray:
    """numpy twin of one member's image: fp16 [rows, cols] of gguf.quants.dequantize."""
    t = ggml_type(gtype)
    check_geometry(t, rows, cols)
    with np.errstate(over="ignore", invalid="ignore"):
        return t.dequantize(raw, cols).reshape(rows, cols).astype(np.float16)


__all__ = ["GATHER_SOURCE", "TYPES", "DecoderSpec", "GgmlGather", "check_geometry", "gather_blocks",
           "groups_per_step", "image_bytes", "images_reference"]
