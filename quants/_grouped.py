"""Pieces the grouped-matmul launchers and their numpy mirrors share across plugins.

Every MMQ kernel takes the group's expert ids by value (16 int32 parameters, unused = -1) and
reads each expert's row range from `bounds`; these helpers keep that contract in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats import (
    KERNELS_ROOT,
    MMQ_GROUP,
    ExpertLayout,
    FormatKernels,
    QuantFormat,
    first_misaligned,
)

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

GATHER_THREADS = 256
GATHER_MAX_BLOCKS = 1024
MMQ_ARGS = "P" + "i" * 16 + "PPPii"  # weights, Ids16, acts, bounds, out, m, k


def ids16(expert_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The 16 int32 kernel parameters for a group (unused positions = -1)."""
    n = len(expert_ids)
    if not 0 < n <= MMQ_GROUP:
        raise FormatError(f"an MMQ group holds 1..{MMQ_GROUP} experts, got {n}")
    if min(expert_ids) < 0:
        raise FormatError(f"expert ids must be >= 0, got {tuple(expert_ids)}")
    return tuple(int(e) for e in expert_ids) + (-1,) * (MMQ_GROUP - n)


def grid_rows(rows_hint: int, tile_rows: int) -> int:
    """Row tiles per expert in the launch grid; the kernel reads exact counts from bounds."""
    if rows_hint < 0:
        raise FormatError(f"rows_hint must be >= 0, got {rows_hint}")
    return (rows_hint + tile_rows - 1) // tile_rows


def check_aligned(names_and_values: dict[str, int]) -> None:
    """Vectorized kernels load and store 16 bytes at a time; a misaligned address would fault
    on the device, so it is refused on the host with the offending value."""
    why = first_misaligned(names_and_values)
    if why is not None:
        raise FormatError(f"device address not aligned: {why}")


def expert_rows(expert_ids: tuple[int, ...], bounds: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(group position, first row, end row) for each expert of a group, as the kernels read
    them from bounds."""
    b = np.asarray(bounds, dtype=np.int64)
    for p, e in enumerate(expert_ids):
        yield p, int(b[e]), int(b[e + 1])


class PerExpertKernels(FormatKernels):
    """Launchers for a non-native format: one gather launch per expert (grid.y = the planes it
    rebuilds) and a grouped MMQ over (m tiles, row tiles, group position). A subclass names its
    kernels and says what its gather needs; the launch logic lives here once."""

    gather_kernel: ClassVar[tuple[str, str]]  # (name, argument types after src, gu, dn)
    gather_planes: ClassVar[int]
    mmq_kernel: ClassVar[str]
    mmq_tile_m: ClassVar[int] = 64
    mmq_tile_n: ClassVar[int] = 64
    mmq_threads: ClassVar[int] = 128
    mmq_k_multiple: ClassVar[int] = 64

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        src = KERNELS_ROOT / fmt.kernel_dir
        name, arg_types = self.gather_kernel
        self._gather = runtime.module(src / "gather.cu").kernel(name, "PPP" + arg_types)
        self._mmq = runtime.module(src / "mmq.cu").kernel(self.mmq_kernel, MMQ_ARGS)
        units = max(self.gather_units() // 16, 1)
        self._gather_blocks = min(-(-units // GATHER_THREADS), GATHER_MAX_BLOCKS)

    def gather_units(self) -> int:
        """Bytes of the largest plane one gather block row walks (sizes grid.x)."""
        raise NotImplementedError

    def gather_args(self) -> tuple[int, ...]:
        """The gather kernel's arguments after (src, gate/up image, down image)."""
        raise NotImplementedError

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        lay = self.layout
        gu = gu_buf + pos * lay.gate_up_image_bytes
        dn = down_buf + pos * lay.down_image_bytes
        check_aligned({"src": src, "gate/up image": gu, "down image": dn})
        self._gather.launch(grid=(self._gather_blocks, self.gather_planes, 1),
                            block=(GATHER_THREADS, 1, 1), stream=stream,
                            args=(src, gu, dn, *self.gather_args()))

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        ids = ids16(expert_ids)
        if m % self.mmq_tile_m or k % self.mmq_k_multiple:
            raise FormatError(f"{self.fmt.name} MMQ: m={m} must divide by {self.mmq_tile_m}, "
                              f"k={k} by {self.mmq_k_multiple}")
        check_aligned({"weights": weights, "acts": acts, "out": out})
        ny = grid_rows(rows_hint, self.mmq_tile_n)
        if ny == 0:
            return
        self._mmq.launch(grid=(m // self.mmq_tile_m, ny, len(expert_ids)),
                         block=(self.mmq_threads, 1, 1), stream=stream,
                         args=(weights, *ids, acts, bounds, out, m, k))
