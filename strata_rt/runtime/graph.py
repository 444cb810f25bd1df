"""CUDA graph capture and replay through the driver API (pycuda has no graph API).

Work enqueued on a stream between begin and end capture is recorded instead of run; the
instantiated graph then replays all of it with one launch, which removes the per-launch host
cost of a fixed schedule such as the streamed walk.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import StrataError
from .driver_api import check_call, libcuda

if TYPE_CHECKING:
    from .context import DriverContext
    from .streams import Stream

#: CUstreamCaptureMode values: "thread_local" refuses unsafe calls (allocation, sync) made by
#: this thread during capture; "global" by any thread; "relaxed" refuses none.
CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}


class Graph:
    """A captured, instantiated graph; `launch` replays the captured work on any stream.

    Created empty by `capture` and filled when the capture block exits."""

    def __init__(self, runtime: DriverContext, name: str):
        self.name = name
        self._graph: ctypes.c_void_p | None = None
        self._exec: ctypes.c_void_p | None = None
        self._held: list[Any] = []
        runtime._own(self)

    def hold(self, obj: Any) -> None:
        """Keeps `obj` (device memory the graph's kernels read, with a `free`) until the graph
        is freed, then frees it."""
        self._held.append(obj)

    def _instantiate(self, graph: ctypes.c_void_p) -> None:
        exec_ = ctypes.c_void_p()
        code = libcuda().cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0)
        if code != 0:
            libcuda().cuGraphDestroy(graph)
            check_call(code, f"cuGraphInstantiateWithFlags for graph {self.name!r}")
        self._graph, self._exec = graph, exec_

    def launch(self, stream: Stream) -> None:
        if self._exec is None:
            raise StrataError(f"graph {self.name!r} is not ready: launch it after its capture "
                              "block has exited (and before the runtime closes)")
        check_call(libcuda().cuGraphLaunch(self._exec, stream.handle),
               f"cuGraphLaunch of graph {self.name!r}")

    def upload(self, stream: Stream) -> None:
        """Puts the graph's work on the device ahead of its first launch (asynchronous on
        `stream`), so the first launch costs what every later one does: the engine times one
        replay against plain launches to choose between them."""
        if self._exec is None:
            raise StrataError(f"graph {self.name!r} is not ready to upload")
        check_call(libcuda().cuGraphUpload(self._exec, stream.handle),
                   f"cuGraphUpload of graph {self.name!r}")

    def free(self) -> None:
        if self._exec is not None:
            lib = libcuda()
            lib.cuGraphExecDestroy(self._exec)
            lib.cuGraphDestroy(self._graph)
            self._exec = self._graph = None
        for obj in self._held:
            obj.free()
        self._held.clear()


def is_capturing(stream: Stream) -> bool:
    """Whether work enqueued on `stream` is being recorded into a graph now (then nothing may
    allocate or synchronize)."""
    status = ctypes.c_int()
    check_call(libcuda().cuStreamIsCapturing(stream.handle, ctypes.byref(status)),
           f"cuStreamIsCapturing on stream {stream.name!r}")
    return status.value != 0


@contextmanager
def capture(runtime: DriverContext, stream: Stream, mode: str = "thread_local") -> Iterator[Graph]:
    """Records what the body enqueues on `stream` (and on streams forked from it with events)
    instead of running it. The yielded Graph can be launched once the block has exited; on an
    error inside the block the capture is ended and discarded so the stream stays usable."""
    if mode not in CAPTURE_MODES:
        raise StrataError(f"capture mode {mode!r}; allowed: {', '.join(CAPTURE_MODES)}")
    lib = libcuda()
    result = Graph(runtime, stream.name)
    check_call(lib.cuStreamBeginCapture_v2(stream.handle, CAPTURE_MODES[mode]),
           f"cuStreamBeginCapture_v2 on stream {stream.name!r}")
    graph = ctypes.c_void_p()
    try:
        yield result
    except BaseException:
        if lib.cuStreamEndCapture(stream.handle, ctypes.byref(graph)) == 0 and graph.value:
            lib.cuGraphDestroy(graph)
        raise
    check_call(lib.cuStreamEndCapture(stream.handle, ctypes.byref(graph)),
           f"cuStreamEndCapture on stream {stream.name!r} (was the capture invalidated by a "
           "synchronizing call or a wait on an event recorded outside it?)")
    result._instantiate(graph)
