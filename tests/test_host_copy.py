"""strata_rt.host.host_copy: the threaded host passes give what numpy's single passes give."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.host import host_copy


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def threaded(request, monkeypatch):
    """Both paths: below the size threshold, and with the threshold lowered so that a small
    array is split over threads (including slices of one element's worth of rows)."""
    if request.param:
        monkeypatch.setattr(host_copy, "PARALLEL_MIN_BYTES", 1)
        monkeypatch.setattr(host_copy, "_workers", lambda: 5)
    return request.param


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (1000, 64), (0, 8)])
def test_copy_into_equals_assignment(rng, threaded, shape):
    src = rng.standard_normal(shape).astype(np.float32)
    want = np.full(shape, np.nan, np.float32)
    want[...] = src
    got = np.full(shape, np.nan, np.float32)
    host_copy.copy_into(got, src)
    assert got.tobytes() == want.tobytes()


def test_copy_into_casts_and_reads_strided_sources_as_assignment_does(rng, threaded):
    src = rng.standard_normal((300, 40))
    got = np.zeros((300, 40), np.float32)
    host_copy.copy_into(got, src)  # float64 -> float32, as `dst[...] = src`
    assert got.tobytes() == src.astype(np.float32).tobytes()
    strided = rng.standard_normal((300, 80)).astype(np.float32)[:, ::2]
    host_copy.copy_into(got, strided)
    assert got.tobytes() == np.ascontiguousarray(strided).tobytes()
    host_copy.copy_into(got[10:20], strided[0])  # broadcast of one row
    assert (got[10:20] == strided[0]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1, 4999, 9999])
def test_all_finite_finds_any_bad_value(threaded, bad, where):
    a = np.linspace(-1e30, 1e30, 10000, dtype=np.float32).reshape(100, 100)
    assert host_copy.all_finite(a)
    a.reshape(-1)[where] = bad
    assert not host_copy.all_finite(a)
    # a strided view (checked in the calling thread) sees the bad value only in its columns
    assert host_copy.all_finite(a[:, ::3]) == (where % 100 % 3 != 0)


def test_all_finite_of_nothing_and_of_extremes(threaded):
    assert host_copy.all_finite(np.empty((0, 4), np.float32))
    big = np.full((64, 64), np.finfo(np.float32).max, np.float32)
    big[3, 3] = -np.finfo(np.float32).max
    assert host_copy.all_finite(big)


class _Opened:
    """An on_done that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (1000, 64), (0, 8)])
def test_stage_copies_checks_and_opens_once(rng, threaded, shape):
    src = rng.standard_normal(shape).astype(np.float32)
    dst = np.full(shape, np.nan, np.float32)
    opened = _Opened()
    assert host_copy.stage(dst, src, opened).result(timeout=30) is True
    assert dst.tobytes() == src.tobytes()
    assert opened.calls == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1, 4999, 9999])
def test_stage_zeroes_what_is_not_finite(threaded, bad, where):
    """The device reads dst: a slice holding a bad value reaches it as zeros, the others as
    they were, and the verdict says the input was not finite."""
    src = np.linspace(-1e30, 1e30, 10000, dtype=np.float32).reshape(100, 100)
    src.reshape(-1)[where] = bad
    dst = np.full_like(src, np.nan)
    opened = _Opened()
    assert host_copy.stage(dst, src, opened).result(timeout=30) is False
    assert opened.calls == 1
    assert np.isfinite(dst).all()
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    copied = flat_dst == flat_src
    assert not copied[where] and flat_dst[where] == 0
    # whatever was not copied is zero, in whole slices: at most the slice around `where`
    assert (flat_dst[~copied] == 0).all()
    if threaded:
        assert copied.sum() >= flat_src.size - -(-flat_src.size // 5)


def test_stage_opens_even_when_a_slice_fails(threaded, monkeypatch):
    """A failed copy must still open the gate (or the device would wait forever), and the
    failure reaches whoever takes the result."""
    real = host_copy._stage_slice
    seen = []

    def failing(d, s):
        seen.append(d.size)
        if len(seen) == 2 or not threaded:
            raise MemoryError("slice failed")
        return real(d, s)

    monkeypatch.setattr(host_copy, "_stage_slice", failing)
    src = np.ones((100, 100), np.float32)
    opened = _Opened()
    fut = host_copy.stage(np.empty_like(src), src, opened)
    with pytest.raises(MemoryError, match="slice failed"):
        fut.result(timeout=30)
    assert opened.calls == 1


def test_stage_refuses_another_shape_or_dtype():
    with pytest.raises(ValueError, match="stage"):
        host_copy.stage(np.empty((4, 4), np.float32), np.empty((4, 5), np.float32), lambda: None)
    with pytest.raises(ValueError, match="stage"):
        host_copy.stage(np.empty((4, 4), np.float32), np.empty((4, 4)), lambda: None)


def test_prefault_touches_and_leaves_the_array_usable(threaded, rng):
    a = np.empty((513, 1024), np.float32)
    host_copy.prefault(a).result(timeout=30)
    src = rng.standard_normal(a.shape).astype(np.float32)
    host_copy.copy_into(a, src)
    assert a.tobytes() == src.tobytes()
    host_copy.prefault(a[:, ::2]).result(timeout=30)  # strided: nothing to do, no error
