"""Table products (plan.LayerProducts; strata_rt.schedule.planners.layer_products), on the CPU.

The transform on hand-built and planned plans: a layer whose in-place Products cover every
expert becomes one LayerProducts where its parts stood, anything else stays as it was (partial
coverage, gathered or cached groups, a RoutedExperts, a layer not offered, the switch off);
every merged plan passes the hazard checker, and LayerProducts that do not cover their layer
once are refused by name; the counters; the reference backend's bytes with and without the
merge (MoE layers alone and the tiny whole model, prefill and decode). The CUDA executor's
launches: tests/test_in_place.py; on a GPU: tests/test_cuda_engine.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from _fake_runtime import table_kernels
from _generate_cases import TINY_CONFIG
from _settings import check_engine_setting, run_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.config.run.run_config import load_config
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.report.stats import Stats
from strata_rt.schedule import hazards
from strata_rt.schedule.hazards.messages import describe
from strata_rt.schedule.plan import (
    ChunkPlan,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerEnd,
    LayerPlan,
    LayerProducts,
    Products,
    RoutedExperts,
)
from strata_rt.schedule.plan_counts import add_counts, op_counts
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.layer_products import (
    merge_layer,
    merge_layer_products,
    table_layers,
)
from strata_rt.schedule.planners.planner import StagingPlanner, plan_decode, plan_routed, plan_walk
from strata_rt.schedule.vram.image_cache import ImageCache
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import SMALL_SPEC, Model, MoESpec

SPEC = SMALL_SPEC  # 4 layers of 32 experts: two groups per layer
GROUPS = SPEC.n_experts // MMQ_GROUP
EVERY = frozenset(range(SPEC.n_layers)).__contains__
IQ3_GEMM = IQ3XXS().for_variant(None)


def _residency(spec: MoESpec, pairs) -> Residency:
    return Residency(spec.n_layers, spec.n_experts, pairs, 1)


def _all_resident(spec: MoESpec = SPEC) -> Residency:
    return _residency(spec, [(layer, e) for layer in range(spec.n_layers)
                             for e in range(spec.n_experts)])


def _mixed(spec: MoESpec = SPEC) -> Residency:
    """Layers 0 and 2 all resident; layer 1 group 0 only; layer 3 none."""
    pairs = [(layer, e) for layer in (0, 2) for e in range(spec.n_experts)]
    return _residency(spec, pairs + [(1, e) for e in range(MMQ_GROUP)])


def _without(ops, kinds) -> list:
    return [op for op in ops if not isinstance(op, kinds)]


def _check_merged(before: ChunkPlan, after: ChunkPlan, merged: set[int]) -> None:
    """Layers in `merged` hold one LayerProducts where their first Products stood, standing
    for those Products (on the main lane), every other op where it was; the others are the
    very same LayerPlans."""
    assert [lp.layer for lp in after.layers] == [lp.layer for lp in before.layers]
    for old, new in zip(before.layers, after.layers):
        if old.layer not in merged:
            assert new is old
            continue
        parts = [op for op in old.ops if isinstance(op, Products)]
        (whole,) = [op for op in new.ops if isinstance(op, LayerProducts)]
        assert whole.stream == "compute" and whole.layer == old.layer
        assert whole.stands_for() == tuple(replace(p, stream="compute") for p in parts)
        first = next(i for i, op in enumerate(old.ops) if isinstance(op, Products))
        assert new.ops[first] is whole
        assert _without(new.ops, LayerProducts) == _without(old.ops, Products)
        slots = {e: s for p in parts for e, s in zip(p.expert_ids, p.slots or ())}
        assert whole.slots == tuple(slots[e] for e in range(len(slots)))


# ---------------------------------------------------------------------------- the transform
@pytest.mark.parametrize("lanes", [1, 2])
def test_a_whole_resident_walk_becomes_one_op_per_layer(lanes):
    res = _all_resident()
    plan = plan_walk(SPEC, res, 4, False, tokens=100, lanes=lanes, in_place=True)
    merged = merge_layer_products(plan, SPEC.n_experts, EVERY)
    _check_merged(plan, merged, set(range(SPEC.n_layers)))
    assert merged.count(Products) == 0 and merged.count(LayerProducts) == SPEC.n_layers
    hazards.check(merged, res)
    assert (merged.tokens, merged.mode, merged.ring_slots) == (100, "walk", 4)


def test_partly_resident_and_unoffered_layers_stay_as_they_were():
    res = _mixed()
    plan = plan_walk(SPEC, res, 4, False, tokens=100, lanes=2, in_place=True)
    merged = merge_layer_products(plan, SPEC.n_experts, EVERY)
    _check_merged(plan, merged, {0, 2})
    hazards.check(merged, res)
    only_two = merge_layer_products(plan, SPEC.n_experts, {2}.__contains__)
    _check_merged(plan, only_two, {2})
    assert merge_layer_products(plan, SPEC.n_experts, lambda layer: False) is plan
    # gathered groups, not in place: nothing to merge
    gathered = plan_walk(SPEC, res, 4, False, tokens=100, in_place=False)
    assert merge_layer_products(gathered, SPEC.n_experts, EVERY) is gathered


def test_image_blocks_and_routed_experts_are_left_alone():
    res = _all_resident()
    images = ImageCache.choose(SPEC, res, 1)
    assert images.blocks
    cached = plan_walk(SPEC, res, 4, False, tokens=100, images=images, in_place=True)
    merged = merge_layer_products(cached, SPEC.n_experts, EVERY)
    layer = images.blocks[0][0]
    _check_merged(cached, merged, set(range(SPEC.n_layers)) - {layer})
    hazards.check(merged, res, images=images)
    gemv = plan_decode(SPEC, res, DenseSchedule(SPEC.n_layers, None, None), in_place=True,
                       gemv=True)
    assert gemv.count(RoutedExperts) == SPEC.n_layers
    assert merge_layer_products(gemv, SPEC.n_experts, EVERY) is gemv


def test_hand_built_layers_merge_only_when_they_cover_the_layer_once():
    ids = [tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP)) for g in range(GROUPS)]
    parts = [Products(0, g, ids[g], slots=ids[g]) for g in range(GROUPS)]
    whole = LayerPlan(0, (*parts, LayerEnd(0)))
    assert merge_layer(whole, SPEC.n_experts).ops == (LayerProducts(0, tuple(parts)),
                                                      LayerEnd(0))
    gather = Gather(0, 0, 0, 0, ("resident", 0))
    unchanged = [
        LayerPlan(0, (parts[0], LayerEnd(0))),                        # half the layer
        LayerPlan(0, (parts[0], parts[0], LayerEnd(0))),              # one group twice
        LayerPlan(0, (*parts, parts[1], LayerEnd(0))),                # an expert twice
        LayerPlan(0, (replace(parts[0], slots=None), parts[1])),      # a gathered group
        LayerPlan(0, (replace(parts[0], cached=0), parts[1])),        # an image block
        LayerPlan(0, (gather, *parts)),                               # a gather beside
        LayerPlan(0, (GatherBatch(0, 0, (gather,)), *parts)),
        LayerPlan(0, (GatherRouted(0, (gather,)), *parts)),
        LayerPlan(0, (RoutedExperts(0, ()), *parts)),
        LayerPlan(0, (LayerProducts(0, tuple(parts)), *parts)),
        LayerPlan(1, tuple(parts)),                                   # another layer's
        LayerPlan(0, ()),
    ]
    for lp in unchanged:
        assert merge_layer(lp, SPEC.n_experts) is lp, lp
    assert merge_layer(whole, SPEC.n_experts + 1) is whole          # expert 32 missing


def test_staging_routed_and_decode_plans_merge_their_whole_layers():
    res = _mixed()
    planner = StagingPlanner(SPEC, res, False, tokens=300, in_place=True)
    routed = {0: range(SPEC.n_experts), 1: [0, 3], 2: [1, 2, 30], 3: range(SPEC.n_experts)}
    for layer in range(SPEC.n_layers):
        planner.plan_layer(layer, list(routed[layer]))
    staging = planner.chunk_plan()
    # layer 0: every expert routed and resident; layer 2 resident, but only 3 routed
    _check_merged(staging, merge_layer_products(staging, SPEC.n_experts, EVERY), {0})
    hazards.check(merge_layer_products(staging, SPEC.n_experts, EVERY), res)
    for plan in (plan_routed(SPEC, res, None, True, 40),
                 plan_decode(SPEC, res, DenseSchedule(SPEC.n_layers, None, None),
                             in_place=True)):
        merged = merge_layer_products(plan, SPEC.n_experts, EVERY)
        _check_merged(plan, merged, {0, 2})
        hazards.check(merged, res)


@st.composite
def _cases(draw):
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.sampled_from([4, 16, 17, 32, 40]))
    spec = MoESpec(n_layers=n_layers, hidden=256, ffn=256, n_experts=n_experts, top_k=1)
    whole = draw(st.sets(st.integers(0, n_layers - 1)))
    pairs = {(layer, e) for layer in whole for e in range(n_experts)}
    pairs |= draw(st.sets(st.tuples(st.integers(0, n_layers - 1),
                                    st.integers(0, n_experts - 1))))
    res = Residency(n_layers, n_experts, pairs, 256)
    kind = draw(st.sampled_from(["walk", "staging", "routed", "decode"]))
    routed = [draw(st.sets(st.integers(0, n_experts - 1), max_size=n_experts))
              for _ in range(n_layers)]
    return (spec, res, kind, draw(st.integers(1, 40)), draw(st.booleans()),
            draw(st.sampled_from([1, 2])), draw(st.booleans()), routed,
            draw(st.sets(st.integers(0, n_layers - 1))))


def _plan(spec, res, kind, ring, gather_one, lanes, in_place, routed) -> ChunkPlan:
    if kind == "walk":
        return plan_walk(spec, res, ring, gather_one, 2000, lanes=lanes, in_place=in_place)
    if kind == "routed":
        return plan_routed(spec, res, None, in_place, 30)
    if kind == "decode":
        return plan_decode(spec, res, DenseSchedule(spec.n_layers, None, None), in_place)
    planner = StagingPlanner(spec, res, gather_one, tokens=30, lanes=lanes, in_place=in_place)
    for layer, experts in enumerate(routed):
        planner.plan_layer(layer, sorted(experts))
    return planner.chunk_plan()


@settings(deadline=None, max_examples=400)
@given(_cases())
def test_random_plans_merge_exactly_their_whole_resident_layers(case):
    spec, res, kind, ring, gather_one, lanes, in_place, routed, offered = case
    plan = _plan(spec, res, kind, ring, gather_one, lanes, in_place, routed)
    merged = merge_layer_products(plan, spec.n_experts, offered.__contains__)
    mask = res.mask()
    want = set()
    for layer in offered:
        every = kind != "staging" or len(routed[layer]) == spec.n_experts
        if in_place and every and mask[layer].all():
            want.add(layer)
    _check_merged(plan, merged, want)
    hazards.check(merged, res)
    assert merge_layer_products(merged, spec.n_experts, offered.__contains__) is merged


# ---------------------------------------------------------------------------- the checker
def _merged_walk(res: Residency, lanes: int = 1) -> ChunkPlan:
    plan = plan_walk(SPEC, res, 4, False, tokens=100, lanes=lanes, in_place=True)
    return merge_layer_products(plan, SPEC.n_experts, EVERY)


def _with_layer0(plan: ChunkPlan, swap) -> ChunkPlan:
    """`plan` with layer 0's ops passed through swap(ops) -> ops."""
    layers = list(plan.layers)
    layers[0] = LayerPlan(0, tuple(swap(list(layers[0].ops))))
    return replace(plan, layers=layers)


