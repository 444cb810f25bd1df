"""A layer split: the model's layers cut into contiguous ranges, one per device, each device
streaming its own layers' experts over its own PCIe link.

Plain data, like a Plan: `LayerSplit` says which layers each part (one Runtime, one executor)
runs and on which device; `Part` is one of them as its planners see it, and knows the ops that
open and close its chunk plans. The first part takes the chunk's input (ChunkInput); every
later part opens with a HandOff from the part before it (plan.HandOff says how the two plans
are ordered). The parts are numbered in layer order; the device index is only where a part
runs, so `devices: [0, 0]` (two parts on one GPU) is a split like any other to the planners.

The split rule (choose_split): every device holds the same kind of budget (the config's VRAM
keys apply per device), so its resident capacity in bytes is known before the split; a part
streams, per chunk of the walk, every byte of its layers' experts that its capacity does not
hold. The cut minimises the largest such streamed share (the slowest link sets the pace), and
among cuts that stream equally it balances the layers' expert bytes, which also balances
compute. Which experts a part keeps resident is then chosen inside its own layers from the
routing profile, exactly as one device chooses over all layers (part_residency).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError
from ..plan import (
    ChunkInput,
    HandOff,
    InputKind,
    Op,
    Record,
    Wait,
    handoff_ready,
    handoff_taken,
)
from ..vram.residency import Residency, RoutingProfile

if TYPE_CHECKING:
    from ...weights.model import Model

#: the most devices a split may name (one host's GPUs)
MAX_DEVICES = 16


def parse_devices(value: object, where: str = "devices",
                  repeats: bool = False) -> tuple[int, ...]:
    """A `devices` setting -> the device indices: a list of distinct non-negative integers,
    or (command line) the same as text "0,1". ConfigError naming what is wrong otherwise.
    repeats: a device may be named more than once (EngineConfig.repeat_devices, for tests:
    two parts on one GPU run the hand-off path without a second GPU)."""
    items: list[object]
    if isinstance(value, str):
        texts = [v.strip() for v in value.split(",")]
        if not all(v.isdigit() for v in texts):
            raise ConfigError(f"{where}: got {value!r}; expected device indices like 0,1",
                              source=where)
        items = [int(v) for v in texts]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ConfigError(f"{where}: got {value!r}; expected a list of device indices such "
                          "as [0, 1]", source=where)
    if not items:
        raise ConfigError(f"{where}: the list is empty; give at least one device, e.g. [0]",
                          source=where)
    devices: list[int] = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{where}: {v!r} is not a device index (an integer >= 0)",
                              source=where)
        devices.append(v)
    if not repeats and len(set(devices)) != len(devices):
        raise ConfigError(f"{where}: {devices} names a device twice; each GPU holds "
                          "one part of the layers", source=where)
    if len(devices) > MAX_DEVICES:
        raise ConfigError(f"{where}: {len(devices)} devices; at most {MAX_DEVICES}",
                          source=where)
    return tuple(devices)


@dataclass(frozen=True)
class Part:
    """Part `index` of `n_parts`: layers first..end-1 on device `device`."""

    index: int
    n_parts: int
    device: int
    first: int
    end: int

    @property
    def layers(self) -> range:
        return range(self.first, self.end)

    @property
    def receives(self) -> bool:
        """Whether the chunk's residual comes from the part before (else: the input)."""
        return self.index > 0

    @property
    def sends(self) -> bool:
        """Whether the part after it takes this part's residual."""
        return self.index < self.n_parts - 1

    @property
    def last(self) -> bool:
        """The part that runs a whole model's output head."""
        return not self.sends

    def prologue(self, kind: InputKind = "hidden") -> list[Op]:
        """The ops that bring the chunk's hidden states to this part's device: the first
        part's ChunkInput of `kind`, the others' hand-off. A sender first waits until its
        receiver copied the previous chunk's residual (handoff_taken; the first chunk's wait
        finds no record, which CUDA treats as already complete)."""
        ops: list[Op] = []
        if self.sends:
            ops.append(Wait(handoff_taken(self.end), "compute"))
        if not self.receives:
            return [*ops, ChunkInput(kind)]
        return [*ops, Wait(handoff_ready(self.first), "compute"),
                HandOff(self.first, self.index - 1, self.index),
                Record(handoff_taken(self.first), "compute")]

    def epilogue(self) -> list[Op]:
        """The ops after the part's last LayerEnd: the residual is final for the receiver."""
        return [Record(handoff_ready(self.end), "compute")] if self.sends else []


#: the whole model on one device, as every single-device planner sees it
def whole_part(n_layers: int, device: int = 0) -> Part:
    return Part(0, 1, device, 0, n_layers)


