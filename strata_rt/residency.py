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

from .errors import ConfigError
from .runtime.memory import mib

if TYPE_CHECKING:
    from .model import Model


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
        doc = {"kind": "strata_rt routing profile", "n_layers": int(self.counts.shape[0]),
               "n_experts": int(self.counts.shape[1]), "counts": self.counts.tolist()}
        Path(path).write_text(json.dumps(doc) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
            counts = np.asarray(doc["counts"], dtype=np.int64)
            shape = (int(doc["n_layers"]), int(doc["n_experts"]))
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such profile file", source="profile") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{p}: not a strata_rt routing profile ({e}); write one with "
                              "`strata profile`", source="profile") from None
        if counts.shape != shape:
            raise ConfigError(f"{p}: counts have shape {counts.shape}, header says {shape}",
                              source="profile")
        return cls(counts)


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
