"""Copies a kernel switches on or off inside a captured CUDA graph (conditional IF nodes).

A routed walk copies an expert only if its layer's routing, computed on the device a moment
before, gave it rows, and the host never waits to learn that. CUDA graphs (driver 12.4 and
later) let a kernel set the condition of an IF node (cudaGraphSetConditional) whose body is
one host-to-device copy: the copy engine then moves exactly the routed experts, in stream
order, at its own rate. Each switched copy therefore becomes, while its stream is captured:

1. an IF node appended to the stream's capture, its condition handle created with the graph
   (default 1 at every launch: a switch no kernel set copies, which is merely slower);
2. the node's body graph, filled by capturing one copy on a side stream into it;
3. the stream's capture continuing from the node.

The handles exist only once the copies are captured, after the kernel that sets them was, so
the kernel reads them from a device table (`CopySwitches`) that is filled after the capture,
before the first launch. pycuda has no graph API; these are driver calls through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import numpy as np

from ..errors import StrataError
from .driver_api import check_call, libcuda

if TYPE_CHECKING:
    from .device import Runtime
    from .streams import Stream

#: the first driver with conditional nodes whose bodies may hold copies
MIN_DRIVER = 12040
_NODE_CONDITIONAL, _COND_IF, _ASSIGN_DEFAULT, _SET_DEPENDENCIES = 13, 0, 1, 1
_CAPTURE_RELAXED = 2


class _ConditionalParams(ctypes.Structure):
    """CUgraphNodeParams (256 bytes) with the conditional member of its union laid out."""

    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3),
                ("handle", ctypes.c_ulonglong), ("cond_type", ctypes.c_int),
                ("size", ctypes.c_uint), ("graph_out", ctypes.POINTER(ctypes.c_void_p)),
                ("ctx", ctypes.c_void_p), ("pad", ctypes.c_longlong * 25),
                ("reserved2", ctypes.c_longlong)]


@functools.lru_cache(maxsize=1)
def conditional_copies_supported() -> bool:
    """Whether the installed driver runs conditional nodes with copies in their bodies."""
    version = ctypes.c_int()
    try:
        lib = libcuda()
    except OSError:
        return False
    return lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value >= MIN_DRIVER


class CopySwitches:
    """The switched copies of one captured graph: entry i's condition handle and expert in a
    device table (handles uint64 [n], then experts int32 [n]) that a switching kernel reads.
    Allocate it before the capture (a capture refuses allocations), call `copy` for each
    switched copy and `set_expert` for each entry while capturing, then `upload` once the
    capture has ended. It must outlive the graph (Graph.hold)."""

    def __init__(self, rt: Runtime, n_entries: int, side: Stream):
        self.n = int(n_entries)
        self._rt = rt
        self._side = side
        self._buf = rt.alloc(self.n * 12)
        self.handles = np.zeros(self.n, np.uint64)
        self.experts = np.full(self.n, -1, np.int32)
        self._captured = np.zeros(self.n, bool)
        self._ctx = ctypes.c_void_p()
        check_call(libcuda().cuCtxGetCurrent(ctypes.byref(self._ctx)), "cuCtxGetCurrent")

    def handles_ptr(self, entry: int) -> int:
        return self._buf.ptr + 8 * int(entry)

    def experts_ptr(self, entry: int) -> int:
        return self._buf.ptr + 8 * self.n + 4 * int(entry)

    def set_expert(self, entry: int, expert: int) -> None:
        self.experts[entry] = expert

    def copy(self, stream: Stream, entry: int, dst: int, src_host: int, nbytes: int) -> None:
        """Appends to `stream`'s capture a copy of nbytes from page-locked host address
        `src_host` to device address `dst` that runs only while entry's switch is on."""
        lib = libcuda()
        status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), ctypes.c_void_p()
        deps, n_deps = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        check_call(lib.cuStreamGetCaptureInfo_v3(stream.handle, ctypes.byref(status),
                                                 ctypes.byref(cid), ctypes.byref(graph),
                                                 ctypes.byref(deps), None, ctypes.byref(n_deps)),
                   f"cuStreamGetCaptureInfo on stream {stream.name!r}")
        if status.value != 1:
            raise StrataError(f"a switched copy needs stream {stream.name!r} to be captured")
        handle = ctypes.c_ulonglong()
        check_call(lib.cuGraphConditionalHandleCreate(ctypes.byref(handle), graph, self._ctx,
                                                      1, _ASSIGN_DEFAULT),
                   "cuGraphConditionalHandleCreate")
        params = _ConditionalParams(type=_NODE_CONDITIONAL, handle=handle.value,
                                    cond_type=_COND_IF, size=1, ctx=self._ctx)
        node = ctypes.c_void_p()
        waits = (ctypes.c_void_p * max(1, n_deps.value))(*(deps[i] for i in range(n_deps.value)))
        check_call(lib.cuGraphAddNode_v2(ctypes.byref(node), graph, waits, None, n_deps.value,
                                         ctypes.byref(params)), "cuGraphAddNode (conditional)")
        body = params.graph_out[0]
        side = self._side.handle
        check_call(lib.cuStreamBeginCaptureToGraph(side, body, None, None, 0, _CAPTURE_RELAXED),
                   "cuStreamBeginCaptureToGraph (a switched copy's body)")
        code = lib.cuMemcpyHtoDAsync_v2(dst, ctypes.c_void_p(src_host), nbytes, side)
        ended = ctypes.c_void_p()
        end = lib.cuStreamEndCapture(side, ctypes.byref(ended))
        check_call(code, "cuMemcpyHtoDAsync (a switched copy)")
        check_call(end, "cuStreamEndCapture (a switched copy's body)")
        after = (ctypes.c_void_p * 1)(node)
        check_call(lib.cuStreamUpdateCaptureDependencies_v2(stream.handle, after, None, 1,
                                                            _SET_DEPENDENCIES),
                   f"cuStreamUpdateCaptureDependencies on stream {stream.name!r}")
        self.handles[entry] = handle.value
        self._captured[entry] = True

    def upload(self, stream: Stream) -> None:
        """The table, once the capture has ended (every entry given its handle and expert)."""
        missing = np.flatnonzero(~self._captured | (self.experts < 0))
        if missing.size:
            raise StrataError(f"switched copies: entries {missing[:8].tolist()} were captured "
                              "without a copy or an expert")
        table = np.concatenate([self.handles.view(np.uint8), self.experts.view(np.uint8)])
        self._rt.memcpy_htod(self._buf.ptr, table, stream)
        stream.synchronize()  # the table is a temporary host array

    def free(self) -> None:
        self._buf.free()