@dataclass(frozen=True)
class LayerSplit:
    """devices[i] runs layers bounds[i]..bounds[i+1]-1."""

    devices: tuple[int, ...]
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) != len(self.devices) + 1 or b[0] != 0 or any(
                hi <= lo for lo, hi in zip(b, b[1:])):
            raise ValueError(f"split bounds {b} for devices {self.devices}: each part needs "
                             "at least one layer, in order from layer 0")

    @property
    def n_layers(self) -> int:
        return self.bounds[-1]

    @property
    def parts(self) -> list[Part]:
        n = len(self.devices)
        return [Part(i, n, d, self.bounds[i], self.bounds[i + 1])
                for i, d in enumerate(self.devices)]

    def part_of(self, layer: int) -> Part:
        for p in self.parts:
            if layer in p.layers:
                return p
        raise ValueError(f"layer {layer} outside the split's {self.n_layers} layers")

    def describe(self, resident_bytes: Sequence[int] | None = None) -> list[str]:
        """One line per part: its device, its layers and (when known) its resident bytes."""
        lines = []
        for i, p in enumerate(self.parts):
            res = "" if resident_bytes is None else (
                f", {resident_bytes[i] / (1 << 20):.1f} MiB of resident experts")
            lines.append(f"device {p.device}: layers {p.first}..{p.end - 1} "
                         f"({p.end - p.first} layers){res}")
        return lines


def choose_split(layer_bytes: Sequence[int], devices: Sequence[int],
                 capacity_bytes: Sequence[int]) -> LayerSplit:
    """The cut of the layers (each `layer_bytes[l]`: the bytes of all its experts) over
    `devices`, device i holding `capacity_bytes[i]` of resident experts: contiguous ranges
    minimising (largest streamed share, largest layer bytes), by dynamic programming over
    the cut points (O(parts x layers^2): a few hundred thousand steps for 94 layers on 8
    GPUs). Raises ConfigError when there are fewer layers than devices."""
    L, P = len(layer_bytes), len(devices)
    if P > L:
        raise ConfigError(f"devices: {P} devices for {L} layers; each device needs at least "
                          "one layer", source="devices")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(layer_bytes, dtype=np.int64))])
    inf = (float("inf"), float("inf"))
    # best[p][l]: the best cost of layers 0..l-1 over parts 0..p-1, and the cut it came from
    best: list[list[tuple[tuple[float, float], int]]] = [[(inf, -1)] * (L + 1)
                                                         for _ in range(P + 1)]
    best[0][0] = ((0.0, 0.0), -1)
    for p in range(1, P + 1):
        cap = int(capacity_bytes[p - 1])
        for hi in range(p, L - (P - p) + 1):
            for lo in range(p - 1, hi):
                prev = best[p - 1][lo][0]
                if prev == inf:
                    continue
                size = int(prefix[hi] - prefix[lo])
                cost = (max(prev[0], max(0, size - cap)), max(prev[1], size))
                if cost < best[p][hi][0]:
                    best[p][hi] = (cost, lo)
    bounds = [L]
    for p in range(P, 0, -1):
        bounds.append(best[p][bounds[-1]][1])
    return LayerSplit(tuple(devices), tuple(reversed(bounds)))


def part_residency(model: Model, part: Part, n_slots: int,
                   profile: RoutingProfile | None = None) -> Residency:
    """The experts part `part` keeps resident: n_slots of its own layers, chosen as
    Residency.from_budget chooses over the whole model (the most-routed pairs of the profile,
    else an even spread of the lowest ids), and numbered from 0 on its device."""
    spec = model.spec
    lo, hi = part.first, part.end
    E = spec.n_experts
    n = max(0, min(int(n_slots), (hi - lo) * E))
    if profile is not None:
        if profile.counts.shape != (spec.n_layers, E):
            raise ConfigError(f"routing profile has shape {profile.counts.shape}, the model "
                              f"has {spec.n_layers} layers x {E} experts", source="profile")
        order = np.argsort(-profile.counts[lo:hi].reshape(-1), kind="stable")[:n]
        pairs = [(lo + int(i) // E, int(i) % E) for i in order]
    else:
        count = hi - lo
        per = [n // count + (1 if k < n % count else 0) for k in range(count)]
        pairs = [(lo + k, e) for k in range(count) for e in range(per[k])]
    return Residency(spec.n_layers, E, pairs, model.layout.slot_bytes)


def model_split(model: Model, devices: Sequence[int], n_slots: int | None) -> LayerSplit:
    """The split an engine opens with: each device's capacity `n_slots` resident experts
    (the config's expert_cache, per device; None: none, as the reference backend keeps)."""
    layer_bytes = [lay.blob_bytes * model.spec.n_experts for lay in model.formats.layouts]
    cap = (n_slots or 0) * model.layout.slot_bytes
    return choose_split(layer_bytes, devices, [cap] * len(devices))
