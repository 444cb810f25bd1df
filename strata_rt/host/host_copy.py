"""Host passes over a prompt's activations, spread over a few threads.

Why: a prefill call takes and returns float32 [tokens, hidden] arrays (67 MB at 8,179 tokens
of the Qwen3-30B shape). The finite check of the input, its copy into the pinned staging
buffer and the copy of the output out of it were three single-threaded numpy passes, a fifth
of a long streamed prompt's wall time with the GPU idle (bench/notes.md W24). numpy releases
the GIL inside these loops, so slices of one array run in parallel.

Results do not depend on the split: copies move bytes, and the finite check is an `all` over
slices (NaN and infinity propagate through max and min).

Opening a model fills the expert store the same way (`gather_rows` for a synthetic model's
pool, `run_each` for a GGUF file's layers): the store's first write of each page is also its
allocation (strata_rt.runtime.host_arena), so threads share the page faults as well as the
copying.

Two passes run while the GPU works instead of before or after it: `stage` copies a chunk's
input into pinned memory and checks it in the same pass (the device's upload waits for it, see
strata_rt.backends.cuda.chunk_input), and `prefault` touches every page of a fresh output array, so
the copy out at the end of a prefill does not also pay the kernel's first-touch faults.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import TypeVar

import numpy as np

#: arrays smaller than this are handled in the calling thread (a handoff costs more)
PARALLEL_MIN_BYTES = 4 << 20
#: threads at most: a few saturate a socket's memory bandwidth for plain copies
MAX_THREADS = 8
#: bytes of rows one task of gather_rows copies (many tasks: threads that finish early take
#: more, and a progress line moves)
GATHER_TASK_BYTES = 16 << 20
#: rows gathered by one fancy-indexing pass at most (its temporary stays in cache); rows
#: larger than this are copied one by one, without a temporary
GATHER_STEP_BYTES = 1 << 20

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
#: one thread apart from the pool, so that touching an output array never delays a stage
_toucher: ThreadPoolExecutor | None = None


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


def run_each(fn: Callable[[T], object], items: Sequence[T],
             done: Callable[[T], None] | None = None) -> None:
    """fn(item) for every item on the host threads, started in order; `done(item)` runs in
    the calling thread as each one finishes (a progress line). On a failure the items not
    started are dropped and, once the running ones have ended, the failure of the first
    failing item in order is raised: the error a loop over the items would have raised. `fn`
    must not itself wait on this module's passes (they share the threads)."""
    if _workers() == 1 or len(items) <= 1:
        for item in items:
            fn(item)
            if done is not None:
                done(item)
        return
    futures = [_executor().submit(fn, item) for item in items]
    which = {f: i for i, f in enumerate(futures)}
    try:
        for f in as_completed(futures):
            if f.exception() is not None:
                break
            if done is not None:
                done(items[which[f]])
    finally:
        for f in futures:
            f.cancel()  # those not started (the queue runs in order: all after a started one)
        wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


def gather_rows(dst: np.ndarray, src: np.ndarray, index: np.ndarray | None = None,
                done: Callable[[int], None] | None = None) -> None:
    """dst[i, :w] = src[index[i]] (src[i] without an index) for every row i of the 2-D dst,
    w = src.shape[1] <= dst.shape[1]; the rest of each row is left as it is. Blocks of rows
    go to the host threads, and `done(rows)` runs in the calling thread after each block. The
    bytes are those of the one-thread `dst[:, :w] = src[index]`."""
    n, w = dst.shape[0], src.shape[1]
    rows = np.arange(n) if index is None else np.asarray(index).reshape(-1)
    if rows.size != n or w > dst.shape[1] or (index is None and src.shape[0] != n):
        raise ValueError(f"gather_rows: {n} rows of {dst.shape[1]} bytes from {src.shape} "
                         f"by {None if index is None else rows.size} indices")
    per = max(1, GATHER_TASK_BYTES // max(1, w))
    step = max(1, GATHER_STEP_BYTES // max(1, w))

    def block(lo: int) -> None:
        hi = min(n, lo + per)
        if step == 1:
            for i in range(lo, hi):
                np.copyto(dst[i, :w], src[rows[i]])
            return
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            dst[a:b, :w] = src[rows[a:b]]

    starts = range(0, n, per)
    on_done = None if done is None else (lambda lo: done(min(n, lo + per) - lo))
    if dst.nbytes < PARALLEL_MIN_BYTES:
        for lo in starts:
            block(lo)
            if on_done is not None:
                on_done(lo)
        return
    run_each(block, starts, on_done)


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


def stage(dst: np.ndarray, src: np.ndarray, on_done: Callable[[], None]) -> Future[bool]:
    """Starts dst[...] = src (same shape and dtype) in parallel slices and returns whether src
    is all finite. A slice that is not finite is zeroed in dst, so whatever reads dst never
    reads NaN or infinity. `on_done` runs once, when every slice has finished (also when one
    failed), in the thread that finished last, before the result is set. Small arrays are
    staged in the calling thread."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"stage: {src.dtype} {src.shape} into {dst.dtype} {dst.shape}")
    result: Future[bool] = Future()
    flat = _flat_views(dst, src) if dst.nbytes >= PARALLEL_MIN_BYTES else None
    if flat is None or _workers() == 1:
        try:
            ok = _stage_slice(dst, src)
        except BaseException as e:
            on_done()
            result.set_exception(e)
        else:
            on_done()
            result.set_result(ok)
        return result
    d, s = flat
    parts = [_executor().submit(_stage_slice, d[sl], s[sl]) for sl in _slices(d.size, _workers())]
    left = [len(parts)]
    lock = threading.Lock()

    def finished(_: Future[bool]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            on_done()
        finally:
            failed = [e for e in (f.exception() for f in parts) if e is not None]
            if failed:
                result.set_exception(failed[0])
            else:
                result.set_result(all(f.result() for f in parts))

    for f in parts:
        f.add_done_callback(finished)
    return result


def _stage_slice(d: np.ndarray, s: np.ndarray) -> bool:
    np.copyto(d, s)
    if d.size == 0 or _finite(d):  # read back while the slice is still in cache
        return True
    d[...] = 0
    return False


def prefault(a: np.ndarray) -> Future[None]:
    """Writes one byte of every page of a fresh array in a background thread (contents are
    left undefined, as np.empty's). Wait on the future before writing the array."""
    done: Future[None] = Future()
    if a.nbytes < PARALLEL_MIN_BYTES or not a.flags.c_contiguous:
        done.set_result(None)
        return done
    global _toucher
    if _toucher is None:
        _toucher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-prefault")

    def touch() -> None:
        a.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE] = 0

    return _toucher.submit(touch)
