"""Pieces the grouped-matmul launchers and their numpy mirrors share across plugins.

Every MMQ kernel takes the group's expert ids by value (16 int32 parameters, unused = -1) and
reads each expert's row range from `bounds`; these helpers keep that contract in one place.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats import MMQ_GROUP


def ids16(expert_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The 16 int32 kernel parameters for a group (unused positions = -1)."""
    n = len(expert_ids)
    if not 0 < n <= MMQ_GROUP:
        raise FormatError(f"an MMQ group holds 1..{MMQ_GROUP} experts, got {n}")
    if min(expert_ids) < 0:
        raise FormatError(f"expert ids must be >= 0, got {tuple(expert_ids)}")
    return tuple(int(e) for e in expert_ids) + (-1,) * (MMQ_GROUP - n)


def grid_rows(rows_hint: int, tile_rows: int) -> int:
    """Row tiles per expert in the launch grid; the kernel reads exact counts from bounds."""
    if rows_hint < 0:
        raise FormatError(f"rows_hint must be >= 0, got {rows_hint}")
    return (rows_hint + tile_rows - 1) // tile_rows


def check_aligned(names_and_values: dict[str, int], align: int = 16) -> None:
    """Vectorized kernels load and store 16 bytes at a time; a misaligned address would fault
    on the device, so it is refused on the host with the offending value."""
    bad = {k: v for k, v in names_and_values.items() if v % align}
    if bad:
        detail = ", ".join(f"{k}={v:#x}" for k, v in bad.items())
        raise FormatError(f"device address(es) not {align}-byte aligned: {detail}")


def expert_rows(expert_ids: tuple[int, ...], bounds: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(group position, first row, end row) for each expert of a group, as the kernels read
    them from bounds."""
    b = np.asarray(bounds, dtype=np.int64)
    for p, e in enumerate(expert_ids):
        yield p, int(b[e]), int(b[e + 1])
