"""The CUDA context an engine opens before anything else (strata_rt.backends.cuda.executor runs on
it).

A module of its own because the engine opens it first, so that whatever fails later (a profile
file, the budget) still closes it, and because the host store borrows its page-locked memory
before the backend exists.

A layer split opens one Runtime per distinct device; a device named twice (a test's
`devices: [0, 0]`, EngineConfig.repeat_devices) shares one Runtime, so both parts live in one
context and their hand-off is a plain device copy. The store is then page-locked as portable
memory, which every context of the process may copy from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError

if TYPE_CHECKING:
    from ...runtime import PinnedArena, Runtime


class CudaContext:
    """The Runtimes a CUDA engine runs on (one per distinct device, in the order the split
    names them), opened before anything else so that whatever fails later (a profile file,
    the budget) closes them, and the pinned memory the first lends the store."""

    def __init__(self, devices: Sequence[int] = (0,)) -> None:
        from ...runtime import Runtime

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

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """The ExpertStore's memory: one page-locked arena (copies to the ring then run at
        full PCIe speed), allocated in the first runtime's context (which frees it), portable
        when several contexts copy from it."""
        rt = self.runtime()
        with rt.current():
            arena = rt.pinned({"store": nbytes}, portable=len(self._runtimes) > 1)
        self._pinned.append(arena)
        return arena.view("store")

    def close(self) -> None:
        self._pinned.clear()
        self.rt = None
        self._close_runtimes()

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
