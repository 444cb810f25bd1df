"""Checks that a run's intermediate values stay finite, and the error that names where not.

Why: float32 fails quietly. Finite hidden states of 3e38 square to infinity, the RMSNorm
divides by it and routes zeros, every expert adds nothing, and the run used to hand back its
own input with exit 0; NaN logits argmax to token 0. A value that left float32's range is
therefore an error naming the layer, the token position and the step, never output.

Backends raise NonFiniteError with the row inside the chunk; the engine, which knows where the
chunk starts, shifts it to the prompt's position (`NonFiniteError.shifted`).
"""

from __future__ import annotations

import numpy as np

from ..errors import StrataError

#: the largest finite float32 (a mean square beyond it is infinite)
F32_MAX = float(np.finfo(np.float32).max)


class NonFiniteError(StrataError):
    """A value computed during a run is NaN or infinite: the step, layer and position."""

    def __init__(self, step: str, layer: int | None, row: int, detail: str,
                 source: str = "prefill"):
        self.step, self.layer, self.row, self.detail = step, layer, int(row), detail
        self.source = source
        where = ("output head" if layer is None else f"layer {layer}") + f", position {row}"
        super().__init__(f"{source}: {where}: {step} {detail}; the run stops instead of "
                         "returning values computed from it")

    @property
    def position(self) -> int:
        """The token position (within the prompt once the engine has shifted it)."""
        return self.row

    def shifted(self, offset: int, source: str | None = None) -> NonFiniteError:
        """The same error at position row + offset (a chunk's first position in its prompt),
        optionally naming another source (the prompt, the file)."""
        return NonFiniteError(self.step, self.layer, self.row + offset, self.detail,
                              self.source if source is None else source)


def _first_bad(bad: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first True of a 2-D mask, in row order."""
    row = int(np.argmax(bad.any(axis=-1)))
    return row, int(np.argmax(bad[row]))


def check_finite(a: np.ndarray, step: str, layer: int | None, rows: np.ndarray | None = None
                 ) -> None:
    """Raises NonFiniteError naming the first row of `a` [rows, n] holding NaN or infinity.
    `rows` maps a's rows to chunk rows (default: the identity)."""
    bad = ~np.isfinite(a)
    if not bad.any():
        return
    r, c = _first_bad(bad.reshape(a.shape[0], -1))
    value = a.reshape(a.shape[0], -1)[r, c]
    at = r if rows is None else int(rows[r])
    raise NonFiniteError(step, layer, at, f"holds {value} (column {c})")


def check_rms_input(h: np.ndarray, step: str, layer: int | None,
                    rows: np.ndarray | None = None) -> None:
    """Raises NonFiniteError when an RMSNorm over the rows of h [rows, n] cannot give a true
    result: a row holds NaN or infinity, or its mean square (computed as rms_norm computes it,
    in h's dtype) overflows, which would normalise the row to zeros."""
    check_finite(h, f"the input of {step}", layer, rows)
    with np.errstate(over="ignore"):
        ms = np.mean(np.square(h), axis=-1, dtype=h.dtype)
    bad = ~np.isfinite(ms)
    if not bad.any():
        return
    r = int(np.argmax(bad))
    c = int(np.argmax(np.abs(h[r])))
    at = r if rows is None else int(rows[r])
    raise NonFiniteError(step, layer, at, (
        f"overflows: the mean square of the row is {ms[r]} (its largest value is "
        f"{float(h[r, c]):.3g}, at column {c}; float32 holds at most {F32_MAX:.3g})"))
