"""What a plan's ops add to a chunk's counters: how many ops of each kind, the bytes its copies
move, and the Stats fields those give (experts and bytes streamed, gather and matmul launches).
Where what a plan streams depends on the routing (the routed plan, the routed walk, the decode
plan), the routed non-resident experts and their bytes come from the chunk's routing, read
back after the chunk (`with_routing`; a short walk uses it too, to measure what it routed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..report.stats import Stats
from .plan import (
    Copy,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerProducts,
    Op,
    Products,
    RoutedExperts,
)

if TYPE_CHECKING:
    from ..weights.model import MoESpec
    from .executor import Executor


def op_counts(ops: Iterable[Op]) -> dict[type, int]:
    """How many ops of each kind a plan (or a layer of it) holds. A routed Copy is left out:
    whether it copies is known only from the routing, which with_routing counts instead."""
    counts: dict[type, int] = {}
    for op in ops:
        if not (isinstance(op, Copy) and op.routed):
            counts[type(op)] = counts.get(type(op), 0) + 1
    return counts


def copy_bytes(ops: Iterable[Op], layer_blob_bytes: tuple[int, ...]) -> int:
    """Bytes the Copy ops of a plan always move (each its layer's blob; routed ones left out,
    as op_counts leaves them)."""
    return sum(layer_blob_bytes[op.layer] for op in ops if isinstance(op, Copy) and not op.routed)


def add_counts(stats: Stats, counts: dict[type, int], copied: int) -> None:
    """The counters a plan's ops add: every Copy streams one blob (`copied` bytes in all),
    every gather op is one launch, every Products, LayerProducts and RoutedExperts two matmul
    launches (gate/up and down; a LayerProducts' two cover its whole layer, where its parts
    would have launched two per group)."""
    copies = counts.get(Copy, 0)
    stats.experts_streamed += copies
    stats.bytes_streamed += copied
    stats.gathers_launched += (counts.get(Gather, 0) + counts.get(GatherBatch, 0)
                               + counts.get(GatherRouted, 0))
    stats.mmq_launches += 2 * (counts.get(Products, 0) + counts.get(LayerProducts, 0)
                               + counts.get(RoutedExperts, 0))


def with_routing(stats: Stats, ex: Executor, spec: MoESpec, run: Callable[[], None],
                 then: Callable[[int, int], None]) -> Callable[[], None]:
    """Runs `run()` with stats.routing_counts kept (made for the call where the caller did not
    ask for it) and returns what reads the chunk's routing after the chunk's end (the executor
    adds its routing once it has waited for the chunk): it hands `then` the routed
    non-resident experts of the chunk and their bytes, what its gathers read over PCIe."""
    own = stats.routing_counts is None
    if own:
        stats.routing_counts = np.zeros((spec.n_layers, spec.n_experts), np.int64)
    counts = stats.routing_counts
    assert counts is not None
    before = counts.copy()
    run()

    def read() -> None:
        if own:
            stats.routing_counts = None
        per_layer = (((counts - before) > 0) & ~ex.residency.mask()).sum(axis=1)
        then(int(per_layer.sum()), int(np.dot(per_layer, ex.layer_blob_bytes)))

    return read
