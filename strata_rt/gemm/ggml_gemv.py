"""Launchers of the decode step's matrix-vector products over a layer's routed experts, for
every built-in GGML type (kernels/ggml/gemv.cu) or a plugin's own decoder (its .cu with one
STRATA_GGML_KERNELS line; kernels/ggml/gemv.cuh).

Why: a one-token step routes top_k experts per layer, and the grouped products launch per
group of 16 experts whatever the routing; these launch once per product per layer, over the
routed (token, k) pairs only, each block reading its expert's blocks where they lie (resident
slot or pinned host store) through a device table of blob addresses, so the step gathers
nothing and still replays as one CUDA graph.

Numerics: the weights are the gathers' fp16 values and the inputs the routed path's fp16
activations, multiplied on tensor cores into float32 sums in a fixed order other than the
grouped products', so the results agree with them within float32 rounding, not bit for bit.
`gemv_reference` is the numpy twin the tests compare with.

Modules: as the fused GEMM's (ggml_fused.py), one type per module, compiled when first used.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from ..resources import KERNELS_ROOT, kernel_constant
from .ggml_decoders import DecoderModule, DecoderSpec, GgmlKey

if TYPE_CHECKING:
    from ..runtime import Runtime

GEMV_SOURCE = KERNELS_ROOT / "ggml" / "gemv.cu"
#: the F16 dense product a warp per row (gemv_f16_rows.cu), where the weights lie on 16 bytes
ROWS_SOURCE = KERNELS_ROOT / "ggml" / "gemv_f16_rows.cu"
GEMV_HEADER = KERNELS_ROOT / "ggml" / "gemv.cuh"
#: argument types: experts, offset, ids, row_of, acts, out, hidden, ffn
GEMV_ARG_TYPES = "PqPPPPii"
#: the two products: gate/up (with SwiGLU) and down
PARTS = ("gate_up", "down")
#: their kernels for launches that read experts from pinned host memory
HOST_PARTS = ("gate_up_host", "down_host")
#: argument types of ggml_gemv_dense_<TYPE>: w, x, out, rows, k, mode
DENSE_ARG_TYPES = "PPPiii"
#: what ggml_gemv_dense writes: fp16 rows, float32 rows, or float32 rows added into out
DENSE_MODES = {"f16": 0, "f32": 1, "add_f32": 2}
#: the kernels take their rows' values in steps of 8 (one 16-byte load of fp16 inputs)
GEMV_VALUES = 8


#: warps per block at most (each takes a run of the K stages), as gemv.cuh states them
GEMV_WARPS = kernel_constant(GEMV_HEADER, "GEMV_WARPS")
#: the same for the _host kernels of the expert products, launched where some of the experts
#: lie in pinned host memory: more warps keep more loads in flight across PCIe, while on
#: device memory they lose (bench/notes.md W56, W59)
GEMV_HOST_WARPS = kernel_constant(GEMV_HEADER, "GEMV_HOST_WARPS")
GEMV_THREADS = 32 * GEMV_WARPS
#: weight rows of a tile (the tensor-core product's M): 8 gate/up output rows, 16 down rows
GEMV_ROWS = kernel_constant(GEMV_HEADER, "GEMV_ROWS")
#: a stage's bytes per row at most, where whole blocks allow (gemv.cuh's gemv_cpl)
GEMV_STAGE_BYTES = kernel_constant(GEMV_HEADER, "GEMV_STAGE_BYTES")
#: shared bytes the stage buffers of a _host block may take (gemv.cuh's gemv_host_warps)
GEMV_HOST_SHARED = kernel_constant(GEMV_HEADER, "GEMV_HOST_SHARED")
#: output rows of a block of gemv_f16_rows, as its source defines them
ROWS_WARPS = kernel_constant(ROWS_SOURCE, "ROWS_WARPS")


def stage_values(d: DecoderSpec) -> int:
    """Values of K one stage of type d takes (gemv.cuh's GemvStage::values): 256, halved
    while a row's stage is over GEMV_STAGE_BYTES and still holds whole blocks."""
    cpl = 8
    while (cpl > 1 and 32 * cpl // d.block_values * d.block_bytes > GEMV_STAGE_BYTES
           and (16 * cpl) % d.block_values == 0):
        cpl //= 2
    return 32 * cpl


def stage_span(d: DecoderSpec) -> int:
    """Shared bytes of one staged row (gemv.cuh's GemvStage::span): the 16-byte chunks that
    cover a stage's bytes from any start, padded to an odd number of 16-byte units past a
    multiple of 128."""
    chunks = (stage_values(d) // d.block_values * d.block_bytes + 30) // 16
    return 16 * ((chunks + 6) // 8 * 8 + 1)


def host_warps(d: DecoderSpec) -> int:
    """Warps the _host kernels of type d are built for (gemv.cuh's gemv_host_warps):
    GEMV_HOST_WARPS, fewer where their 16-row stage buffers would pass GEMV_HOST_SHARED."""
    return max(1, min(GEMV_HOST_WARPS, GEMV_HOST_SHARED // (GEMV_ROWS * stage_span(d))))


def gemv_warps(d: DecoderSpec, k: int, host_reads: bool = False) -> int:
    """Warps of a block for a product over k values: one per stage, GEMV_WARPS at most, or
    host_warps(d) for the _host kernels (a launch that reads experts from host memory)."""
    return max(1, min(host_warps(d) if host_reads else GEMV_WARPS, -(-k // stage_values(d))))


def kernel_name(d: DecoderSpec, part: str) -> str:
    """ggml_gemv_<part>_<SUFFIX>: part gate_up, down, gate_up_host, down_host or dense."""
    return f"ggml_gemv_{part}_{d.name}"


def gemv_problem(d: DecoderSpec, hidden: int, ffn: int) -> str | None:
    """Why the kernels cannot run a part of type d for these dimensions (None: they can):
    rows of whole blocks, and row lengths in steps of GEMV_VALUES."""
    for label, k in (("hidden", hidden), ("ffn", ffn)):
        if k <= 0 or k % d.block_values or k % GEMV_VALUES:
            return (f"{d.name} matrix-vector products need {label} = {k} a positive multiple "
                    f"of {d.block_values} (a block) and of {GEMV_VALUES}")
    return None


class GgmlGemv(DecoderModule):
    """Prepared launches of the matrix-vector kernels. Default: the built-in types of gemv.cu,
    each type's module compiled and loaded when first used (`kernel` loads one ahead of a
    capture). With `source` (a plugin's .cu) and `decoders` (the specs of its
    STRATA_GGML_KERNELS lines): that module's kernels."""

    def __init__(self, runtime: Runtime, *, source: str | Path | None = None,
                 decoders: Iterable[DecoderSpec] = ()):
        super().__init__(runtime, "GgmlGemv", GEMV_SOURCE, source=source, decoders=decoders,
                         per_type=True)
        self._kernels: dict[tuple[str, str], Any] = {}

    def kernel(self, gtype: GgmlKey, part: str) -> Any:
        """The kernel of a part ("gate_up", "down" or "dense") of type gtype, loaded once."""
        d = self.decoder(gtype)
        if part not in (*PARTS, *HOST_PARTS, "dense"):
            raise FormatError(f"matrix-vector part {part!r}: one of "
                              f"{', '.join((*PARTS, *HOST_PARTS))}, dense")
        key = (d.name, part)
        if key not in self._kernels:
            types = DENSE_ARG_TYPES if part == "dense" else GEMV_ARG_TYPES
            # every kernel waits for the grid before it first (gemv.cuh): launched overlapped
            self._kernels[key] = self.module_of(d.name).kernel(kernel_name(d, part), types,
                                                               overlap=True)
            if part == "dense" and d.name == "F16":  # loaded with it, ahead of any capture
                self._kernels[("F16", "rows")] = self.runtime.module(ROWS_SOURCE).kernel(
                    "gemv_f16_rows", DENSE_ARG_TYPES, overlap=True)
        return self._kernels[key]

    def prepare_dense(self, gtype: GgmlKey, k: int) -> None:
        """Loads the dense kernel of gtype for rows of k values, or refuses, at open, a row
        length the kernels cannot take (naming decode_dense gemm, which can)."""
        d = self.decoder(gtype)
        if k <= 0 or k % d.block_values or k % GEMV_VALUES:
            raise FormatError(f"decode_dense gemv: {d.name} rows of {k} values are not whole "
                              f"blocks of {d.block_values} in steps of {GEMV_VALUES}; "
                              "decode_dense gemm (STRATA_DECODE_DENSE=gemm) runs this model")
        self.kernel(d, "dense")

    def dense(self, stream: Any, gtype: GgmlKey, w: int, x: int, out: int, rows: int, k: int,
              mode: str) -> None:
        """One token's row through a dense matrix in its own type: out [rows] of W [rows, k]
        (type gtype, rows one after another from w) times fp16 x [k]; mode (DENSE_MODES)
        "f16" writes fp16, "f32" float32, "add_f32" adds float32 into out. F16 weights on 16
        bytes take gemv_f16_rows (a warp per row), every other case the tiled gemv_dense."""
        d = self.decoder(gtype)
        if mode not in DENSE_MODES:
            raise FormatError(f"dense matrix-vector mode {mode!r}: one of "
                              f"{', '.join(DENSE_MODES)}")
        if rows < 1 or k <= 0 or k % d.block_values or k % GEMV_VALUES:
            raise FormatError(f"{d.name} dense matrix-vector product of {rows} rows of {k}: "
                              f"needs rows >= 1 and k a positive multiple of {d.block_values} "
                              f"(a block) and of {GEMV_VALUES}")
        if min(w, x, out) <= 0 or x % 16 or w % 2 or out % (2 if mode == "f16" else 4):
            raise FormatError(f"{d.name} dense matrix-vector product: device addresses needed, "
                              "the input on 16 bytes, the weights on 2, the output on its "
                              "element")
        kernel = self.kernel(d, "dense")
        grid, block = -(-rows // GEMV_ROWS), 32 * gemv_warps(d, k)
        if d.name == "F16" and w % 16 == 0:  # a warp per row: nothing to decode or stage
            kernel = self._kernels[("F16", "rows")]
            grid, block = -(-rows // ROWS_WARPS), 32 * ROWS_WARPS
        kernel.launch(grid=(grid, 1, 1), block=(block, 1, 1), stream=stream,
                      args=(int(w), int(x), int(out), int(rows), int(k), DENSE_MODES[mode]))

    def launch(self, stream: Any, part: str, gtype: GgmlKey, experts: int, offset: int,
               ids: int, row_of: int, acts: int, out: int, pairs: int, hidden: int,
               ffn: int, host_reads: bool = False) -> None:
        """One launch over `pairs` routed (token, k) pairs: part "gate_up" writes fp16
        silu(gate) * up rows [rows, ffn] at `out` from fp16 `acts` [rows, hidden]; "down"
        writes float32 rows [rows, hidden] from fp16 `acts` [rows, ffn]; pair p's expert is
        ids[p], its row row_of[p], its blob at experts[ids[p]] (a device table of addresses)
        with the part `offset` bytes into it. `host_reads`: some of the table's experts lie in
        pinned host memory (the _host kernel then runs, with more warps: gemv_warps)."""
        d = self.decoder(gtype)
        why = gemv_problem(d, hidden, ffn)
        if why is not None:
            raise FormatError(why)
        if pairs < 1:
            raise FormatError(f"{d.name} matrix-vector products over {pairs} pairs")
        if min(experts, ids, row_of, acts, out) <= 0 or (acts | out) % 16:
            raise FormatError(f"{d.name} matrix-vector products: device addresses needed, "
                              "inputs and outputs on 16 bytes")
        tiles = -(-ffn // (GEMV_ROWS // 2)) if part == "gate_up" else -(-hidden // GEMV_ROWS)
        warps = gemv_warps(d, hidden if part == "gate_up" else ffn, host_reads)
        self.kernel(d, f"{part}_host" if host_reads else part).launch(
            grid=(tiles, int(pairs), 1), block=(32 * warps, 1, 1),
            stream=stream, args=(int(experts), int(offset), int(ids), int(row_of), int(acts),
                                 int(out), int(hidden), int(ffn)))


def gemv_reference(weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """numpy twin of one product's sums: float32 of float64 fp16(weights) @ fp16(x) (the
    kernels' inputs, summed exactly here), [rows] for one input row x [k]."""
    w = np.asarray(weights, np.float32).astype(np.float16).astype(np.float64)
    v = np.asarray(x, np.float32).astype(np.float16).astype(np.float64)
    return (w @ v).astype(np.float32)


__all__ = ["DENSE_ARG_TYPES", "DENSE_MODES", "GEMV_ARG_TYPES", "GEMV_ROWS", "GEMV_SOURCE",
           "GEMV_THREADS", "GEMV_WARPS", "GEMV_HOST_SHARED", "GEMV_HOST_WARPS", "HOST_PARTS",
           "PARTS", "GgmlGemv", "gemv_problem", "gemv_reference", "gemv_warps", "host_warps",
           "kernel_name", "stage_span", "stage_values"]
