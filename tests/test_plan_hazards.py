"""Planners and the hazard checker, on the CPU: every plan the planners emit passes the checker
(property tests over routings, chunk sizes, ring sizes, residency sets, gather modes and one or
two compute lanes), and hand-built broken plans are rejected with messages naming the slot or
the layer, the lane and the ops."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.errors import PlanHazardError
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    COPIED,
    LANE_FORK,
    LANE_JOIN,
    LANES,
    RING,
    ChunkInput,
    ChunkPlan,
    Consume,
    Copy,
    Gather,
    GatherBatch,
    LayerBegin,
    LayerEnd,
    LayerPlan,
    Products,
    Record,
    Wait,
    copied,
    lane_fork,
    lane_join,
    used,
)
from strata_rt.schedule.planners.planner import (
    STAGING_RING_SLOTS,
    StagingPlanner,
    plan_walk,
    walk_ring_slots,
)
from strata_rt.schedule.vram.image_cache import ImageCache
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import QWEN3_30B_SPEC, MoESpec

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


def _build(spec, residency, tokens, gather_one, ring, routed, images, lanes=1) -> ChunkPlan:
    if tokens >= FIXED_RULE_TOKENS:
        return plan_walk(spec, residency, ring, gather_one, tokens, images=images, lanes=lanes)
    planner = StagingPlanner(spec, residency, gather_one, tokens=tokens, lanes=lanes)
    for layer, experts in enumerate(routed):
        planner.plan_layer(layer, experts)
    return planner.chunk_plan()


def _launches(ops):
    """(launch, its gathers) for every gather launch among `ops`."""
    for op in ops:
        if isinstance(op, GatherBatch):
            yield op, op.gathers
        elif isinstance(op, Gather):
            yield op, (op,)


def _assert_lane_structure(plan: ChunkPlan, lanes: int) -> None:
    """What a plan of `lanes` lanes looks like, independently of the checker: group g gathers
    and multiplies on lane g % lanes; a layer whose second lane multiplies forks it once,
    before its first Products there, and joins it once, right before the combine; a ring
    wait is on the lane of the gather that reads the slot next."""
    ops = _flat(plan)
    assert all(op.stream in ("copy", "host", *LANES[:lanes]) for op in ops)
    for launch, gathers in _launches(ops):
        assert {g.stream for g in gathers} == {launch.stream}
        assert launch.stream == LANES[gathers[0].group % lanes]
    for i, op in enumerate(ops):
        if isinstance(op, Wait) and op.event[0] == COPIED:
            launch = next(launch for launch, gathers in _launches(ops[i + 1:])
                          if any(g.src == (RING, op.event[1]) for g in gathers))
            assert launch.stream == op.stream, (i, op, launch)
    for lp in plan.layers:
        layer, lops = lp.layer, list(lp.ops)
        assert all(p.stream == LANES[p.group % lanes] for p in lops if isinstance(p, Products))
        lane_events = [op for op in lops if isinstance(op, Record | Wait)
                       and op.event[0] in (LANE_FORK, LANE_JOIN)]
        if lanes == 1:
            assert not lane_events
            continue
        begin = lops.index(LayerBegin(layer))
        assert lops[begin + 1] == Record(lane_fork(layer), "compute")
        second = [i for i, op in enumerate(lops) if isinstance(op, Products)
                  and op.stream == "compute2"]
        forks = [i for i, op in enumerate(lops) if isinstance(op, Wait)
                 and op.event[0] == LANE_FORK]
        joined = (Record(lane_join(layer), "compute2"), Wait(lane_join(layer), "compute"),
                  LayerEnd(layer))
        if not second:  # (a staging layer routing one group only)
            assert not forks and lane_events == [Record(lane_fork(layer), "compute")]
            continue
        assert forks == [i for i in forks if lops[i] == Wait(lane_fork(layer), "compute2")]
        assert len(forks) == 1 and begin < forks[0] < second[0]
        assert tuple(lops[-3:]) == joined and second[-1] < len(lops) - 3
        assert len(lane_events) == 4  # the fork pair and the join pair, once each


@pytest.mark.parametrize("lanes", [1, 2])
@settings(deadline=None)  # examples per run: the hypothesis profile (conftest: 2,000 / 20,000)
@given(scenarios())
def test_every_plan_passes_the_checker(lanes, case):
    spec, residency, tokens, gather_one, ring, routed, images = case
    plan = _build(*case, lanes=lanes)
    check(plan, residency, images=images)
    _assert_lane_structure(plan, lanes)
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


@pytest.mark.parametrize("lanes", [1, 2])
def test_staging_batch_flushes_before_reusing_a_slot(lanes):
    """16 routed non-resident experts on the 8-slot ring: the batch is launched in parts so
    no slot is refilled before the batch that reads it ran."""
    spec = _spec(2, 32)
    res = Residency(2, 32, [], 256)
    planner = StagingPlanner(spec, res, gather_one=False, lanes=lanes)
    planner.plan_layer(0, range(16))
    planner.plan_layer(1, range(5, 30))
    plan = planner.chunk_plan()
    check(plan, res)
    _assert_lane_structure(plan, lanes)
    batches = [op for _, op in plan.ops() if isinstance(op, GatherBatch)]
    assert len(batches) > 4  # 4 groups, at least one split
    assert max(len(b.gathers) for b in batches) <= STAGING_RING_SLOTS


@pytest.mark.parametrize("lanes", [1, 2])
def test_walk_small_ring_batches_without_starving(lanes):
    spec = _spec(2, 32)
    res = Residency(2, 32, [(0, 3), (1, 17)], 256)
    for ring in (1, 5, 31, 32, 64):
        plan = plan_walk(spec, res, ring, gather_one=False, lanes=lanes)
        check(plan, res)
        _assert_lane_structure(plan, lanes)


@pytest.mark.parametrize("lanes", [1, 2])
def test_qwen3_30b_shape_walk_plan_is_clean(lanes):
    spec = QWEN3_30B_SPEC
    slot = 1_806_336
    res = Residency(spec.n_layers, spec.n_experts,
                    [(layer, e) for layer in range(spec.n_layers) for e in range(40)], slot)
    ring = walk_ring_slots(None, slot, spec.total_experts - res.n_slots)
    plan = plan_walk(spec, res, ring, gather_one=False, tokens=8192, lanes=lanes)
    check(plan, res)
    _assert_lane_structure(plan, lanes)
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


# ------------------------------------------------------------------------ broken two-lane plans
def _lane_ops(n_layers: int = 1, resident: bool = True, ring: int = 2,
              gather_one: bool = True) -> list:
    """A two-lane walk over 32 experts (group 0 on compute, group 1 on compute2). Resident by
    default: then no copy links the lanes, so only the lane events order them, and dropping
    one is a hazard the checker must see (a streamed plan may stay ordered through the copy
    stream, which the checker rightly accepts)."""
    spec = _spec(n_layers, 32)
    pairs = [(layer, e) for layer in range(n_layers) for e in range(32)] if resident else []
    return _flat(plan_walk(spec, Residency(n_layers, 32, pairs, 256), ring, gather_one,
                           lanes=2))


def _on_second_lane(op) -> bool:
    return getattr(op, "stream", None) == "compute2"


def test_reject_products_on_the_second_lane_without_the_fork():
    ops = _lane_ops()
    check(_chunk(ops, 2))
    ops.remove(Wait(lane_fork(0), "compute2"))
    _reject(ops, 2, r"layer 0: op #\d+ Products\(layer 0, group 1\) on compute2 may read the "
            r"layer's routing before op #1 LayerBegin\(layer 0\)",
            r"no Wait\(lane_fork\[0\]\) on compute2")
    # nor may it run in a layer that has not begun
    late = [op for op in _lane_ops() if not isinstance(op, LayerBegin)]
    _reject(late, 2, r"layer 0: op #\d+ Products\(layer 0, group 1\) on compute2 reads the "
            r"layer's routing, but no LayerBegin\(layer 0\)")


def test_reject_a_fork_that_does_not_follow_the_layers_routing():
    """Layer 1's second lane must wait for a fork recorded after layer 1's LayerBegin: the
    previous layer's fork, or one recorded ahead of the routing, leaves it free to read the
    routing before it is written; a wait ahead of the fork's record waits for nothing."""
    ops = _lane_ops(n_layers=2)
    fork = ops.index(Wait(lane_fork(1), "compute2"))
    begin = ops.index(LayerBegin(1))
    want = (r"layer 1: op #\d+ Products\(layer 1, group 1\) on compute2 may read the layer's "
            rf"routing before op #{begin} LayerBegin\(layer 1\)")
    _reject(ops[:fork] + [Wait(lane_fork(0), "compute2")] + ops[fork + 1:], 2, want)
    early = list(ops)
    early.insert(begin, early.pop(begin + 1))  # Record(lane_fork[1]) before LayerBegin(1)
    assert early[begin] == Record(lane_fork(1), "compute")
    _reject(early, 2, r"layer 1: op #\d+ Products\(layer 1, group 1\) on compute2",
            r"Wait\(lane_fork\[1\]\) on compute2 joins a Record\(lane_fork\[1\]\) issued "
            r"on compute after op #\d+")
    ahead = ops[:fork] + ops[fork + 1:]
    ahead.insert(begin, Wait(lane_fork(1), "compute2"))
    _reject(ahead, 2, rf"layer 1: op #{begin} Wait\(lane_fork\[1\]\) on compute2 waits on an "
            "event that was never recorded")


