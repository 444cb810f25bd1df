"""Which experts live in VRAM slots for the whole prompt, and the routing profiles that
choose them.

With a profile, the resident set is the globally most-routed (layer, expert) pairs (ties: lower
layer, then lower expert id). Without one, the documented default spreads the slots evenly over
the layers (the first `n % n_layers` layers get one more) and takes each layer's lowest expert
ids: with no routing evidence every expert is equally likely, and the even spread keeps every
layer's streamed share the same. Slots are numbered in (layer, expert) order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ...config.files.input_files import DATA_LIMIT, InputFileError, read_text
from ...errors import ConfigError
from ...runtime.memory import mib
from ..plan import HOST, RESIDENT, Source

if TYPE_CHECKING:
    from ...weights.model import Model


@dataclass
class RoutingProfile:
    """Routing counts [n_layers, n_experts] from a calibration prompt (top-k hits)."""

    counts: np.ndarray

    def __post_init__(self) -> None:
        c = np.asarray(self.counts)
        if c.ndim != 2 or (c.size and (c < 0).any()):
            raise ConfigError(f"a routing profile needs non-negative counts [n_layers, "
                              f"n_experts], got shape {c.shape}", source="profile")
        self.counts = c.astype(np.int64)

    def save(self, path: str | Path) -> None:
        """Writes the profile atomically (a reader never sees half of one); the path was
        checked as an output before the run (strata_rt.config.files.paths)."""
        from ...config.files.paths import write_text_atomic

        doc = {"kind": "strata_rt routing profile", "n_layers": int(self.counts.shape[0]),
               "n_experts": int(self.counts.shape[1]), "counts": self.counts.tolist()}
        write_text_atomic(Path(path), json.dumps(doc) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        """A profile `save` wrote. Counts are whole numbers 0..2^62 written as JSON integers:
        1.5 or 1e30 are refused, not rounded or overflowed; a key given twice is refused."""
        p = Path(path)
        try:
            doc = json.loads(read_text(p, DATA_LIMIT, "a routing profile (JSON)"),
                             object_pairs_hook=_unique_keys, parse_constant=_no_constant)
            if not isinstance(doc, dict):
                raise ValueError(f"expected a JSON object, found {type(doc).__name__}")
            shape = (_count(doc["n_layers"], "n_layers"), _count(doc["n_experts"],
                                                                  "n_experts"))
            counts = _counts(doc["counts"])
        except InputFileError as e:
            raise ConfigError(f"{p}: no such profile file" if e.why == "no such file"
                              else f"{p}: {e.why}", source="profile") from None
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise ConfigError(f"{p}: not a strata_rt routing profile ({why}); write one with "
                              "`strata profile`", source="profile") from None
        if counts.shape != shape:
            raise ConfigError(f"{p}: counts have shape {counts.shape}, header says {shape}",
                              source="profile")
        return cls(counts)


#: the largest routing count a profile may hold (sums of counts stay inside int64)
MAX_COUNT = 1 << 62


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a count")


def _count(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
        raise ValueError(f"{what} {shown} is not a whole number 0..2^62")
    return v


def _counts(rows: object) -> np.ndarray:
    """counts [n_layers][n_experts] of JSON integers -> int64, each checked (numpy would
    truncate 1.5 to 1 and fail on 1e30 with its own words)."""
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError("counts must be a list of lists (one per layer)")
    width = len(rows[0]) if rows else 0
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"layer {i} has {len(row)} counts, layer 0 has {width}")
        for e, v in enumerate(row):
            _count(v, f"the count of layer {i}, expert {e},")
    return np.array(rows, dtype=np.int64).reshape(len(rows), width)


class Residency:
    def __init__(self, n_layers: int, n_experts: int, pairs: Iterable[tuple[int, int]],
                 slot_bytes: int):
        self.n_layers, self.n_experts, self.slot_bytes = n_layers, n_experts, slot_bytes
        self.pairs = sorted({(int(layer), int(e)) for layer, e in pairs})
        self._slot = np.full((n_layers, n_experts), -1, dtype=np.int64)
        for i, (layer, e) in enumerate(self.pairs):
            if not (0 <= layer < n_layers and 0 <= e < n_experts):
                raise ValueError(f"resident pair layer {layer} expert {e} outside the model")
            self._slot[layer, e] = i

    @property
    def n_slots(self) -> int:
        return len(self.pairs)

    count = n_slots

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    def slot(self, layer: int, e: int) -> int | None:
        s = int(self._slot[layer, e])
        return None if s < 0 else s

    def source(self, layer: int, e: int) -> Source:
        """Where a decode step's launch reads the expert without a ring: its resident slot,
        else the host store (plan.Source)."""
        s = self.slot(layer, e)
        return (HOST, 0) if s is None else (RESIDENT, s)

    def mask(self) -> np.ndarray:
        """bool [n_layers, n_experts]: True where resident."""
        return self._slot >= 0

    # ------------------------------------------------------------------ choosing
    @classmethod
    def from_budget(cls, model: Model, n_slots: int, profile: RoutingProfile | None = None
                    ) -> Residency:
        spec = model.spec
        L, E = spec.n_layers, spec.n_experts
        n = max(0, min(int(n_slots), L * E))
        if profile is not None:
            if profile.counts.shape != (L, E):
                raise ConfigError(f"routing profile has shape {profile.counts.shape}, the model "
                                  f"has {L} layers x {E} experts", source="profile")
            # descending count; ties to lower layer, lower expert (stable over flat order)
            order = np.argsort(-profile.counts.reshape(-1), kind="stable")[:n]
            pairs = [(int(i) // E, int(i) % E) for i in order]
        else:
            per = [n // L + (1 if layer < n % L else 0) for layer in range(L)]
            pairs = [(layer, e) for layer in range(L) for e in range(per[layer])]
        return cls(L, E, pairs, model.layout.slot_bytes)

    # ------------------------------------------------------------------ reporting
    def report(self) -> str:
        m = self.mask()
        per = m.sum(axis=1)
        lines = [f"resident experts: {self.n_slots} of {self.n_layers * self.n_experts} "
                 f"({mib(self.nbytes)} MiB, {self.slot_bytes} bytes per slot)",
                 "layer  resident  MiB"]
        lines += [f"{layer:5d}  {int(c):8d}  {mib(c * self.slot_bytes)}"
                  for layer, c in enumerate(per)]
        return "\n".join(lines)
