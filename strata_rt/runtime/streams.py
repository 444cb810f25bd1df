"""Streams and events with the one check CUDA does not make.

cuStreamWaitEvent on an event that was never recorded returns success and waits for nothing;
a plan that relies on such a wait races silently. Event therefore remembers whether it was ever
recorded, and Stream.wait refuses one that was not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import PlanHazardError, StrataError

if TYPE_CHECKING:
    from .context import DriverContext


class Stream:
    """A named CUDA stream. `handle` is the CUstream value (for ctypes calls such as graphs)."""

    def __init__(self, runtime: DriverContext, name: str):
        self.name = name
        self.raw = runtime.drv.Stream()
        self.handle = int(self.raw.handle)

    def wait(self, event: Event) -> None:
        """Makes later work on this stream wait for `event`'s last record."""
        if not event.recorded:
            raise PlanHazardError(
                f"stream {self.name!r} asked to wait on event {event.name!r}, which was never "
                "recorded; CUDA would treat that as no wait at all")
        self.raw.wait_for_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def done(self) -> bool:
        return bool(self.raw.is_done())

    def __repr__(self) -> str:
        return f"<Stream {self.name} 0x{self.handle:x}>"


class Event:
    """A named CUDA event; timing is off unless asked (timing events cost more to record)."""

    def __init__(self, runtime: DriverContext, name: str, timing: bool = False):
        drv = runtime.drv
        self.name = name
        self.timing = timing
        self.raw = drv.Event(0 if timing else drv.event_flags.DISABLE_TIMING)
        self.recorded = False
        self.stream: str | None = None  # name of the stream of the last record

    def record(self, stream: Stream) -> None:
        self.raw.record(stream.raw)
        self.recorded = True
        self.stream = stream.name

    def _require_recorded(self, what: str) -> None:
        if not self.recorded:
            raise PlanHazardError(f"{what} event {self.name!r}, which was never recorded")

    def synchronize(self) -> None:
        """Blocks the host until the last record completed."""
        self._require_recorded("host asked to wait on")
        self.raw.synchronize()

    def done(self) -> bool:
        self._require_recorded("host asked about")
        return bool(self.raw.query())

    def elapsed_ms(self, later: Event) -> float:
        """Milliseconds from this event to `later` (both recorded, both timing events)."""
        for ev in (self, later):
            if not ev.timing:
                raise StrataError(f"event {ev.name!r} was created without timing; "
                                  "use rt.event(name, timing=True)")
            ev._require_recorded("elapsed time asked of")
        later.raw.synchronize()
        return float(self.raw.time_till(later.raw))

    def __repr__(self) -> str:
        return f"<Event {self.name} recorded={self.recorded}>"
