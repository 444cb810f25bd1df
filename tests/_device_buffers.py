"""Device buffers for kernel tests: upload an array, allocate an output poisoned with 0xFF
(with a tail past its end), read it back checking the tail stayed poisoned. One copy for every
test module that launches kernels directly."""

from __future__ import annotations

import numpy as np

#: bytes past the end of every poisoned output, checked to stay 0xFF
TAIL_BYTES = 256


def upload(rt, stream, arr):
    """A device copy of `arr` (C-contiguous), enqueued on `stream`."""
    arr = np.ascontiguousarray(arr)
    buf = rt.alloc(arr.nbytes)
    rt.memcpy_htod(buf.ptr, arr, stream)
    return buf


def poisoned(rt, stream, nbytes):
    """nbytes of output (and TAIL_BYTES more) filled with 0xFF: unwritten bytes read as NaN."""
    buf = rt.alloc(nbytes + TAIL_BYTES)
    rt.memset_d8(buf.ptr, 0xFF, nbytes + TAIL_BYTES, stream)
    return buf


def download(rt, stream, buf, dtype, shape, check_tail=True):
    """The first prod(shape) values of a buffer; with check_tail (a buffer from `poisoned`)
    also reads its tail and asserts nothing wrote past them. Without it only the values are
    read, so a buffer of exactly their size (from `upload`) can be read back."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    host = np.empty(n + (TAIL_BYTES if check_tail else 0), np.uint8)
    rt.memcpy_dtoh(host, buf.ptr, stream)
    stream.synchronize()
    if check_tail:
        assert (host[n:] == 0xFF).all(), "a kernel wrote past the end of its output"
    return host[:n].view(dtype).reshape(shape)


def launch_poisoned(rt, stream, run, rows: int, m: int) -> np.ndarray:
    """run(out pointer) into a freshly poisoned float32 output [rows, m] (0xFF: NaN); the raw
    uint32 words it left, the tail checked untouched."""
    out = poisoned(rt, stream, max(rows, 1) * m * 4)
    try:
        run(out.ptr)
        return download(rt, stream, out, np.uint32, (max(rows, 1), m))[:rows]
    finally:
        out.free()