def _replace_whole(plan: ChunkPlan, make) -> ChunkPlan:
    return _with_layer0(plan, lambda ops: [make(op) if isinstance(op, LayerProducts) else op
                                           for op in ops])


def test_checker_refuses_layer_products_that_do_not_cover_the_layer_once():
    res = _all_resident()
    plan = _merged_walk(res)
    hazards.check(plan, res)
    whole = next(op for _, op in plan.ops() if isinstance(op, LayerProducts))
    p0, p1 = whole.parts
    wrong_slots = replace(p1, slots=tuple(reversed(p1.slots or ())))
    bad = {
        r"experts \[16, 17, .*31\] left out": LayerProducts(0, (p0,)),
        "names expert 0 twice": LayerProducts(0, (p0, p1, p0)),
        "is no in-place Products of layer 0": LayerProducts(0, (p0, replace(p1, slots=None))),
        "part 1 Products.layer 0, group 1. is no in-place": LayerProducts(
            0, (p0, replace(p1, cached=0))),
        "is no in-place Products of layer 0 .each part": LayerProducts(
            0, (p0, replace(p1, layer=1))),
        r"lies in resident slot \d+, not in slot \d+ \(part 1 of LayerProducts": LayerProducts(
            0, (p0, wrong_slots)),
    }
    for match, op in bad.items():
        with pytest.raises(PlanHazardError, match=match):
            hazards.check(_replace_whole(plan, lambda _, op=op: op), res)
    # without a residency the parts must still name 0..n-1 once
    hazards.check(plan)
    with pytest.raises(PlanHazardError, match=r"experts \[32\] outside the layer's 32"):
        hazards.check(_replace_whole(plan, lambda w: LayerProducts(0, (
            *w.parts, Products(0, 2, (32,), slots=(0,))))), res)


