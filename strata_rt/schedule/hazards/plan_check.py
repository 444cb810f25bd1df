"""Checking a whole plan: a chunk's layers fed to one Checker in order, or one layer on its own,
then the layer pass's rows rules over the chunk (hazards.rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plan import ChunkPlan, LayerPlan
from .checker import Checker

if TYPE_CHECKING:
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency


def check(plan: ChunkPlan | LayerPlan, residency: Residency | None = None,
          ring_slots: int | None = None, images: ImageCache | None = None) -> None:
    """Raises PlanHazardError on the first hazard of `plan` (a chunk, or one layer checked on
    its own, which then needs `ring_slots` and is taken to follow the chunk's ChunkInput);
    images: the engine's image cache, which cached Products are checked against."""
    if isinstance(plan, ChunkPlan):
        checker = Checker(plan.ring_slots, residency, images)
        for lp in plan.layers:
            checker.feed(lp.ops)
        checker._check(checker.rows.finish(plan))  # a pass's chunks: the prompt, every layer
    else:
        if ring_slots is None:
            raise ValueError("checking a LayerPlan alone needs ring_slots")
        Checker(ring_slots, residency, images, input_arrived=True).feed(plan.ops)
