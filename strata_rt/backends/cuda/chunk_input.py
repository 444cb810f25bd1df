"""A chunk's input on its way to the device: the CUDA executor's side of plan.ChunkInput.

begin_chunk starts the host pass (host_copy.stage: the copy into pinned staging memory and the
finite check, in parallel slices) and returns at once. The plan's ChunkInput op enqueues the
gate wait and the upload on the compute stream, and the pass opens the gate when it is done.
So a walk's copy stream streams experts during the host pass, where it used to wait for it.
end_chunk takes the pass's verdict and refuses a non-finite input. The device only ever saw
finite values: the pass zeroes a slice that is not.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from ...errors import ConfigError
from ..host_copy import stage

if TYPE_CHECKING:
    import numpy as np

    from ...runtime import Stream
    from ...runtime.gate import HostGate


def input_not_finite() -> ConfigError:
    """The error every backend raises for a chunk whose input holds NaN or infinity."""
    return ConfigError("prefill input holds NaN or Inf", source="prefill")


class InputPass:
    """The host pass of one chunk at a time, and the gate its stream waits at."""

    def __init__(self, gate: HostGate, stream: Stream):
        self.gate = gate
        self.stream = stream
        self._pass: Future[bool] | None = None

    def start(self, staging: np.ndarray, h: np.ndarray) -> None:
        """Starts staging[...] = h (float32, one shape) and its finite check; opens the gate
        when done."""
        self.settle()
        self._pass = stage(staging, h, self.gate.open)

    def enqueue(self) -> None:
        """The stream waits here until the pass is done (ChunkInput; the upload follows)."""
        self.gate.enqueue(self.stream)

    def finish(self) -> None:
        """After the chunk ran: raises ConfigError if the input held NaN or infinity."""
        done, self._pass = self._pass, None
        if done is not None and not done.result():
            raise input_not_finite()

    def settle(self) -> None:
        """Waits for an earlier pass, and closes a gate that no stream passed (a chunk that
        failed before its ChunkInput ran), so that the next pass does not find it open."""
        if self._pass is not None:
            self._pass.exception()  # waits; its verdict belonged to the chunk that failed
            self._pass = None
        if self.gate.is_open:
            self.stream.synchronize()
            if self.gate.is_open:
                self.gate.close()
