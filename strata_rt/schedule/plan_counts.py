"""What a plan's ops add to a chunk's counters: how many ops of each kind, the bytes its copies
move, and the Stats fields those give (experts and bytes streamed, gather and matmul launches).
"""

from __future__ import annotations

from collections.abc import Iterable

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


def op_counts(ops: Iterable[Op]) -> dict[type, int]:
    """How many ops of each kind a plan (or a layer of it) holds. A routed Copy is left out:
    whether it copies is known only from the routing, which the driver counts instead."""
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
