"""The CUDA context an engine opens before anything else (strata_rt.backends.cuda.executor runs on
it).

A module of its own because the engine opens it first, so that whatever fails later (a profile
file, the budget) still closes it, and because the host store borrows its page-locked memory
before the backend exists.

A layer split opens one Runtime per distinct device; a device named twice (a test's
`devices: [0, 0]`, EngineConfig.repeat_devices) shares one Runtime, so both parts live in one
context and their hand-off is a plain device copy. The host stores (the experts', and the
streamed dense layers' of a whole model) are page-locked as portable memory, which every
context of the process may copy from, once they are filled (host_pin).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...config.hostmem import format_bytes
from ...config.settings.engine_config import STORE_MEMORIES
from ...errors import StrataError

if TYPE_CHECKING:
    from ...runtime import PinnedArena, Runtime
    from ...runtime.host_arena import HostArena

log = logging.getLogger(__name__)


class CudaContext:
    """The Runtimes a CUDA engine runs on (one per distinct device, in the order the split
    names them), opened before anything else so that whatever fails later (a profile file,
    the budget) closes them, and the host memory the first lends the stores (the experts',
    and a whole model's streamed dense layers')."""

    def __init__(self, devices: Sequence[int] = (0,), store_memory: str | None = None) -> None:
        """store_memory (EngineConfig.store_memory, None: its default), for every host store
        host_alloc hands out: "alloc", each is one cuMemHostAlloc filled afterwards;
        "register", ordinary memory filled first, then page-locked once (host_pin)."""
        from ...runtime import Runtime

        store_memory = store_memory or STORE_MEMORIES[0]
        if store_memory not in STORE_MEMORIES:
            raise StrataError(f"store_memory: got {store_memory!r}; expected one of "
                              f"{', '.join(STORE_MEMORIES)}")
        self.store_memory = store_memory

        self._runtimes: dict[int, Runtime] = {}
        self.rt: Runtime | None = None
        try:
            for d in devices:
                if d not in self._runtimes:
                    self._runtimes[d] = Runtime.open(d)
        except BaseException:
            self._close_runtimes()
            raise
        self.rt = self._runtimes[devices[0]]
        self._arenas: list[HostArena] = []
        self._pinned: list[PinnedArena] = []

    def runtime(self, device: int | None = None) -> Runtime:
        """The Runtime of `device` (None: the first device's)."""
        if self.rt is None:
            raise StrataError("the CUDA context is closed")
        if device is None:
            return self.rt
        try:
            return self._runtimes[device]
        except KeyError:
            raise StrataError(f"device {device} was not opened by this engine (opened: "
                              f"{', '.join(map(str, self._runtimes))})") from None

    def host_alloc(self, nbytes: int, what: str = "the expert store") -> np.ndarray:
        """Host memory for `what` (the ExpertStore's, the streamed dense layers' store of a
        whole model), owned by the first runtime's context, which frees it. "register": not
        page-locked yet, ordinary memory the store's fill allocates page by page as it
        writes, then `host_pin` locks it (runtime.host_arena says why in that order).
        "alloc": page-locked already (portable when several contexts copy from it)."""
        rt = self.runtime()
        if self.store_memory == "alloc":
            t0 = time.perf_counter()
            with rt.current():
                pinned = rt.pinned({"store": nbytes}, portable=len(self._runtimes) > 1)
            self._pinned.append(pinned)
            log.info("page-locked %s of host memory for %s (cuMemHostAlloc) in %.1f s",
                     format_bytes(nbytes), what, time.perf_counter() - t0)
            return pinned.view("store")
        arena = rt.host_arena(nbytes, what)
        self._arenas.append(arena)
        assert arena.array is not None
        return arena.array

    def host_pin(self, host: np.ndarray) -> None:
        """Page-locks the arena `host_alloc` returned `host` from (any of them: the expert
        store's, the streamed dense layers'), once it is filled: portable (every context of a
        layer split copies from it) and mapped for the device (decode kernels read
        non-resident experts in place). Nothing to do under "alloc"."""
        if self.store_memory == "alloc":
            return
        arena = next((a for a in self._arenas if a.array is not None
                      and a.array.ctypes.data == host.ctypes.data), None)
        if arena is None:
            raise StrataError("host_pin: the array is not one this context's host_alloc "
                              "returned")
        rt = self.runtime()
        t0 = time.perf_counter()
        with rt.current():
            arena.register()
        log.info("page-locked %s of host memory for %s in %.1f s",
                 format_bytes(arena.length), arena.what, time.perf_counter() - t0)

    def close(self) -> None:
        """Closes the runtimes, which free the stores' arenas (unregistered, then unmapped):
        held here until then, since a runtime holds what it owns only weakly."""
        self.rt = None
        try:
            self._close_runtimes()
        finally:
            self._arenas.clear()
            self._pinned.clear()

    def _close_runtimes(self) -> None:
        """Closes in reverse order of opening: each context is then the one on top of the
        thread's stack, where Runtime.close pops it from."""
        error: BaseException | None = None
        for rt in reversed(list(self._runtimes.values())):
            try:
                rt.close()
            except BaseException as e:  # noqa: BLE001 (every runtime is closed first)
                error = error or e
        self._runtimes.clear()
        if error is not None:
            raise error
