"""What the hazard checker (strata_rt.schedule.hazards) asks of products that read no group
buffer: an image-cache block (Products.cached), resident slots read in place (Products.slots),
a LayerProducts reading every expert of its layer in place (checked as its parts, which must
cover the layer's experts once each), or a RoutedExperts reading every expert of its layer
where it lies (a resident slot or the host store).

None of these sources is written during a chunk (image blocks and resident slots are filled
once at open, the host store never), so no stream order protects them; what can go wrong is
reading the wrong bytes: a block or a slot that holds another layer's or another expert's
weights, an expert that is not resident at all, or a ring slot no Copy fed. A RoutedExperts
or a LayerProducts also writes every routed row of its layer, so no other products of that
layer may write them.
Each check returns the problem as text (None when there is none), and the checker raises it
with the op's index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ...formats.contract import MMQ_GROUP
from ..plan import HOST, RESIDENT, LayerProducts, Products, RoutedExperts
from .messages import describe

if TYPE_CHECKING:
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency
    from .messages import Clock

#: a layer's products the checker saw before its combine: (clock, op index, op)
Multiplied = list[tuple["Clock", int, "Products | LayerProducts | RoutedExperts"]]
_WHOLE = (LayerProducts, RoutedExperts)


def products_problem(i: int, op: Products | LayerProducts | RoutedExperts, earlier: Multiplied,
                     residency: Residency | None, images: ImageCache | None) -> str | None:
    """The checks of this module that apply to op; earlier: the products of op's layer
    issued before it."""
    for _, j, p in earlier:
        if isinstance(p, _WHOLE) or isinstance(op, _WHOLE):
            whole = p if isinstance(p, _WHOLE) else op
            return (f"layer {op.layer}: op #{i} {describe(op)} and op #{j} {describe(p)} both "
                    f"write the layer's routed rows (a {type(whole).__name__} computes every "
                    "expert of its layer: no other products of the layer belong beside it)")
    if isinstance(op, RoutedExperts):
        return routed_problem(i, op, residency)
    if isinstance(op, LayerProducts):
        return layer_problem(i, op, residency)
    if op.slots is not None:
        return in_place_problem(i, op, op.slots, residency)
    if op.cached is not None:
        return cached_problem(i, op, op.cached, images, residency)
    return None


def routed_problem(i: int, op: RoutedExperts, residency: Residency | None) -> str | None:
    """One source per expert of the layer, each a resident slot that holds the expert or the
    host store for an expert that is not resident: no Copy feeds this op, so never a ring
    slot."""
    what = f"op #{i} {describe(op)}"
    n = None if residency is None else residency.mask().shape[1]
    if n is not None and len(op.sources) != n:
        return f"{what} names {len(op.sources)} sources for the layer's {n} experts"
    for e, (kind, idx) in enumerate(op.sources):
        have = None if residency is None else residency.slot(op.layer, e)
        if kind not in (RESIDENT, HOST):
            return (f"{what} reads expert {e} from {kind} {idx}: it reads experts where they "
                    "lie (a resident slot or the host store), never through the ring")
        if residency is not None and kind == RESIDENT and have != idx:
            where = "is not resident" if have is None else f"lies in resident slot {have}"
            return f"{what}, but expert {e} of layer {op.layer} {where}, not in slot {idx}"
        if kind == HOST and have is not None:
            return (f"{what} reads expert {e} of layer {op.layer} from the host store, but it "
                    f"resides in slot {have}")
    return None


def layer_problem(i: int, op: LayerProducts, residency: Residency | None) -> str | None:
    """Its parts, in-place Products of its layer, name experts 0..n-1 once each (n: the
    residency's experts per layer, else as many as they name), and each part passes the
    checks of an in-place Products."""
    what = f"op #{i} {describe(op)}"
    seen: dict[int, int] = {}
    for n, part in enumerate(op.stands_for()):
        if part.layer != op.layer or part.slots is None or part.cached is not None:
            return (f"{what}: part {n} {describe(part)} is no in-place Products of layer "
                    f"{op.layer} (each part reads its layer's resident slots, named by slots=)")
        for e in part.expert_ids:
            if e in seen:
                return (f"{what} names expert {e} twice (parts {seen[e]} and {n}): it would "
                        "write the expert's rows twice")
            seen[e] = n
    n_experts = len(seen) if residency is None else residency.mask().shape[1]
    missing = sorted(set(range(n_experts)) - set(seen))
    extra = sorted(set(seen) - set(range(n_experts)))
    if missing or extra:
        why = (f"experts {missing} left out" if missing else
               f"experts {extra} outside the layer's {n_experts}")
        return (f"{what} does not cover every expert of its layer (0..{n_experts - 1}) once: "
                f"{why} (it stands for the whole layer's products; a partly resident layer "
                "keeps its per-group Products)")
    for n, part in enumerate(op.stands_for()):
        problem = in_place_problem(i, part, part.slots or (), residency)
        if problem is not None:
            return f"{problem} (part {n} of {describe(op)})"
    return None


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


def elsewhere_hint(buffers: Mapping[str, Mapping[int, tuple[int, int, int, int]]],
                   op: Products, p: int, e: int) -> str:
    """A hint for products that miss expert e at position p, when another lane's group
    buffers (lane -> pos -> (layer, group, expert, op index)) hold it."""
    for lane, buf in buffers.items():
        have = buf.get(p)
        if lane != op.stream and have is not None and have[:3] == (op.layer, op.group, e):
            return (f"; op #{have[3]} gathered it on {lane}, and each lane multiplies "
                    "only what it gathered into its own buffers")
    return ""
