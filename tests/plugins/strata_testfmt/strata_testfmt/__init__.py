"""test_i8: int8 weights with one float16 scale per 32 values, the example of a format plugin.

A format published by another package (entry point group `strata_rt.quants`), complete with
both halves of the contract: the numpy half (quantize, dequantize, the matmul reference) and the
GPU half, a gather and an MMQ kernel in its own folder (`kernels/test_i8.cu`, shipped as
package data) launched through strata_rt's `PerExpertKernels`. The conformance suite runs on
it like on the built-in formats, on the CPU and on a GPU.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

from strata_rt import hookimpl
from strata_rt.formats.activations import F16
from strata_rt.formats.contract import FormatKernels, QuantFormat, expert_rows
from strata_rt.formats.launchers import MmqTile, PerExpertKernels

BLOCK = 32
_ROW = np.dtype([("d", "<f2"), ("q", "i1", (BLOCK,))])  # 34 bytes per block
KERNELS = Path(str(resources.files(__name__).joinpath("kernels")))


class TestI8(QuantFormat):
    """One scale d = amax/127 per 32 values; q = round(w / d)."""

    __test__ = False  # not a pytest test class despite the name

    name = "test_i8"
    block_values = BLOCK
    block_bytes = _ROW.itemsize
    native = False
    activation = F16
    exact = True  # the kernel's float32 order is mirrored by mmq_reference below
    kernel_dir = "strata_testfmt"
    roundtrip_nmse = 1e-3
    dim_multiple = 128  # the MMQ tile (64 rows) and fp16 activations (K % 128) need it
    description = "test plugin: int8 per 32 values, fp16 activations, one small CUDA kernel file"

    def kernel_sources(self) -> list[Path]:
        return sorted(KERNELS.glob("*.cu"))

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

    def _blocks(self, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
        b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)[: self.matrix_bytes(rows, cols)]
        return b.view(_ROW).reshape(rows, cols // BLOCK)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        blocks = self._blocks(raw, rows, cols)
        vals = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[..., None]
        return vals.reshape(rows, cols)

    def mmq_reference(self, image, expert_ids, acts, bounds, m, k):
        """The kernel's arithmetic (kernels/test_i8.cu) in the same order: per block of 32, a
        float32 dot summed left to right, then acc += d * dot, each step rounded."""
        x_all = np.asarray(acts, dtype=np.float16)
        out = np.zeros((x_all.shape[0], m), dtype=np.float32)
        img = np.ascontiguousarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
        nb = k // BLOCK
        for pos, lo, hi in expert_rows(expert_ids, bounds):
            if hi <= lo:
                continue
            blocks = self._blocks(img[pos], m, k)
            q = blocks["q"].astype(np.float32)            # [m, nb, 32]
            d = blocks["d"].astype(np.float32)            # [m, nb]
            x = x_all[lo:hi].astype(np.float32).reshape(hi - lo, nb, BLOCK)
            acc = np.zeros((hi - lo, m), dtype=np.float32)
            for b in range(nb):
                dot = np.zeros((hi - lo, m), dtype=np.float32)
                for j in range(BLOCK):
                    dot = dot + x[:, b, j, None] * q[None, :, b, j]
                acc = acc + d[None, :, b] * dot
            out[lo:hi] = acc
        return out

    def kernels_class(self) -> type[FormatKernels]:
        return TestI8Kernels


class TestI8Kernels(PerExpertKernels):
    """Launchers: strata_rt's PerExpertKernels does the launching; this names the kernels, the
    file that defines them (found through kernel_sources()) and their geometry."""

    __test__ = False

    gather_kernel = ("test_i8_gather", "qq")  # after (blob, gate/up image, down image)
    gather_source = "test_i8.cu"
    gather_planes = 2
    mmq_kernel = "test_i8_mmq"
    mmq_source = "test_i8.cu"
    #: TILE_M, TILE_ROWS and the threads of test_i8_mmq; k must hold whole blocks
    mmq_tile = MmqTile(m=64, rows=8, threads=64, k_multiple=BLOCK)

    def gather_units(self) -> int:
        return max(self.layout.gate_up_bytes, self.layout.down_bytes)

    def gather_args(self) -> tuple[int, ...]:
        return (self.layout.gate_up_bytes, self.layout.down_bytes)


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [TestI8()]
