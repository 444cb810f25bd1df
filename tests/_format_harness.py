"""What the format tests share beyond the library's group harness (strata_rt.formats.testing_groups:
GroupCase and make_case, the same cases the conformance suite runs): device round trips of a
format's MMQ on NaN-poisoned buffers."""

from __future__ import annotations

import numpy as np

from strata_rt.formats.testing_groups import GroupCase, make_case

__all__ = ["GroupCase", "make_case", "run_mmq", "untouched", "upload"]

NAN_BITS = np.uint32(0x7FC00000)


def upload(rt, stream, host: np.ndarray):
    buf = rt.alloc(max(host.nbytes, 16))
    if host.nbytes:
        rt.memcpy_htod(buf.ptr, np.ascontiguousarray(host), stream)
    return buf


def run_mmq(rt, case: GroupCase) -> np.ndarray:
    """Runs the format's MMQ on the case (images uploaded as they are, activations from the
    numpy twin), output poisoned with NaN first; returns the output."""
    stream = rt.stream("test")
    kern = case.fmt.kernels(rt, case.fmt.layout(case.hidden, case.ffn))
    out = np.full((max(case.rows, 1), case.m), np.nan, dtype=np.float32)
    acts = case.fmt.activation.device_bytes(case.acts)
    bufs = [upload(rt, stream, a) for a in (case.image.reshape(-1), acts, case.bounds, out)]
    try:
        kern.mmq(stream, bufs[0].ptr, case.expert_ids, bufs[1].ptr, bufs[2].ptr, bufs[3].ptr,
                 case.m, case.k, case.rows_hint())
        rt.memcpy_dtoh(out, bufs[3].ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    return out[: case.rows]


def untouched(out: np.ndarray, rows: np.ndarray) -> bool:
    """Whether the given output rows still hold the NaN poison bit for bit."""
    return bool((out[rows].view(np.uint32) == NAN_BITS).all())
