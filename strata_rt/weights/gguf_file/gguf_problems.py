"""The problem lines of one GGUF file: the first few kept, every one counted.

A message lists a file's first MAX_PROBLEMS problems and counts the rest. A header of a million
tensor entries with a bad type would otherwise build a million lines (some 80 MB) to print 20,
so the checks collect into `Problems`, which keeps only the lines a message can show and an
exact count of the others. It stands in for a list where the checks used one: `append`,
`extend`, `+` and `+=` (with lists or other `Problems`, in order), `len` (the exact count),
iteration (the kept lines), truth and `==`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

#: problems of one file listed one by one; the rest are counted
MAX_PROBLEMS = 20


class Problems:
    """Problem lines in the order found: the first `keep` kept, `len()` the exact count."""

    def __init__(self, lines: Iterable[str] = (), keep: int = MAX_PROBLEMS):
        self.keep = keep
        self.lines: list[str] = []
        self.total = 0
        self.extend(lines)

    def append(self, line: str) -> None:
        self.total += 1
        if len(self.lines) < self.keep:
            self.lines.append(line)

    def extend(self, more: Iterable[str]) -> None:
        if isinstance(more, Problems):
            # its lines are its first ones (all of them, or at least `keep`), so the first
            # lines of the two in a row are ours, then its
            self.lines += more.lines[:max(0, self.keep - len(self.lines))]
            self.total += more.total
            return
        for line in more:
            self.append(line)

    def __iadd__(self, more: Iterable[str]) -> Problems:
        self.extend(more)
        return self

    def __add__(self, more: Iterable[str]) -> Problems:
        out = Problems(self, self.keep)
        out.extend(more)
        return out

    def __radd__(self, before: Iterable[str]) -> Problems:
        out = Problems(before, self.keep)
        out.extend(self)
        return out

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines)

    def __bool__(self) -> bool:
        return self.total > 0

    def __eq__(self, other: object) -> bool:
        """Equal to a list (or Problems) of the same lines, when none were dropped."""
        if isinstance(other, Problems):
            return (self.lines, self.total) == (other.lines, other.total)
        if isinstance(other, list):
            return self.total == len(self.lines) and self.lines == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Problems({self.lines!r}, total={self.total})"
