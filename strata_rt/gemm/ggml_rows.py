"""Launcher of the row gather of every GGML type (kernels/ggml/rows.cu): rows of a [vocab, cols]
matrix kept on the device in its GGUF type, picked by int32 ids on the device and written as
float32 [n, cols]. A whole model's chunk looks its token embedding up with it, so the host
uploads T int32 ids instead of T x hidden float32 rows it would first have to dequantize.

Numerics: each value is gguf.quants.dequantize's float32 value bit for bit (the decoders of
kernels/ggml, as the dequantizing gather, without its fp16 rounding); `rows_reference` is the
numpy twin the tests compare with. An id outside 0 .. vocab - 1 gives a NaN row on the device
and reads nothing; the CUDA executor refuses such ids on the host before they are uploaded.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from ..formats.contract import first_misaligned
from ..formats.ggml_types import GgmlType, ggml_type
from ..resources import KERNELS_ROOT
from .ggml_decoders import DecoderModule, GgmlKey

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

    from ..runtime import Runtime

ROWS_SOURCE = KERNELS_ROOT / "ggml" / "rows.cu"
#: argument types: table, ids, out, n_ids, vocab, row bytes, cols
ROWS_ARG_TYPES = "PPPiiqi"
ROWS_THREADS = 256
#: float32 values one thread writes per step (two 16-byte stores)
ROWS_VALUES = 8
#: CUDA blocks one launch takes at most (the threads then stride over the rest)
ROWS_MAX_BLOCKS = 4096
#: ids (and vocabulary rows) the int32 arguments hold
MAX_IDS = 2**31 - 1


class GgmlRows(DecoderModule):
    """The row gathers of every built-in GGML type, from one module loaded at once; `kernel`
    loads one type's ahead of its first launch (at an engine's open, so that nothing is
    loaded inside a captured graph and a type without a decoder fails before any prompt)."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime, "GgmlRows", ROWS_SOURCE)
        self._kernels: dict[str, Any] = {}

    def kernel(self, gtype: GgmlKey) -> Any:
        t = self.decoder(gtype)
        if t.name not in self._kernels:
            self._kernels[t.name] = self.module_of(t.name).kernel(f"ggml_rows_{t.name}",
                                                                  ROWS_ARG_TYPES)
        return self._kernels[t.name]

    def rows(self, stream: Any, gtype: GgmlKey, table: int, ids: int, out: int, n_ids: int,
             vocab: int, cols: int) -> None:
        """One launch: out[r] = row ids[r] of the [vocab, cols] matrix of type gtype at
        `table` (whole blocks, row after row, any alignment), as float32, for r < n_ids;
        `ids` is n_ids int32 on the device, `out` float32 [n_ids, cols], 16-byte aligned."""
        t = self.decoder(gtype)
        row_bytes = t.row_bytes(cols)  # whole blocks per row
        if cols % ROWS_VALUES:
            raise FormatError(f"{t.name} row gather of rows of {cols} values: it writes "
                              f"{ROWS_VALUES} values per step, so cols must be a multiple "
                              f"of {ROWS_VALUES}")
        if not 1 <= n_ids <= MAX_IDS or not 1 <= vocab <= MAX_IDS:
            raise FormatError(f"{t.name} row gather of {n_ids} ids from {vocab} rows: both "
                              f"must be 1..{MAX_IDS}")
        why = first_misaligned({"output": out})
        if why is not None:
            raise FormatError(f"{t.name} row gather writes 16-byte words: {why}")
        if min(table, ids, out) <= 0:
            raise FormatError(f"{t.name} row gather: table 0x{table:x}, ids 0x{ids:x} and "
                              f"output 0x{out:x} must be device addresses")
        chunks = n_ids * (cols // ROWS_VALUES)
        blocks = max(1, min(ROWS_MAX_BLOCKS, -(-chunks // ROWS_THREADS)))
        self.kernel(t).launch(grid=(blocks, 1, 1), block=(ROWS_THREADS, 1, 1), stream=stream,
                              args=(int(table), int(ids), int(out), int(n_ids), int(vocab),
                                    row_bytes, int(cols)))


def rows_reference(gtype: str | int | GGMLQuantizationType | GgmlType, table: np.ndarray,
                   ids: np.ndarray, cols: int) -> np.ndarray:
    """numpy twin of one launch: float32 [len(ids), cols], gguf.quants.dequantize of each
    id's row of `table` (raw rows, uint8 [vocab, row bytes] or any array of those bytes), and
    NaN for an id outside the table."""
    t = ggml_type(gtype)
    raw = np.ascontiguousarray(table).view(np.uint8).reshape(-1, t.row_bytes(cols))
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    inside = (ids >= 0) & (ids < raw.shape[0])
    out = np.full((ids.size, cols), np.nan, np.float32)
    if inside.any():
        with warnings.catch_warnings():  # NaN blocks decode to NaN, as the device's do
            warnings.simplefilter("ignore", RuntimeWarning)
            out[inside] = t.dequantize(raw[ids[inside]], cols)
    return out


__all__ = ["MAX_IDS", "ROWS_ARG_TYPES", "ROWS_SOURCE", "ROWS_THREADS", "GgmlRows",
           "rows_reference"]
