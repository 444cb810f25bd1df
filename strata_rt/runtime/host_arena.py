"""Host memory mapped and filled as ordinary memory first, page-locked with the driver after.

Why not cuMemHostAlloc (PinnedArena): it maps, zeroes and locks every page in one call on one
thread before the first byte can be written, and the expert store then writes every byte
again. Here the order is reversed: an anonymous mapping (aligned to 2 MiB, transparent huge
pages asked for where the platform has them) is written by the fill itself, on several threads,
so each page is allocated by the write that fills it; cuMemHostRegister then only locks pages
that already exist and maps them for the device. bench/bench_open_store.py times both steps.

The registration asks for two flags. DEVICEMAP: decode kernels read non-resident experts
straight from the store through the address cuMemHostGetDevicePointer names
(strata_rt.runtime.hostmap). PORTABLE: a layer split opens one context per device, and every
one of them copies from the same store.

A registration that fails is a BudgetError: nothing falls back to pageable memory, whose
copies are neither asynchronous nor mapped for the device.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BudgetError, StrataError
from .driver_api import error_text, libcuda
from .memory import align_up, mib

if TYPE_CHECKING:
    from .context import DriverContext

log = logging.getLogger(__name__)

#: mappings are this long and start on this boundary: a transparent huge page's size on x86-64
#: and the common arm64 kernels
HUGE_PAGE = 2 << 20
#: cuMemHostRegister flags (cuda.h)
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
REGISTER_FLAGS = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def memlock_limit() -> str:
    """The locked-memory limit of this process (`ulimit -l`), in words."""
    try:
        import resource
    except ImportError:  # not POSIX
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{mib(soft)} MiB"


def map_anonymous(nbytes: int, what: str) -> tuple[int, int]:
    """(address, length) of a fresh private anonymous mapping of at least `nbytes`, its start
    and length multiples of HUGE_PAGE, huge pages asked for (advice a kernel may ignore). No
    page exists until it is first written."""
    lib = _libc()
    length = align_up(max(int(nbytes), 1), HUGE_PAGE)
    raw = lib.mmap(None, length + HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise BudgetError(f"could not map {mib(length)} MiB of host memory for {what} "
                          f"(mmap: errno {err}); free host memory or open a smaller model")
    start = align_up(raw, HUGE_PAGE)
    if start > raw:  # the unaligned head and the spare tail go back at once
        lib.munmap(raw, start - raw)
    tail = raw + length + HUGE_PAGE - (start + length)
    if tail:
        lib.munmap(start + length, tail)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        lib.madvise(start, length, advice)  # EINVAL where huge pages are off: ordinary pages
    return start, length


class _Memory:
    """What numpy reads an array's address and size from (the array keeps it as its base)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__array_interface__: dict[str, Any] = {
            "data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class HostArena:
    """`nbytes` of ordinary host memory (`array`) to fill first and page-lock after
    (`register`), owned by a runtime, which frees it before its context goes: unregistered,
    then unmapped. Views of `array` must not outlive it (as with PinnedArena)."""

    kind = "host arena"

    def __init__(self, runtime: DriverContext, nbytes: int, what: str = "host memory"):
        self.nbytes = int(nbytes)
        self.what = what
        self.ptr, self.length = map_anonymous(self.nbytes, what)
        self.array: np.ndarray | None = np.asarray(_Memory(self.ptr, self.nbytes))
        self.registered = False
        runtime._own(self)

    def register(self) -> None:
        """Page-locks the whole mapping for every context (PORTABLE) and maps it for the
        device (DEVICEMAP), in the current context. Pages not written yet are allocated now;
        a failure is a BudgetError naming the size and the limits that apply."""
        if self.array is None:
            raise StrataError(f"{self.kind} for {self.what}: registered after it was freed")
        if self.registered:
            raise StrataError(f"{self.kind} for {self.what}: registered twice")
        code = libcuda().cuMemHostRegister_v2(ctypes.c_void_p(self.ptr), self.length,
                                              REGISTER_FLAGS)
        if code != 0:
            raise BudgetError(
                f"could not page-lock {mib(self.length)} MiB of host memory for {self.what} "
                f"(cuMemHostRegister: {error_text(code)}). Page-locked memory must fit in "
                f"RAM beside everything else running, and under the locked-memory limit "
                f"(`ulimit -l`: {memlock_limit()}); free host memory, raise the limit, or "
                "open a smaller model")
        self.registered = True

    def free(self) -> None:
        if self.array is None:
            return
        self.array = None
        if self.registered:
            self.registered = False
            code = libcuda().cuMemHostUnregister(ctypes.c_void_p(self.ptr))
            if code != 0:  # the pages stay locked until the process ends; unmapped anyway
                log.warning("cuMemHostUnregister of %s MiB (%s) failed: %s",
                            mib(self.length), self.what, error_text(code))
        _libc().munmap(self.ptr, self.length)