def test_reject_a_combine_without_the_join():
    ops = _lane_ops()
    ops.remove(Wait(lane_join(0), "compute"))
    products = _index(ops, lambda op: isinstance(op, Products) and _on_second_lane(op))
    _reject(ops, 2, rf"layer 0: op #{len(ops) - 1} LayerEnd\(layer 0\) combines rows that op "
            rf"#{products} Products\(layer 0, group 1\) on compute2 may still be writing",
            r"no Wait\(lane_join\[0\]\) on compute joins a Record\(lane_join\[0\]\) "
            "issued on compute2")
    # products after the combine: their rows are never read
    ops = _lane_ops()
    end = ops.pop()
    ops.insert(_index(ops, lambda op: isinstance(op, Products)) + 1, end)
    _reject(ops, 2, r"layer 0: op #\d+ Products\(layer 0, group 1\) on compute2 runs after "
            r"op #\d+ LayerEnd\(layer 0\)")


def test_reject_a_ring_wait_on_the_other_lane():
    """Group 1 gathers on compute2, so compute2 must wait for the copy it reads."""
    ops = _lane_ops(resident=False)
    g = _index(ops, lambda op: isinstance(op, Gather) and _on_second_lane(op))
    assert ops[g - 1] == Wait(copied(ops[g].src[1]), "compute2")
    ops[g - 1] = Wait(ops[g - 1].event, "compute")
    s, k = ops[g].src[1], ops[g].entry
    _reject(ops, 2, rf"slot {s}: op #{g} Gather\(layer 0, expert 16, group 1 pos 0, ring slot "
            rf"{s}, entry {k}\) on compute2 may read before op #\d+ Copy\(entry {k}",
            rf"no Wait\(copied\[{s}\]\) on compute2")