def test_checker_holds_layer_products_to_the_rules_of_its_parts():
    res = _all_resident()
    plan = _merged_walk(res)
    whole = next(op for _, op in plan.ops() if isinstance(op, LayerProducts))
    with pytest.raises(PlanHazardError, match="both write the layer's routed rows .a "
                                              "LayerProducts computes every expert"):
        hazards.check(_with_layer0(plan, lambda ops: [*ops[:-1], whole.parts[0], ops[-1]]),
                      res)
    with pytest.raises(PlanHazardError, match="runs after op #.* LayerEnd.layer 0"):
        hazards.check(_with_layer0(plan, lambda ops: [*_without(ops, LayerProducts), whole]),
                      res)
    # off the main lane without a fork it may read the routing before LayerBegin wrote it
    with pytest.raises(PlanHazardError, match=r"LayerProducts\(layer 0, 2 parts, 32 experts\) "
                                              "on compute2 may read the layer's routing"):
        hazards.check(_replace_whole(plan, lambda w: replace(w, stream="compute2")), res)
    with pytest.raises(PlanHazardError, match="on a compute lane"):
        hazards.check(_replace_whole(plan, lambda w: replace(w, stream="copy")), res)


def test_messages_name_the_op():
    whole = LayerProducts(3, (Products(3, 0, (0, 1), slots=(5, 6)),), stream="compute2")
    assert describe(whole) == "LayerProducts(layer 3, 1 parts, 2 experts) on compute2"
    assert whole.stands_for() == (Products(3, 0, (0, 1), stream="compute2", slots=(5, 6)),)
    assert whole.slots == (5, 6)


