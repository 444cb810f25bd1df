"""A layer split's plans and the split checker, on the CPU: per-part plans of random splits
(walk, staging and decode, one or two lanes, resident or streamed dense weights, several
chunks in host order) pass the checker; plans with a hand-off wait or record missing or
misplaced are rejected with messages naming the part, the chunk and the boundary; and the
split rule puts the layers where the streamed bytes are balanced."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    HANDOFF_READY,
    HANDOFF_TAKEN,
    ChunkInput,
    ChunkPlan,
    HandOff,
    LayerEnd,
    LayerPlan,
    Record,
    Wait,
    handoff_ready,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import StagingPlanner, plan_decode, plan_walk
from strata_rt.schedule.split import LayerSplit, Part, choose_split, parse_devices
from strata_rt.schedule.split.hazards import check_split
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import MoESpec


def _spec(n_layers: int, n_experts: int) -> MoESpec:
    return MoESpec(n_layers=n_layers, hidden=256, ffn=256, n_experts=n_experts, top_k=1)


def _plan(spec: MoESpec, residency: Residency, part: Part, kind: str, ring: int,
          gather_one: bool, lanes: int, dense: int | None, routed: list[set[int]],
          start: int | None) -> ChunkPlan:
    attention = (None if start is None and kind != "decode" else
                 DenseSchedule(spec.n_layers, None if kind == "decode" else start, dense,
                               part.first))
    if kind == "walk":
        return plan_walk(spec, residency, ring, gather_one, 64, attention, lanes=lanes,
                         part=part)
    if kind == "decode":
        assert attention is not None
        return plan_decode(spec, residency, attention, part=part)
    planner = StagingPlanner(spec, residency, gather_one, tokens=8, attention=attention,
                             lanes=lanes, part=part)
    for layer in part.layers:
        planner.plan_layer(layer, sorted(routed[layer]))
    return planner.chunk_plan()


@st.composite
def split_scenarios(draw):
    n_layers = draw(st.integers(2, 5))
    n_parts = draw(st.integers(2, min(4, n_layers)))
    cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=n_parts - 1,
                               max_size=n_parts - 1)))
    split = LayerSplit(tuple(range(n_parts)), (0, *cuts, n_layers))
    n_experts = draw(st.sampled_from([4, 16, 20]))
    spec = _spec(n_layers, n_experts)
    residencies = []
    for part in split.parts:
        pairs = draw(st.sets(st.tuples(st.sampled_from(list(part.layers)),
                                       st.integers(0, n_experts - 1))))
        residencies.append(Residency(n_layers, n_experts, pairs, 256))
    whole = draw(st.booleans())
    kinds = draw(st.lists(st.sampled_from(["walk", "staging"] + (["decode"] if whole else [])),
                          min_size=1, max_size=3))
    chunks = []
    for c, kind in enumerate(kinds):
        routed = [draw(st.sets(st.integers(0, n_experts - 1))) for _ in range(n_layers)]
        chunks.append((kind, routed, 64 * c if whole else None))
    return (spec, split, residencies, chunks, draw(st.integers(1, 12)), draw(st.booleans()),
            draw(st.sampled_from([1, 2])), draw(st.sampled_from([None, 1, 2])))


def _plans(case) -> tuple[LayerSplit, list[Residency], list[list[ChunkPlan]]]:
    spec, split, residencies, chunks, ring, gather_one, lanes, dense = case
    plans = [[_plan(spec, residencies[p.index], p, kind, ring, gather_one, lanes, dense,
                    routed, start) for p in split.parts] for kind, routed, start in chunks]
    return split, residencies, plans


@settings(max_examples=150, deadline=None)
@given(split_scenarios())
def test_every_split_plan_passes_the_split_checker(case):
    split, residencies, chunks = _plans(case)
    check_split(split, chunks, residencies)
    for plans in chunks:
        for part, plan in zip(split.parts, plans):
            ops = [op for _, op in plan.ops()]
            assert [lp.layer for lp in plan.layers] == list(part.layers)
            inputs = [op for op in ops if isinstance(op, ChunkInput | HandOff)]
            want = (HandOff(part.first, part.index - 1, part.index) if part.receives
                    else ChunkInput())
            assert inputs == [want]
            ready = [op for op in ops if isinstance(op, Record)
                     and op.event[0] == HANDOFF_READY]
            assert ready == ([Record(handoff_ready(part.end), "compute")] if part.sends
                             else [])
            if part.sends:  # the residual is final: the record follows the last combine
                assert ops.index(ready[0]) > max(i for i, op in enumerate(ops)
                                                 if isinstance(op, LayerEnd))


def _drop(plan: ChunkPlan, unwanted) -> ChunkPlan:
    layers = [LayerPlan(lp.layer, tuple(op for op in lp.ops if not unwanted(op)))
              for lp in plan.layers]
    return ChunkPlan(plan.tokens, plan.mode, plan.ring_slots, layers)


def _two_part_case(n_chunks: int = 2):
    spec = _spec(4, 16)
    split = LayerSplit((0, 1), (0, 2, 4))
    res = [Residency(4, 16, [(0, 1)], 256), Residency(4, 16, [(3, 5)], 256)]
    chunks = [[plan_walk(spec, res[p.index], 4, False, 64, part=p) for p in split.parts]
              for _ in range(n_chunks)]
    return split, res, chunks


def test_reject_a_receiver_without_the_ready_wait():
    split, res, chunks = _two_part_case(1)
    chunks[0][1] = _drop(chunks[0][1], lambda op: isinstance(op, Wait)
                         and op.event[0] == HANDOFF_READY)
    with pytest.raises(PlanHazardError, match=r"part 1 \(device 1\), chunk 0: .*HandOff"
                       r"\(boundary 2\) may copy part 0's residual before its last LayerEnd"):
        check_split(split, chunks, res)


def test_reject_a_ready_record_before_the_last_combine():
    split, res, chunks = _two_part_case(1)
    sender = chunks[0][0]
    last = sender.layers[-1]
    moved = tuple(op for op in last.ops if op != Record(handoff_ready(2), "compute"))
    at = next(i for i, op in enumerate(moved) if isinstance(op, LayerEnd))
    moved = (*moved[:at], Record(handoff_ready(2), "compute"), *moved[at:])
    chunks[0][0] = ChunkPlan(sender.tokens, sender.mode, sender.ring_slots,
                             [*sender.layers[:-1], LayerPlan(last.layer, moved)])
    with pytest.raises(PlanHazardError, match="before its last LayerEnd of chunk 0"):
        check_split(split, chunks, res)


def test_reject_a_sender_overwriting_the_residual_before_the_copy():
    """The second chunk's input on part 0 without the wait on part 1's handoff_taken."""
    split, res, chunks = _two_part_case(2)
    chunks[1][0] = _drop(chunks[1][0], lambda op: isinstance(op, Wait)
                         and op.event[0] == HANDOFF_TAKEN)
    with pytest.raises(PlanHazardError, match=r"part 0 \(device 0\), chunk 1: .*ChunkInput "
                       r"overwrites the residual that part 1's HandOff .* may still copy"):
        check_split(split, chunks, res)


def test_reject_a_middle_part_overwriting_its_residual():
    spec = _spec(3, 4)
    split = LayerSplit((0, 1, 2), (0, 1, 2, 3))
    res = [Residency(3, 4, [], 256) for _ in range(3)]
    chunks = [[plan_walk(spec, res[p.index], 2, True, 64, part=p) for p in split.parts]
              for _ in range(2)]
    check_split(split, chunks, res)
    chunks[1][1] = _drop(chunks[1][1], lambda op: op == Wait(("handoff_taken", 2), "compute"))
    with pytest.raises(PlanHazardError, match=r"part 1 \(device 1\), chunk 1: .*HandOff "
                       r"overwrites the residual that part 2's HandOff"):
        check_split(split, chunks, res)


def test_reject_hand_off_ops_on_one_device_and_wrong_senders():
    split, res, chunks = _two_part_case(1)
    with pytest.raises(PlanHazardError, match="check them together"):
        check(chunks[0][1], res[1])
    wrong = [LayerPlan(lp.layer, tuple(HandOff(2, 5, 1) if isinstance(op, HandOff) else op
                                       for op in lp.ops)) for lp in chunks[0][1].layers]
    chunks[0][1] = ChunkPlan(64, "walk", 4, wrong)
    with pytest.raises(PlanHazardError, match="receives from part 0 at layer 2"):
        check_split(split, chunks, res)


def test_reject_a_ready_wait_never_recorded():
    split, res, chunks = _two_part_case(1)
    chunks[0][0] = _drop(chunks[0][0], lambda op: isinstance(op, Record)
                         and op.event[0] == HANDOFF_READY)
    with pytest.raises(PlanHazardError, match=r"Wait\(handoff_ready\[2\]\) waits on a "
                       "hand-off event that was never recorded"):
        check_split(split, chunks, res)


def test_split_rule_balances_the_streamed_bytes():
    assert choose_split([10] * 8, (0, 1), [0, 0]).bounds == (0, 4, 8)
    assert choose_split([10] * 9, (0, 1, 2), [0, 0, 0]).bounds == (0, 3, 6, 9)
    # a device holding more resident bytes takes more layers
    assert choose_split([10] * 8, (0, 1), [30, 0]).bounds == (0, 5, 8)
    # everything fits: the layers' bytes (compute) are balanced
    assert choose_split([10, 10, 40, 10], (0, 1), [1000, 1000]).bounds == (0, 2, 4)
    with pytest.raises(ConfigError, match="3 devices for 2 layers"):
        choose_split([1, 1], (0, 1, 2), [0, 0, 0])


@pytest.mark.parametrize("value, why", [
    ([0, 0], "names a device twice"), ([-1], "not a device index"), ([], "empty"),
    ("0,x", "expected device indices"), ([True], "not a device index"), (3, "a list"),
])
def test_devices_setting_errors(value, why):
    with pytest.raises(ConfigError, match=why):
        parse_devices(value)


def test_devices_setting_reads_lists_and_text():
    assert parse_devices([1, 0]) == (1, 0)
    assert parse_devices("0, 1") == (0, 1)
