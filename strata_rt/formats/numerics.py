"""Error measures shared by the conformance suite, the tests and the benchmarks, so every
"NMSE <= x" in the project means the same number."""

from __future__ import annotations

import numpy as np


def nmse(got: np.ndarray, want: np.ndarray, weight: np.ndarray | float | None = None) -> float:
    """Normalised squared error sum(w*(got-want)^2) / sum(w*want^2), in float64.

    `weight` (broadcast against the arrays, e.g. a per-column importance) defaults to 1. A zero
    reference gives 0.0 when `got` is zero too and inf otherwise (no error is small next to
    nothing); NaN anywhere in `got` gives NaN, so a bound `nmse(...) <= x` fails on it."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    if g.shape != w.shape:
        raise ValueError(f"nmse of arrays of shapes {g.shape} and {w.shape}")
    k = 1.0 if weight is None else np.asarray(weight, dtype=np.float64)
    err = float(np.sum(k * (g - w) ** 2))
    ref = float(np.sum(k * w * w))
    if ref > 0:
        return err / ref
    if err == 0:
        return 0.0
    return float("nan") if np.isnan(err) else float("inf")