def test_two_lane_merged_plans_pass_the_checker():
    res = _all_resident()
    plan = _merged_walk(res, lanes=2)
    hazards.check(plan, res)
    assert all(op.stream == "compute" for _, op in plan.ops() if isinstance(op, LayerProducts))


# ---------------------------------------------------------------------------- counters
def test_a_layer_products_counts_two_matmul_launches():
    res = _all_resident()
    plan = plan_walk(SPEC, res, 4, False, tokens=100, in_place=True)
    merged = merge_layer_products(plan, SPEC.n_experts, EVERY)
    before, after = Stats(), Stats()
    add_counts(before, op_counts(op for _, op in plan.ops()), 0)
    add_counts(after, op_counts(op for _, op in merged.ops()), 0)
    assert before.mmq_launches == 2 * GROUPS * SPEC.n_layers
    assert after.mmq_launches == 2 * SPEC.n_layers
    assert after.gathers_launched == before.gathers_launched == 0


# ---------------------------------------------------------------------------- the setting
def test_engine_config_reads_the_setting_and_the_environment(monkeypatch):
    check_engine_setting(monkeypatch, "table_products", "STRATA_TABLE_PRODUCTS", "auto", "off",
                         "off", "always", "on")


def test_table_layers_follow_the_setting_and_the_formats():
    offered = {1, 3}.__contains__
    assert table_layers("auto", offered, range(4)) == {1, 3}
    assert table_layers(None, offered, range(2, 4)) == {3}
    assert table_layers("off", offered, range(4)) == frozenset()
    with pytest.raises(ConfigError, match="table_products: got 'on'"):
        table_layers("on", offered, range(4))


def test_formats_offer_table_products_only_with_the_kernel(monkeypatch):
    model = Model.synthetic(SPEC, 7)
    assert model.formats.format(0).in_place_max_rows > 0
    table_kernels(monkeypatch, model.formats.format(0))
    assert all(model.formats.offers_mmq_table(layer) for layer in range(SPEC.n_layers))
    exact = IQ3XXS().for_variant("int8")
    assert not exact.offers_mmq_table()  # no in-place reads: no table either


