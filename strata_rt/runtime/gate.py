"""A gate a stream waits at until the host opens it: one 32-bit word of page-locked memory.

Why: work enqueued (or a graph launched) ahead of its input lets the streams that do not need
the input start at once. A walk's copy stream streams experts while the host still copies the
chunk's input into pinned memory; the compute stream waits at the gate before its upload. The
wait is a stream memory operation (cuStreamWaitValue32), which a CUDA graph captures like any
other node, so a replayed walk waits at the same place.

Protocol: `enqueue` makes the stream wait for the word to equal 1 and then set it back to 0, so
the gate closes behind each pass; `open` (host) sets it to 1. One gate serves one stream, one
pass at a time. The host must open the gate from a thread that does not wait for the stream
(a graph launch can block until the device has drained earlier work), and must open it on
every path, errors included, or the stream waits forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import StrataError
from .driver_api import check_call, libcuda
from .hostmap import host_device_pointer

if TYPE_CHECKING:
    from .streams import Stream

#: CUstreamWaitValue_flags: CU_STREAM_WAIT_VALUE_EQ
WAIT_EQ = 0x1
#: CUstreamWriteValue_flags: CU_STREAM_WRITE_VALUE_DEFAULT (earlier writes are visible first)
WRITE_DEFAULT = 0x0
OPEN, CLOSED = 1, 0


class HostGate:
    """`word`: a uint32 view of one word of page-locked memory of the current context."""

    def __init__(self, word: np.ndarray):
        if word.dtype != np.uint32 or word.size != 1:
            raise StrataError(f"a gate is one uint32 word, got {word.dtype} [{word.size}]")
        self._word = word.reshape(1)
        self._word[0] = CLOSED
        self._addr = host_device_pointer(self._word)

    def enqueue(self, stream: Stream) -> None:
        """Later work on `stream` waits until the gate is open; the stream then closes it."""
        lib = libcuda()
        check_call(lib.cuStreamWaitValue32_v2(stream.handle, self._addr, OPEN, WAIT_EQ),
                   f"cuStreamWaitValue32 on stream {stream.name!r} (the input gate)")
        check_call(lib.cuStreamWriteValue32_v2(stream.handle, self._addr, CLOSED, WRITE_DEFAULT),
                   f"cuStreamWriteValue32 on stream {stream.name!r} (the input gate)")

    def open(self) -> None:
        self._word[0] = OPEN

    @property
    def is_open(self) -> bool:
        return int(self._word[0]) == OPEN

    def close(self) -> None:
        """Closes a gate no stream passed (call only while no stream waits at it)."""
        self._word[0] = CLOSED
