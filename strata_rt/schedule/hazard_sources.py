"""What the hazard checker (strata_rt.schedule.hazards) asks of Products that read no group buffer:
an image-cache block (Products.cached) or resident slots read in place (Products.slots).

Neither source is written during a chunk (image blocks and resident slots are filled once at
open), so no stream order protects them; what can go wrong is reading the wrong bytes: a block
or a slot that holds another layer's or another expert's weights, or an expert that is not
resident at all. Each check returns the problem as text (None when there is none), and the
checker raises it with the op's index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..formats.contract import MMQ_GROUP
from .hazard_messages import describe
from .plan import Products

if TYPE_CHECKING:
    from .image_cache import ImageCache
    from .residency import Residency


def cached_problem(i: int, op: Products, block: int, cache: ImageCache | None,
                   residency: Residency | None) -> str | None:
    """A block holds group g's experts 16g.. by position, filled once at open from resident
    slots: the op must name that block, those experts, and resident ones."""
    what = f"op #{i} {describe(op)} reads image block {block}"
    if cache is None or not 0 <= block < len(cache.blocks):
        held = "no image cache" if cache is None else f"{len(cache.blocks)} blocks"
        return f"{what}, but the engine has {held}"
    if cache.blocks[block] != (op.layer, op.group):
        layer, group = cache.blocks[block]
        return f"{what}, which holds layer {layer} group {group}"
    first = op.group * MMQ_GROUP
    if op.expert_ids != tuple(range(first, first + len(op.expert_ids))):
        return (f"{what} as experts {list(op.expert_ids)}; a block holds experts {first}.. by "
                "position")
    if residency is not None:
        streamed = [e for e in op.expert_ids if residency.slot(op.layer, e) is None]
        if streamed:
            return (f"{what}, but experts {streamed} are not resident: their images were never "
                    "cached")
    return None


def in_place_problem(i: int, op: Products, slots: tuple[int, ...],
                     residency: Residency | None) -> str | None:
    """Position p is read in place from resident slot slots[p]: one slot per expert, and
    (when the residency is known) the slot that holds that expert of the op's layer."""
    what = f"op #{i} {describe(op)} reads resident slots {list(slots)} in place"
    if op.cached is not None:
        return f"{what} and image block {op.cached}: products read one source"
    if len(slots) != len(op.expert_ids):
        return f"{what} for {len(op.expert_ids)} experts: one slot per expert"
    if residency is None:
        return None
    for e, s in zip(op.expert_ids, slots):
        have = residency.slot(op.layer, e)
        if have != s:
            where = ("is not resident (it streams, and must be gathered)" if have is None else
                     f"lies in resident slot {have}")
            return f"{what}, but expert {e} of layer {op.layer} {where}, not in slot {s}"
    return None
