"""Planners and the hazard checker, on the CPU: every plan the planners emit passes the checker
(property tests over routings, chunk sizes, ring sizes, residency sets and gather modes), and
hand-built broken plans are rejected with messages naming the slot and the ops."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.errors import PlanHazardError
from strata_rt.formats import MMQ_GROUP
from strata_rt.hazards import check
from strata_rt.image_cache import ImageCache
from strata_rt.model import QWEN3_30B_SPEC, MoESpec
from strata_rt.plan import (
    ChunkInput,
    ChunkPlan,
    Consume,
    Copy,
    Gather,
    GatherBatch,
    LayerBegin,
    LayerPlan,
    Products,
    Record,
    Wait,
    copied,
    used,
)
from strata_rt.planner import (
    STAGING_RING_SLOTS,
    StagingPlanner,
    plan_walk,
    walk_ring_slots,
)
from strata_rt.residency import Residency

#: the tests pick the planner by the original fixed rule (the engine uses planner.takes_walk)
FIXED_RULE_TOKENS = 1024


def _spec(n_layers: int, n_experts: int) -> MoESpec:
    return MoESpec(n_layers=n_layers, hidden=256, ffn=256, n_experts=n_experts, top_k=1)


@st.composite
def scenarios(draw):
    n_layers = draw(st.integers(1, 3))
    n_experts = draw(st.sampled_from([4, 16, 17, 32, 40]))
    spec = _spec(n_layers, n_experts)
    resident = draw(st.sets(st.tuples(st.integers(0, n_layers - 1),
                                      st.integers(0, n_experts - 1))))
    # whole groups too, so that the image cache has groups to hold
    for layer, group in draw(st.sets(st.tuples(st.integers(0, n_layers - 1),
                                               st.integers(0, -(-n_experts // MMQ_GROUP) - 1)))):
        resident |= {(layer, e) for e in range(group * MMQ_GROUP,
                                                min(n_experts, (group + 1) * MMQ_GROUP))}
    residency = Residency(n_layers, n_experts, resident, 256)
    images = ImageCache.choose(spec, residency, draw(st.integers(0, 6)))
    tokens = draw(st.integers(1, 3 * FIXED_RULE_TOKENS))
    gather_one = draw(st.booleans())
    ring = draw(st.integers(1, 40))
    routed = [draw(st.sets(st.integers(0, n_experts - 1), max_size=n_experts))
              for _ in range(n_layers)]
    return spec, residency, tokens, gather_one, ring, routed, images


def _build(spec, residency, tokens, gather_one, ring, routed, images) -> ChunkPlan:
    if tokens >= FIXED_RULE_TOKENS:
        return plan_walk(spec, residency, ring, gather_one, tokens, images=images)
    planner = StagingPlanner(spec, residency, gather_one, tokens=tokens)
    for layer, experts in enumerate(routed):
        planner.plan_layer(layer, experts)
    return planner.chunk_plan()


@settings(deadline=None)  # examples per run: the hypothesis profile (conftest: 2,000 / 20,000)
@given(scenarios())
def test_every_plan_passes_the_checker(case):
    spec, residency, tokens, gather_one, ring, routed, images = case
    plan = _build(*case)
    check(plan, residency, images=images)
    # what the plan does, independently of the checker
    for lp in plan.layers:
        gathered = [g for op in lp.ops for g in (
            op.gathers if isinstance(op, GatherBatch) else (op,) if isinstance(op, Gather)
            else ())]
        products = [op for op in lp.ops if isinstance(op, Products)]
        want = (list(range(spec.n_experts)) if plan.mode == "walk"
                else sorted(routed[lp.layer]))
        assert [e for p in products for e in p.expert_ids] == want
        # the walk gathers every expert but those of the groups the image cache holds
        cached = {e for p in products if p.cached is not None for e in p.expert_ids}
        assert [g.expert for g in gathered] == [e for e in want if e not in cached]
        assert all(images.index(lp.layer, p.group) == p.cached for p in products
                   if plan.mode == "walk")
        assert plan.mode == "walk" or not cached
        assert all(0 < len(p.expert_ids) <= MMQ_GROUP for p in products)
        if gather_one:
            assert not any(isinstance(op, GatherBatch) for op in lp.ops)
    # the input arrives once, in the first layer, before anything reads the hidden states
    inputs = [i for i, op in plan.ops() if isinstance(op, ChunkInput)]
    assert len(inputs) == 1 and inputs[0] < len(plan.layers[0].ops)
    assert inputs[0] < min(i for i, op in plan.ops() if isinstance(op, LayerBegin))
    copies = [op for _, op in plan.ops() if isinstance(op, Copy)]
    assert [c.entry for c in copies] == list(range(len(copies)))
    assert all((c.layer, c.expert) not in residency.pairs for c in copies)
    assert plan.ring_slots == (ring if plan.mode == "walk" else STAGING_RING_SLOTS)


def test_staging_batch_flushes_before_reusing_a_slot():
    """16 routed non-resident experts on the 8-slot ring: the batch is launched in parts so
    no slot is refilled before the batch that reads it ran."""
    spec = _spec(2, 32)
    res = Residency(2, 32, [], 256)
    planner = StagingPlanner(spec, res, gather_one=False)
    planner.plan_layer(0, range(16))
    planner.plan_layer(1, range(5, 30))
    plan = planner.chunk_plan()
    check(plan, res)
    batches = [op for _, op in plan.ops() if isinstance(op, GatherBatch)]
    assert len(batches) > 4  # 4 groups, at least one split
    assert max(len(b.gathers) for b in batches) <= STAGING_RING_SLOTS


def test_walk_small_ring_batches_without_starving():
    spec = _spec(2, 32)
    res = Residency(2, 32, [(0, 3), (1, 17)], 256)
    for ring in (1, 5, 31, 32, 64):
        check(plan_walk(spec, res, ring, gather_one=False), res)


def test_qwen3_30b_shape_walk_plan_is_clean():
    spec = QWEN3_30B_SPEC
    slot = 1_806_336
    res = Residency(spec.n_layers, spec.n_experts,
                    [(layer, e) for layer in range(spec.n_layers) for e in range(40)], slot)
    ring = walk_ring_slots(None, slot, spec.total_experts - res.n_slots)
    plan = plan_walk(spec, res, ring, gather_one=False, tokens=8192)
    check(plan, res)
    assert plan.count(Copy) == spec.total_experts - res.n_slots


# ------------------------------------------------------------------------ broken plans
def _flat(plan: ChunkPlan) -> list:
    return [op for _, op in plan.ops()]


def _chunk(ops, ring: int) -> ChunkPlan:
    return ChunkPlan(0, "walk", ring, [LayerPlan(0, tuple(ops))])


def _reject(ops, ring: int, *patterns: str) -> str:
    with pytest.raises(PlanHazardError) as ei:
        check(_chunk(ops, ring))
    msg = str(ei.value)
    for p in patterns:
        assert re.search(p, msg), f"{p!r} not in: {msg}"
    return msg


def _walk_ops(ring: int, gather_one: bool = True) -> list:
    spec = _spec(1, 4)
    return _flat(plan_walk(spec, Residency(1, 4, [], 256), ring, gather_one))


def _index(ops, pred) -> int:
    return next(i for i, op in enumerate(ops) if pred(op))


def test_reject_refill_while_gather_may_read():
    ops = _walk_ops(ring=1)
    i = _index(ops, lambda op: op == Wait(used(0), "copy"))
    del ops[i]
    _reject(ops, 1, r"slot 0", r"refills the slot", r"op #\d+ Copy\(entry 1",
            r"op #\d+ Gather\(layer 0, expert 0")


def test_reject_used_recorded_before_the_gather():
    ops = _walk_ops(ring=1)
    g = _index(ops, lambda op: isinstance(op, Gather))
    rec = _index(ops, lambda op: op == Record(used(0), "compute"))
    ops.insert(g, ops.pop(rec))  # record `used` before the gather launch
    _reject(ops, 1, r"slot 0", r"refills the slot while op #\d+")


def test_reject_gather_before_copy_landed():
    ops = _walk_ops(ring=2)
    i = _index(ops, lambda op: op == Wait(copied(1), "compute"))
    del ops[i]
    _reject(ops, 2, r"slot 1", r"before op #\d+ Copy\(entry 1, layer 0, expert 1\) landed",
            r"Wait\(copied\[1\]\)")


def test_reject_wait_on_event_never_recorded():
    ops = [Wait(copied(3), "compute")]
    _reject(ops, 4, r"slot 3", r"op #0 Wait\(copied\[3\]\) on compute", r"never recorded")


def test_reject_gather_of_a_consumed_and_refilled_slot():
    """Layer 0 consumes entry 0 and the issuer refills its slot; layer 1 then reads it."""
    layer0 = (Copy(0, 0, 0, 0), Record(copied(0), "copy"), Consume(0),
              Copy(1, 0, 1, 0), Record(copied(0), "copy"))
    layer1 = (Wait(copied(0), "compute"), Gather(0, 0, 0, 0, ("ring", 0), 0))
    plan = ChunkPlan(0, "staging", 1, [LayerPlan(0, layer0), LayerPlan(1, layer1)])
    with pytest.raises(PlanHazardError,
                       match=r"slot 0: Consume at op #2 passed entry 0 .* before op #6 Gather"):
        check(plan)


def test_reject_consume_before_the_batch_reading_the_slot():
    g0 = Gather(0, 0, 0, 0, ("ring", 0), 0)
    ops = [Copy(0, 0, 0, 0), Record(copied(0), "copy"), Wait(copied(0), "compute"),
           Record(used(0), "compute"), Consume(0), GatherBatch(0, 0, (g0,)),
           Products(0, 0, (0,))]
    _reject(ops, 2, r"slot 0", r"op #4 Consume\(0\) passes entry 0",
            r"not-yet-launched gather at op #5")


def test_reject_issuer_over_running_the_consumer():
    ops = [Copy(0, 0, 0, 0), Record(copied(0), "copy"), Copy(1, 0, 1, 0)]
    _reject(ops, 1, r"slot 0", r"entry 1 >= consumed 0 \+ ring 1", r"op #2 Copy")


def test_reject_wrong_slot_for_entry():
    _reject([Copy(0, 0, 0, 1)], 2, r"slot 1", r"entry k goes to slot k % 2 = 0")


def test_reject_wait_cycle_of_a_batch_holding_the_ring():
    """The hang seen elsewhere: a batch waits for entry 1 while holding entry 0's slot, and the
    issuer cannot copy entry 1 until entry 0 is consumed."""
    g0 = Gather(0, 0, 0, 0, ("ring", 0), 0)
    g1 = Gather(0, 1, 0, 1, ("ring", 0), 1)
    ops = [Copy(0, 0, 0, 0), Record(copied(0), "copy"), Wait(copied(0), "compute"),
           Wait(copied(0), "compute"), GatherBatch(0, 0, (g0, g1))]
    _reject(ops, 1, r"slot 0", r"wait cycle", r"op #4 GatherBatch", r"entry 1")


def test_reject_products_reading_an_ungathered_position():
    ops = [Gather(0, 0, 0, 2, ("resident", 0)), Products(0, 0, (2, 3))]
    _reject(ops, 1, r"op #1 Products", r"position 1 as expert 3", r"never gathered")


def test_reject_resident_gather_from_the_wrong_slot():
    res = Residency(1, 4, [(0, 1), (0, 2)], 256)
    plan = _chunk([Gather(0, 0, 0, 2, ("resident", 0))], 1)
    with pytest.raises(PlanHazardError, match=r"resident slot 0.*resides in slot 1"):
        check(plan, res)


def test_reject_reading_the_hidden_states_before_the_input():
    ops = _walk_ops(ring=2)
    i = _index(ops, lambda op: isinstance(op, ChunkInput))
    assert i < _index(ops, lambda op: isinstance(op, LayerBegin))
    late = ops[:i] + ops[i + 1:]
    late.insert(_index(late, lambda op: isinstance(op, LayerBegin)) + 1, ChunkInput())
    _reject(late, 2, r"LayerBegin\(layer=0", r"no ChunkInput before it")
    _reject(ops[:i] + ops[i + 1:], 2, r"no ChunkInput")
    _reject(ops[: i + 1] + [ChunkInput()] + ops[i + 1:], 2,
            rf"op #{i + 1} ChunkInput: the chunk's input already arrived at op #{i}")


def test_a_layer_checked_alone_follows_the_input():
    """check(LayerPlan) takes the chunk's input as arrived; a second one is still refused."""
    spec = _spec(2, 4)
    res = Residency(2, 4, [(1, e) for e in range(4)], 256)  # layer 1 reads no ring slot
    plan = plan_walk(spec, res, 3, gather_one=False)
    check(plan.layers[1], res, ring_slots=3)
    with pytest.raises(PlanHazardError, match="input already arrived"):
        check(plan.layers[0], ring_slots=3)


def test_staging_planner_opens_the_first_layer_with_the_input():
    """Asked or not (the driver asks before routing), layer 0's plan begins with ChunkInput
    and later layers do not hold one."""
    spec, res = _spec(2, 4), Residency(2, 4, [], 256)
    for ask in (False, True):
        planner = StagingPlanner(spec, res, gather_one=False)
        if ask:
            assert planner.pre_routing_ops(0) == [ChunkInput()]
        first = planner.plan_layer(0, [1, 2])
        second = planner.plan_layer(1, [0])
        assert first.ops[:2] == (ChunkInput(), LayerBegin(0))
        assert not any(isinstance(op, ChunkInput) for op in second.ops)
        check(planner.chunk_plan(), res)