# ---------------------------------------------------------------------------- reference bytes
def _count(plans, kind) -> int:
    return sum(p.count(kind) for p in plans)


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_reference_bytes_do_not_depend_on_the_merge(monkeypatch, rng, lanes, fixed_walk_rule):
    """Staging (200 tokens) and walk (1,100) prompts with every expert resident and read in
    place: the same bytes as one in-place launch per group; off runs the planners' plans as
    they are, auto the same plans merged."""
    model = Model.synthetic(SPEC, 41)
    prompts = [rng.standard_normal((n, SPEC.hidden), dtype=np.float32) for n in (200, 1100)]
    cfg = dict(expert_cache=SPEC.total_experts, compute_lanes=lanes, in_place="on")
    table_kernels(monkeypatch, model.formats.format(0))
    off, plans_off = run_reference(model, prompts, table_products="off", **cfg)
    on, plans_on = run_reference(model, prompts, table_products="auto", **cfg)
    for a, b in zip(off, on):
        assert a.tobytes() == b.tobytes()
    assert _count(plans_off, LayerProducts) == 0
    assert [merge_layer_products(p, SPEC.n_experts, EVERY) for p in plans_off] == plans_on
    assert plans_on[1].count(LayerProducts) == SPEC.n_layers  # the walk: every layer
    for lp in plans_on[0].layers:  # staging: the layers that routed every expert
        ids = sorted(e for op in lp.ops if isinstance(op, Products) for e in op.expert_ids)
        merged = any(isinstance(op, LayerProducts) for op in lp.ops)
        assert merged != (ids == list(range(SPEC.n_experts))), lp.layer


def test_reference_tiny_whole_model_prefill_and_decode(monkeypatch):
    """The tiny whole model with every expert resident: a prompt's logits and greedy decode
    steps (the decode plan) are the same bytes with the merge on and off."""
    def run(setting: str):
        ecfg = load_config(TINY_CONFIG).engine_config(backend="reference")
        ecfg.expert_cache, ecfg.table_products, ecfg.check_plan = 16, setting, True
        ecfg.in_place = "on"
        rows, kinds = [], set()
        with Engine.open(ecfg) as eng:
            ids = np.arange(40, dtype=np.int64) * 7 % 512
            logits, _ = eng.prefill(ids, all_logits=True)
            rows.append(logits)
            kinds |= {type(op) for _, op in eng.driver.last_plan.ops()}
            for _ in range(3):
                token = int(np.argmax(rows[-1].reshape(-1, rows[-1].shape[-1])[-1]))
                step, _ = eng.prefill(np.array([token]))
                rows.append(step)
                kinds |= {type(op) for _, op in eng.driver.last_plan.ops()}
        return rows, kinds

    off, kinds_off = run("off")
    table_kernels(monkeypatch, IQ3_GEMM)
    on, kinds_on = run("auto")
    assert LayerProducts in kinds_on and LayerProducts not in kinds_off
    for a, b in zip(off, on):
        assert a.tobytes() == b.tobytes()


def test_the_driver_merges_the_planners_plan_and_off_leaves_it(monkeypatch):
    """The driver's walk and decode-shaped plans: under off the planner's plan as it is
    (today's plan), under auto that plan merged, and the merged one is what runs."""
    model = Model.synthetic(SPEC, 3)
    table_kernels(monkeypatch, model.formats.format(0))
    plans = {}
    for setting in ("off", "auto"):
        cfg = EngineConfig(model=model, backend="reference", expert_cache=SPEC.total_experts,
                           in_place="on", table_products=setting)
        with Engine.open(cfg) as eng:
            d, ex = eng.driver, eng.driver.executor
            assert d.table_layers == (set() if setting == "off" else set(range(SPEC.n_layers)))
            planned = plan_walk(SPEC, ex.residency, ex.walk_slots, d.gather_one, tokens=1100,
                                images=ex.images, lanes=ex.lanes_for(1100),
                                in_place=ex.in_place_for(1100))
            plans[setting] = (d.walk_plan(1100)[0], planned)
    off, planned = plans["off"]
    assert off == planned
    assert plans["auto"][0] == merge_layer_products(planned, SPEC.n_experts, EVERY) != planned
