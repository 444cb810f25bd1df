"""strata_rt.host_copy: the threaded host passes give what numpy's single passes give."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt import host_copy


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
