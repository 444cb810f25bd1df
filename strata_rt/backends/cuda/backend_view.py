"""What the op modules of the CUDA backend read of the executor that runs them
(executor.CudaBackend), as typing Protocols: one declaration of the members they share, which
each module's own view extends with what it alone reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ...formats.contract import ExpertLayout, FormatKernels
    from ...runtime import Runtime
    from ...weights.model import MoESpec
    from .device_state import DeviceState


class BackendView(Protocol):
    """The model's dims, the runtime, the chunk's token count and the device state."""

    @property
    def spec(self) -> MoESpec: ...
    @property
    def rt(self) -> Runtime: ...
    @property
    def _T(self) -> int: ...
    def _device(self) -> DeviceState: ...


class ExpertsView(BackendView, Protocol):
    """Besides: the expert layout, each layer's format kernels, the first layer this backend
    runs, and the timing table's phase marks."""

    @property
    def lay(self) -> ExpertLayout: ...
    @property
    def fks(self) -> list[FormatKernels]: ...
    @property
    def first(self) -> int: ...
    def _mark(self, phase: str) -> None: ...
