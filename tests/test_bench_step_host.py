"""bench/bench_step_host.py runs on a machine without a GPU: both ways of taking a greedy
step's token, on both decode plans, time every step asked for (the figures themselves are the
benchmark's to print, not a test's to hold)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import bench_step_host  # noqa: E402


def test_both_argmax_modes_are_timed() -> None:
    host = bench_step_host.step_host_us("host", "gemv", 151_936, 20)
    device = bench_step_host.step_host_us("device", "routed", 151_936, 20)
    assert len(host) == len(device) == 20 and min(host + device) > 0
