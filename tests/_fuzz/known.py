"""Failures the fuzzer finds in code that other branches are fixing, so that the suite stays
green until they land: each entry names the area, a pattern of the problem text and why.

A pattern is searched in `<the mutation> :: <the problem>`; a case passes as `known` only when
every one of its problems matches an entry. When a fix
lands its entry stops matching, and test_fuzz reports the entry as stale: delete it then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    area: str
    pattern: str
    reason: str

    def matches(self, problem: str) -> bool:
        return re.search(self.pattern, problem) is not None


KNOWN: tuple[Known, ...] = ()


def _texts(what: str, problems: list[str]) -> list[str]:
    """What the patterns see of each problem: the mutation, then ` :: `, then the problem."""
    return [f"{what} :: {p}" for p in problems]


def known_reason(what: str, problems: list[str]) -> str | None:
    """The reason when every problem matches a known entry (the first entry's), else None."""
    reasons = []
    for text in _texts(what, problems):
        hit = next((k for k in KNOWN if k.matches(text)), None)
        if hit is None:
            return None
        reasons.append(f"{hit.area}: {hit.reason}")
    return reasons[0] if reasons else None


def used(what: str, problems: list[str]) -> set[int]:
    """Indices of the KNOWN entries these problems match."""
    return {i for t in _texts(what, problems) for i, k in enumerate(KNOWN) if k.matches(t)}
