"""SIGTERM and SIGHUP handled as Ctrl-C is: finished work kept, then an exit code that says
which signal ended the run.

Python turns Ctrl-C (SIGINT) into KeyboardInterrupt, and every long loop in strata_rt (prompts
of `run`, `bench` and `profile`, windows of `perplexity`, tokens of `generate`) keeps what it
finished when one arrives. SIGTERM, what `timeout`, batch schedulers and container runtimes
send, killed the process at once instead, losing all of it. `signals_as_interrupts` raises
`Terminated` (a KeyboardInterrupt) for SIGTERM and SIGHUP, so the same code keeps the same
work. A second signal while that work is saved is noted and not raised again: the save
finishes (a scheduler that will not wait sends SIGKILL).

Exit codes: 130 after Ctrl-C, 128 + the signal's number after another (143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: what the command line turns into KeyboardInterrupt beside SIGINT
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                if hasattr(signal, name))

_received: list[int] = []


class Terminated(KeyboardInterrupt):
    """A signal other than SIGINT, raised where KeyboardInterrupt would be."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, _frame: FrameType | None) -> None:
    first = not _received
    _received.append(signum)
    if first:
        raise Terminated(signum)


@contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise Terminated in the main thread (elsewhere,
    where signals cannot be handled, the block runs as it is). The handlers before are
    restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    before = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def received() -> int | None:
    """The first signal that raised Terminated in the current block, or None (none, or
    Ctrl-C only)."""
    return _received[0] if _received else None


def how() -> str:
    """'interrupted' after Ctrl-C, 'terminated by SIGTERM' after that signal."""
    signum = received()
    return "interrupted" if signum is None else f"terminated by {signal.Signals(signum).name}"


def exit_code() -> int:
    """130 after Ctrl-C, 128 + the signal's number after another."""
    signum = received()
    return 130 if signum is None else 128 + signum
