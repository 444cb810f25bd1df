"""The CUDA context an engine opens before anything else (strata_rt.backends.cuda.executor runs on
it).

A module of its own because the engine opens it first, so that whatever fails later (a profile
file, the budget) still closes it, and because the host store borrows its page-locked memory
before the backend exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError

if TYPE_CHECKING:
    from ...runtime import PinnedArena, Runtime


class CudaContext:
    """The Runtime a CUDA engine runs on, opened before anything else so that whatever fails
    later (a profile file, the budget) closes it, and the pinned memory it lends the store."""

    def __init__(self) -> None:
        from ...runtime import Runtime

        self.rt: Runtime | None = Runtime.open()
        self._pinned: list[PinnedArena] = []

    def runtime(self) -> Runtime:
        if self.rt is None:
            raise StrataError("the CUDA context is closed")
        return self.rt

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """The ExpertStore's memory: one page-locked arena (copies to the ring then run at
        full PCIe speed)."""
        arena = self.runtime().pinned({"store": nbytes})
        self._pinned.append(arena)
        return arena.view("store")

    def close(self) -> None:
        self._pinned.clear()
        rt, self.rt = self.rt, None
        if rt is not None:
            rt.close()
