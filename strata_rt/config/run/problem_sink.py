"""The interface a key check reports its problems through: what the checks of config/run/whole.py
and config/run/sampling.py need of schema.Problems, which imports their keys (so they cannot
import it back)."""

from __future__ import annotations

from typing import Any, Protocol


class Problems(Protocol):
    """Collects each problem under its key path (schema.Problems is the one in use)."""

    items: list[str]

    def add(self, path: str, value: Any, allowed: str) -> None: ...
