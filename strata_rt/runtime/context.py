"""What the runtime's parts (streams, events, arenas, modules, graphs) need of the Runtime that
owns them. Declared here and implemented by device.Runtime, so those parts type their owner
without importing device.py, which imports all of them: the runtime package stays free of
import circles."""

from __future__ import annotations

from typing import Any, Protocol


class DriverContext(Protocol):
    #: the initialised pycuda.driver module
    drv: Any
    #: the opt-in shared-memory limit of one block, bytes
    max_shared_optin: int
    #: whether kernels asked for with overlap=True launch overlapped (runtime/overlap.py)
    overlap_launches: bool

    def _own(self, obj: Any) -> None:
        """Registers something with a `free()` that must run before the context dies."""

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device bytes."""

    def event(self, name: str, timing: bool = False) -> Any:
        """A new event on this context."""