def test_reject_used_recorded_on_the_other_lane():
    """The gather reads its slot on compute2; a `used` record on compute does not cover it,
    so the copy refilling the slot may overwrite the expert while the gather reads it."""
    ops = _lane_ops(resident=False, ring=1)
    g = _index(ops, lambda op: isinstance(op, Gather) and _on_second_lane(op))
    assert ops[g + 1] == Record(used(0), "compute2")
    ops[g + 1] = Record(used(0), "compute")
    _reject(ops, 1, r"slot 0: op #\d+ Copy\(entry 17, layer 0, expert 17 -> slot 0\) "
            rf"refills the slot while op #{g} Gather\(layer 0, expert 16, .*\) on compute2",
            r"Record\(used\[0\]\) issued on compute2 after")


def test_reject_products_reading_the_other_lanes_buffers():
    """Each lane multiplies from its own group buffers: group 1 gathered on compute is not in
    compute2's."""
    ops = [replace(op, stream="compute") if isinstance(op, Gather) and op.group == 1 else op
           for op in _lane_ops()]
    first = _index(ops, lambda op: isinstance(op, Gather) and op.group == 1)
    _reject(ops, 2, r"Products\(layer 0, group 1\) on compute2 reads position 0 as expert 16, "
            r"but that position of compute2's group buffers was never gathered",
            rf"op #{first} gathered it on compute")


def test_reject_a_batch_member_on_another_lane():
    ops = _lane_ops(gather_one=False)
    b = _index(ops, lambda op: isinstance(op, GatherBatch) and _on_second_lane(op))
    members = list(ops[b].gathers)
    members[3] = replace(members[3], stream="compute")
    ops[b] = replace(ops[b], gathers=tuple(members))
    _reject(ops, 2, rf"op #{b} GatherBatch\(group 1, positions 0..15\) on compute2: member 3 "
            r"Gather\(layer 0, expert 19, group 1 pos 3, resident slot 19\) names lane "
            r"compute, not the launch's compute2")


def test_reject_events_and_launches_off_the_gpu_streams():
    _reject([Record(copied(0), "host")], 1, r"op #0 Record\(copied\[0\]\) on host: stream "
            r"must be one of copy, copy2, copy3, copy4, compute, compute2")
    _reject([Record(copied(0), "copy"), Wait(copied(0), "host")], 1,
            r"op #1 Wait\(copied\[0\]\) on host: stream must be one of")
    _reject([Gather(0, 0, 0, 2, ("resident", 0), stream="copy")], 1,
            r"op #0 Gather\(.*\) on copy: gathers and products run on a compute lane "
            r"\(compute, compute2\), not on copy")
