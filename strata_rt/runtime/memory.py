"""Arenas: one allocation each, carved into named, aligned regions.

One allocation instead of many keeps pinning and cudaMalloc out of the hot path and makes the
budget a single number that can be checked (and reported) before anything is allocated. The
bookkeeping (`plan_regions`) is pure Python so it is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BudgetError, StrataError

if TYPE_CHECKING:
    from .context import DriverContext

#: every region, slot and arena offset is a multiple of this (vectorized kernels need 16)
SLOT_ALIGN = 256


def align_up(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


MIB = 1 << 20
Regions = dict[str, tuple[int, int]]


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f}"


def plan_regions(sizes: Mapping[str, int], align: int = SLOT_ALIGN,
                 budget: int | None = None, what: str = "arena") -> Regions:
    """Lays regions out in the given order, each starting on an `align` boundary.

    Returns {name: (offset, size)}; raises BudgetError naming the biggest regions when the
    aligned total exceeds `budget` bytes."""
    if align <= 0 or align & (align - 1):
        raise StrataError(f"{what}: alignment {align} is not a power of two")
    regions: Regions = {}
    offset = 0
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
            raise StrataError(f"{what}: region {name!r} has size {size!r}; "
                              "sizes are non-negative integers (bytes)")
        offset = align_up(offset, align)
        regions[name] = (offset, int(size))
        offset += int(size)
    total = regions_total(regions, align)
    if budget is not None and total > budget:
        biggest = sorted(regions.items(), key=lambda kv: -kv[1][1])[:4]
        listing = ", ".join(f"{n} {mib(s)} MiB" for n, (_, s) in biggest)
        raise BudgetError(f"{what} needs {mib(total)} MiB, budget {mib(budget)} MiB "
                          f"(largest regions: {listing})")
    return regions


def regions_total(regions: Regions, align: int = SLOT_ALIGN) -> int:
    """Bytes the whole arena takes (the end of the last region, aligned)."""
    return align_up(max((o + s for o, s in regions.values()), default=0), align)


class _Carved:
    """Shared bookkeeping of both arenas: named regions over one base address."""

    kind = "arena"

    def __init__(self, regions: Regions):
        self.regions = regions
        self.total = regions_total(regions)

    def _region(self, name: str) -> tuple[int, int]:
        try:
            return self.regions[name]
        except KeyError:
            raise StrataError(f"{self.kind} has no region {name!r}; regions: "
                              f"{', '.join(self.regions) or 'none'}") from None

    def offset(self, name: str) -> int:
        return self._region(name)[0]

    def nbytes(self, name: str) -> int:
        return self._region(name)[1]

    def report(self) -> str:
        """A table of who holds how much, for logs and budget errors."""
        width = max([len("region"), *(len(n) for n in self.regions)])
        lines = [f"{'region':<{width}}  {'bytes':>14}  {'MiB':>10}"]
        for name, (_, size) in self.regions.items():
            lines.append(f"{name:<{width}}  {size:>14,}  {mib(size):>10}")
        lines.append(f"{'total':<{width}}  {self.total:>14,}  {mib(self.total):>10}")
        return "\n".join(lines)


class PinnedArena(_Carved):
    """One page-locked host allocation: copies from it run at full PCIe rate and truly async."""

    kind = "pinned arena"

    def __init__(self, runtime: DriverContext, sizes: Mapping[str, int],
                 portable: bool = False):
        super().__init__(plan_regions(sizes, what=self.kind))
        drv = runtime.drv
        # the flags only where asked: a plain allocation stays the call it always was
        flags = {"mem_flags": drv.host_alloc_flags.PORTABLE} if portable else {}
        try:
            self._base = drv.pagelocked_empty(max(self.total, 1), np.uint8, **flags)
        except (drv.Error, MemoryError) as e:
            raise BudgetError(
                f"could not pin {mib(self.total)} MiB of host memory for "
                f"{', '.join(self.regions)}: {e}. Lower the model size or free host memory "
                "(page-locked memory is limited by RAM and `ulimit -l`)") from None
        runtime._own(self)

    @property
    def base(self) -> np.ndarray:
        return self._base

    def view(self, name: str, dtype=np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A numpy array over one region (page-locked, so async copies from it overlap)."""
        off, size = self._region(name)
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise StrataError(f"{self.kind} region {name!r} of {size} bytes is not a whole "
                              f"number of {np.dtype(dtype).name} items")
        arr = self._base[off: off + size].view(dtype)
        return arr if shape is None else arr.reshape(shape)

    def host_ptr(self, name: str) -> int:
        return int(self._base.ctypes.data) + self.offset(name)

    def free(self) -> None:
        if self._base is not None:
            self._base.base.free()
            self._base = None


class DeviceBuffer:
    """One device allocation (tests and scratch); the engine carves a DeviceArena instead."""

    def __init__(self, runtime: DriverContext, nbytes: int):
        drv = runtime.drv
        try:
            self._alloc = drv.mem_alloc(max(int(nbytes), 1))
        except drv.MemoryError as e:
            free, total = runtime.mem_info()
            raise BudgetError(f"device allocation needs {mib(nbytes)} MiB, "
                              f"free {mib(free)} MiB of {mib(total)} MiB ({e})") from None
        self.nbytes = int(nbytes)
        self.ptr = int(self._alloc)
        runtime._own(self)

    def free(self) -> None:
        if self._alloc is not None:
            self._alloc.free()
            self._alloc = None


class DeviceArena(_Carved):
    """One device allocation carved into SLOT_ALIGN-aligned named regions."""

    kind = "device arena"

    def __init__(self, runtime: DriverContext, sizes: Mapping[str, int], budget: int | None = None):
        super().__init__(plan_regions(sizes, budget=budget, what=self.kind))
        self._buffer = DeviceBuffer(runtime, self.total)
        self.base_ptr = self._buffer.ptr

    def ptr(self, name: str) -> int:
        return self.base_ptr + self.offset(name)

    def free(self) -> None:
        self._buffer.free()
