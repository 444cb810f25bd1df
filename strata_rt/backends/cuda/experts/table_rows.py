"""Rows of a device table of blob addresses, written from the host only when what a row stands
for changes: the expert table a RoutedExperts reads (routed_experts) and the products table a
LayerProducts reads (products). Both keep one row per layer, indexed by expert id.

A row is copied on the stream of the launches that read it, ahead of them, and its host copy
is kept until the next write of that row replaces it, so the copy may read it however late it
runs. The driver runs every plan plainly before it captures it, so each row is in place before
a capture, which then holds the launches alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ....runtime import Runtime, Stream


class TableRows:
    """Per row key (a layer): what the row was last written from, and its host copy."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[Hashable, np.ndarray]] = {}

    def write(self, rt: Runtime, stream: Stream, key: int, ptr: int, holds: Hashable,
              addresses: Callable[[], list[int]]) -> bool:
        """Copies row `key` to device address `ptr` on `stream` when `holds` (what the row
        stands for: a layer's sources or slots) differs from its last write; addresses()
        gives the row's entries. Whether it wrote."""
        held = self._rows.get(key)
        if held is not None and held[0] == holds:
            return False
        row = np.array(addresses(), np.uint64)
        rt.memcpy_htod(ptr, row, stream)
        self._rows[key] = (holds, row)
        return True

    def held(self, key: int) -> np.ndarray | None:
        """The host copy of row `key` as last written (None: never)."""
        held = self._rows.get(key)
        return None if held is None else held[1]
