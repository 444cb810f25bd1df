"""test_i8: int8 weights with one float16 scale per 32 values, matmul in numpy only.

It exists to prove that a format published by another package (entry point group
`strata_rt.quants`) loads without plugins.yaml and passes the CPU conformance checks. It has
no kernels, so the conformance suite's kernel and GPU steps report "no kernels".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_rt import hookimpl
from strata_rt.formats import QuantFormat

BLOCK = 32
_ROW = np.dtype([("d", "<f2"), ("q", "i1", (BLOCK,))])  # 34 bytes per block


class TestI8(QuantFormat):
    """One scale d = amax/127 per 32 values; q = round(w / d)."""

    __test__ = False  # not a pytest test class despite the name

    name = "test_i8"
    block_values = BLOCK
    block_bytes = _ROW.itemsize
    native = False
    activation = "f16"
    kernel_dir = "strata_testfmt"
    roundtrip_nmse = 1e-3
    dim_multiple = 32
    description = "test plugin: int8 per 32 values, numpy only"

    def kernel_sources(self) -> list[Path]:
        return []

    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        w = self.check_weights(weights)
        rows, cols = w.shape
        blocks = w.reshape(rows, cols // BLOCK, BLOCK)
        d = (np.abs(blocks).max(axis=2) / 127).astype(np.float16)
        dd = d.astype(np.float32)[..., None]
        safe = np.where(dd == 0, 1, dd)
        q = np.clip(np.rint(blocks / safe), -127, 127).astype(np.int8)
        out = np.empty((rows, cols // BLOCK), dtype=_ROW)
        out["d"], out["q"] = d, q
        return out.view(np.uint8).reshape(rows, self.row_bytes(cols))

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1).view(_ROW)
        blocks = blocks.reshape(rows, cols // BLOCK)
        vals = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
        return vals.reshape(rows, cols)

    def prepare_activations(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32).astype(np.float16)

    def mmq_reference(self, image, expert_ids, acts, bounds, m, k):
        out = np.zeros((acts.shape[0], m), dtype=np.float32)
        for pos, e in enumerate(expert_ids):
            lo, hi = int(bounds[e]), int(bounds[e + 1])
            if hi > lo:
                w = self.dequantize(image[pos], (m, k))
                out[lo:hi] = acts[lo:hi].astype(np.float32) @ w.T
        return out


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [TestI8()]
