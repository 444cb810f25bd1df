"""Table products: a layer whose every expert is read in place runs its products as one
LayerProducts (plan.LayerProducts) instead of one in-place Products per group of 16 experts.

Why a transform and not a planner option: every planner that reads resident groups in place
(the walk, the staging ring, the routed and decode plans) already says which groups it reads
where; merging them afterwards leaves the planners and their rules as they are, and a new
planner gets it for free. The rule is narrow on purpose: a layer is merged only when its
in-place Products together name every expert exactly once and nothing else of the layer
gathers or multiplies (a gathered group, an image-cache block or a RoutedExperts reads other
buffers, which one table launch does not). Anything else leaves the layer as it was, so a plan
with no whole-resident layer, or the switch off, is today's plan.

Pure Python: the driver applies it right after planning, and the tests apply it to any plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from ...errors import ConfigError
from ..plan import (
    LANES,
    ChunkPlan,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerPlan,
    LayerProducts,
    Op,
    Products,
    PromptRows,
    RoutedExperts,
)

#: the engine's table_products setting (EngineConfig.table_products, STRATA_TABLE_PRODUCTS)
TABLE_SETTINGS = ("auto", "off")
#: what a layer must not hold beside its in-place Products to be merged
_OTHERS = (Gather, GatherBatch, GatherRouted, RoutedExperts, LayerProducts)


def merge_layer_products(plan: ChunkPlan, n_experts: int,
                         layer_ok: Callable[[int], bool]) -> ChunkPlan:
    """`plan` with each layer whose layer_ok(layer) holds merged (merge_layer); the plan
    itself when no layer changes."""
    layers = [merge_layer(lp, n_experts) if layer_ok(lp.layer) else lp for lp in plan.layers]
    if all(a is b for a, b in zip(layers, plan.layers)):
        return plan
    return replace(plan, layers=layers)


def merge_layer(lp: LayerPlan, n_experts: int) -> LayerPlan:
    """The layer with its in-place Products replaced by one LayerProducts on the main lane, at
    the position of the first of them (every other op where it was), when they cover experts
    0..n_experts-1 exactly once and the layer gathers or multiplies nothing else; otherwise
    the layer itself. A layer pass's layer (schedule.planners.layer_pass) is merged chunk by chunk:
    each PromptRows opens a part judged on its own."""
    cuts = [i for i, op in enumerate(lp.ops) if isinstance(op, PromptRows)]
    bounds = sorted({0, *cuts, len(lp.ops)})
    parts = [lp.ops[a:b] for a, b in zip(bounds, bounds[1:])]
    merged = [_merged(lp.layer, part, n_experts) for part in parts]
    if all(m is None for m in merged):
        return lp
    return LayerPlan(lp.layer, tuple(op for part, m in zip(parts, merged)
                                     for op in (part if m is None else m)))


def _merged(layer: int, ops: Sequence[Op], n_experts: int) -> list[Op] | None:
    """merge_layer's rule over one chunk's ops of the layer (None: left as they are)."""
    parts = [op for op in ops if isinstance(op, Products)]
    if not parts or any(isinstance(op, _OTHERS) for op in ops):
        return None
    if any(p.layer != layer or p.slots is None or p.cached is not None for p in parts):
        return None
    if sorted(e for p in parts for e in p.expert_ids) != list(range(n_experts)):
        return None
    table = LayerProducts(layer, tuple(replace(p, stream=LANES[0]) for p in parts))
    return [table if op is parts[0] else op for op in ops
            if not isinstance(op, Products) or op is parts[0]]


def table_layers(setting: str | None, offered: Callable[[int], bool],
                 layers: Iterable[int]) -> frozenset[int]:
    """The layers of `layers` that may be merged under the engine's table_products setting:
    under "auto" (or None) those whose format offers the table kernel (offered(layer):
    LayerFormats.offers_mmq_table), under "off" none."""
    if setting not in TABLE_SETTINGS and setting is not None:
        raise ConfigError(f"table_products: got {setting!r}; expected one of "
                          f"{', '.join(TABLE_SETTINGS)}")
    return frozenset() if setting == "off" else frozenset(filter(offered, layers))
