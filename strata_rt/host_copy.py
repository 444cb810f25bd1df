"""Host passes over a prompt's activations, spread over a few threads.

Why: a prefill call takes and returns float32 [tokens, hidden] arrays (67 MB at 8,179 tokens
of the Qwen3-30B shape). The finite check of the input, its copy into the pinned staging
buffer and the copy of the output out of it were three single-threaded numpy passes, a fifth
of a long streamed prompt's wall time with the GPU idle (bench/notes.md W24). numpy releases
the GIL inside these loops, so slices of one array run in parallel.

Results do not depend on the split: copies move bytes, and the finite check is an `all` over
slices (NaN and infinity propagate through max and min).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: arrays smaller than this are handled in the calling thread (a handoff costs more)
PARALLEL_MIN_BYTES = 4 << 20
#: threads at most: a few saturate a socket's memory bandwidth for plain copies
MAX_THREADS = 8

_pool: ThreadPoolExecutor | None = None


def _workers() -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="strata-host")
    return _pool


def _slices(n: int, parts: int) -> list[slice]:
    step = -(-n // parts)
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _flat_views(*arrays: np.ndarray) -> list[np.ndarray] | None:
    """1-D views of C-contiguous arrays of one size, or None when one is not contiguous."""
    if any(not a.flags.c_contiguous for a in arrays):
        return None
    return [a.reshape(-1) for a in arrays]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, in parallel slices when both are contiguous, large, and of one shape
    and dtype (otherwise numpy's own assignment, casting and broadcasting as `dst[...] = src`
    does)."""
    same = dst.shape == src.shape and dst.dtype == src.dtype
    flat = _flat_views(dst, src) if same and dst.nbytes >= PARALLEL_MIN_BYTES else None
    if flat is None or _workers() == 1:
        np.copyto(dst, src, casting="unsafe")
        return
    d, s = flat
    parts = _slices(d.size, _workers())
    list(_executor().map(lambda sl: np.copyto(d[sl], s[sl]), parts))


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of a float array is finite (no NaN, no infinity)."""
    if a.size == 0:
        return True
    flat = _flat_views(a) if a.nbytes >= PARALLEL_MIN_BYTES else None
    if flat is None or _workers() == 1:
        return _finite(a)
    (x,) = flat
    return all(_executor().map(lambda sl: _finite(x[sl]), _slices(x.size, _workers())))


def _finite(x: np.ndarray) -> bool:
    """max and min propagate NaN and keep infinities, and allocate nothing the size of x."""
    return bool(np.isfinite(x.max()) and np.isfinite(x.min()))
