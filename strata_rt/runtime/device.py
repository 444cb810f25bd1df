"""The Runtime: one device, one context owned from open to close.

pycuda is imported here and only when a Runtime opens (or cuda_available asks), so the
planner, the reference backend, the CLI's help and the registry run where pycuda is absent.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..config.settings import env
from ..errors import CudaUnavailableError, StrataError
from .compile import Defines, compile_cubin
from .gate import HostGate
from .graph import Graph, capture
from .host_arena import HostArena
from .memory import DeviceArena, DeviceBuffer, PinnedArena
from .module import Module
from .streams import Event, Stream


def _load_driver():
    """(pycuda.driver initialised, "") or (None, why it cannot be had)."""
    try:
        import pycuda.driver as drv
    except ImportError as e:
        return None, (f"pycuda cannot be imported ({e}); install the `cuda` extra "
                      "(pip install 'strata_rt[cuda]') on a machine with CUDA")
    try:
        drv.init()
    except Exception as e:  # pycuda raises its own RuntimeError/LogicError subclasses
        return None, f"the CUDA driver failed to initialise ({e})"
    return drv, ""


def cuda_available(device: int = 0) -> tuple[bool, str]:
    """(True, "<device name> (sm_XY)") when a Runtime could open `device`, else (False, why).
    Never raises."""
    try:
        drv, why = _load_driver()
        if drv is None:
            return False, why
        count = drv.Device.count()
        if not 0 <= device < count:
            return False, f"device {device} asked for, {count} CUDA device(s) present"
        dev = drv.Device(device)
        major, minor = dev.compute_capability()
        return True, f"{dev.name()} (sm_{major}{minor})"
    except Exception as e:  # a broken driver must not crash a probe
        return False, f"{type(e).__name__}: {e}"


class Runtime:
    """Owns a CUDA context and everything allocated through it; `close` frees it all."""

    #: the grouped fp16 GEMM's policy for the GEMMs prepared on this runtime, "auto", "cutlass"
    #: or "own" (strata_rt.gemm.cutlass_gemm.cutlass_for): an engine sets its config's f16_gemm
    #: here before it prepares any, so the GEMMs inside a format's kernels take it too
    f16_gemm: str = "auto"

    def __init__(self, drv, device: int):
        self.drv = drv
        self.device_index = device
        count = drv.Device.count()
        if not 0 <= device < count:
            raise CudaUnavailableError(f"device {device} asked for, {count} CUDA device(s) "
                                       "present")
        self.device = drv.Device(device)
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.name = self.device.name()
        self.max_shared_optin = int(self.device.get_attribute(
            drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN))
        #: kernels asked for with overlap=True launch overlapped (programmatic dependent
        #: launch, sm_90 and later); STRATA_OVERLAP_LAUNCH=0 launches every kernel ordinarily
        self.overlap_launches = major >= 9 and env.flag("STRATA_OVERLAP_LAUNCH", True)
        self._owned: weakref.WeakSet = weakref.WeakSet()
        self._modules: dict[Path, Module] = {}
        self.context = self.device.make_context()

    @classmethod
    def open(cls, device: int = 0) -> Runtime:
        """Creates and makes current a context on `device`; raises CudaUnavailableError
        (naming the reference backend) without pycuda, a driver or the device."""
        drv, why = _load_driver()
        if drv is None:
            raise CudaUnavailableError(why)
        return cls(drv, device)

    # ---------------------------------------------------------------- lifetime
    def _own(self, obj) -> None:
        """Registers something with a `free()` that must run before the context dies."""
        self._owned.add(obj)

    def close(self) -> None:
        """Frees every allocation and graph still alive, then destroys the context."""
        if self.context is None:
            return
        try:
            self.context.synchronize()
        finally:
            self._modules.clear()
            gc.collect()  # lets unreferenced streams/events/modules die while the context lives
            for obj in list(self._owned):
                obj.free()
            self.context.pop()
            self.context.detach()
            self.context = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Runtime {self.name} {self.arch} device {self.device_index}>"

    @contextmanager
    def current(self) -> Iterator[Runtime]:
        """Makes this runtime's context current for the block (pushed, then popped; nothing
        happens when it already is). pycuda acts in the current context, and a kernel, stream
        or event of another context fails there ("invalid resource handle"), so each part of
        a layer split over several GPUs runs its work inside its own runtime's `current()`."""
        cur = self.drv.Context.get_current()
        if self.context is None or (cur is not None and getattr(cur, "handle", None)
                                    == self.context.handle):
            yield self
            return
        self.context.push()
        try:
            yield self
        finally:
            self.drv.Context.pop()

    # ---------------------------------------------------------------- device facts
    def mem_info(self) -> tuple[int, int]:
        free, total = self.drv.mem_get_info()
        return int(free), int(total)

    def free_bytes(self) -> int:
        return self.mem_info()[0]

    def total_bytes(self) -> int:
        return self.mem_info()[1]

    def check(self) -> None:
        """Debug aid: waits for all work and raises StrataError if any launch failed."""
        try:
            self.context.synchronize()
        except self.drv.Error as e:
            raise StrataError(f"a CUDA launch or copy failed: {e}") from None

    def synchronize(self) -> None:
        self.context.synchronize()

    # ---------------------------------------------------------------- streams and events
    def stream(self, name: str) -> Stream:
        return Stream(self, name)

    def event(self, name: str, timing: bool = False) -> Event:
        return Event(self, name, timing)

    @contextmanager
    def capture(self, stream: Stream, mode: str = "thread_local") -> Iterator[Graph]:
        """`with rt.capture(s) as g: ...enqueue on s...` then `g.launch(s)` replays it."""
        with capture(self, stream, mode) as graph:
            yield graph

    def gate(self, word: np.ndarray) -> HostGate:
        """A gate streams wait at until the host opens it, on one uint32 of pinned memory."""
        return HostGate(word)

    # ---------------------------------------------------------------- memory
    def pinned(self, sizes: Mapping[str, int], portable: bool = False) -> PinnedArena:
        """portable: page-locked for every context of the process, not only this one (the
        expert store of a layer split, which every device's copies read)."""
        return PinnedArena(self, sizes, portable)

    def host_arena(self, nbytes: int, what: str = "host memory") -> HostArena:
        """Ordinary host memory to fill first and page-lock after (HostArena.register, in
        this context): large stores, whose fill then allocates their pages on its threads."""
        return HostArena(self, nbytes, what)

    def device_arena(self, sizes: Mapping[str, int], budget: int | None = None) -> DeviceArena:
        return DeviceArena(self, sizes, budget)

    def alloc(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(self, nbytes)

    def memcpy_htod(self, dst: int, host: np.ndarray, stream: Stream) -> None:
        """Host -> device on `stream`; truly asynchronous only from page-locked memory."""
        self.drv.memcpy_htod_async(dst, _contiguous(host, "memcpy_htod source"), stream.raw)

    def memcpy_dtoh(self, host: np.ndarray, src: int, stream: Stream) -> None:
        self.drv.memcpy_dtoh_async(_contiguous(host, "memcpy_dtoh destination"), src,
                                   stream.raw)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self.drv.memcpy_dtod_async(dst, src, nbytes, stream.raw)

    def memcpy_peer(self, dst: int, src: int, src_runtime: Runtime, nbytes: int,
                    stream: Stream) -> None:
        """Device -> device on `stream` (of this runtime), reading memory of `src_runtime`'s
        context: a plain device copy when both are one context (a GPU named twice), else
        cuMemcpyPeerAsync, which the driver runs over NVLink or PCIe peer access where the
        GPUs have it and stages through the host where they do not."""
        if src_runtime is self or src_runtime.context is self.context:
            self.memcpy_dtod(dst, src, nbytes, stream)
            return
        self.drv.memcpy_peer_async(dst, src, nbytes, dest_context=self.context,
                                   src_context=src_runtime.context, stream=stream.raw)

    def memset_d8(self, ptr: int, byte: int, nbytes: int, stream: Stream) -> None:
        self.drv.memset_d8_async(ptr, byte, nbytes, stream.raw)

    # ---------------------------------------------------------------- code
    def module(self, source: Path, defines: Defines | None = None,
               extra_flags: tuple[str, ...] = (), *, arch: str | None = None) -> Module:
        """Compiles `source` for this device (disk-cached) and loads it once per runtime.
        `arch`: a target other than the device's own, e.g. "sm_90a" for a source with
        arch-specific instructions on an sm_90 device."""
        cubin = compile_cubin(Path(source), arch or self.arch, defines, extra_flags)
        if cubin not in self._modules:
            self._modules[cubin] = Module(self, cubin, Path(source))
        return self._modules[cubin]


def _contiguous(arr: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise StrataError(f"{what} must be a C-contiguous numpy array "
                          "(a copy would make the transfer synchronous and detached)")
    return arr
