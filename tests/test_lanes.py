"""Compute lanes (strata_rt.schedule.vram.lanes, plan.LANES) on the CPU: the rule, the memory they
take, the settings, the reference backend's bytes with one and two lanes, and where the CUDA backend
puts a lane's launches (through the recording fake runtime). The GPU side:
tests/test_cuda_engine.py::test_two_lanes_give_the_same_bytes."""

from __future__ import annotations

import numpy as np
import pytest
from _settings import check_engine_setting, check_yaml_key, run_reference

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import BudgetError, ConfigError
from strata_rt.formats.activations import Q8_1
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.schedule.plan import LANES, Products, Wait, lane_fork
from strata_rt.schedule.vram.lanes import (
    LANES_MAX_ROWS,
    allocated_lanes,
    chunk_lanes,
    parse_lanes,
    walk_rows_hint,
)
from strata_rt.schedule.vram.memory_plan import fixed_regions, lane_buffers, plan_lanes, plan_memory
from strata_rt.weights.model import QWEN3_30B_SPEC, SMALL_SPEC, Model

GIB = 1 << 30


# ---------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("value,want", [(None, "auto"), ("auto", "auto"), (1, "1"), ("2", "2"),
                                        (" 2 ", "2"), ("AUTO", "auto")])
def test_settings_parse(value, want):
    assert parse_lanes(value) == want


@pytest.mark.parametrize("value", [3, 0, "two", "1.5", True])
def test_bad_settings_name_the_choices(value):
    with pytest.raises(ConfigError, match="auto, 1, 2"):
        parse_lanes(value)


def test_auto_takes_two_lanes_only_when_nothing_streams():
    assert allocated_lanes("auto", True) == 2
    assert allocated_lanes("auto", False) == 1
    assert allocated_lanes("1", True) == 1
    assert allocated_lanes("2", False) == 2


def test_chunks_take_two_lanes_while_experts_have_few_rows():
    spec = QWEN3_30B_SPEC
    short = max(t for t in range(1, 40000) if walk_rows_hint(t, spec) <= LANES_MAX_ROWS)
    assert chunk_lanes(2, 254, spec) == chunk_lanes(2, short, spec) == 2
    assert chunk_lanes(2, short + 1, spec) == 1
    assert chunk_lanes(1, 254, spec) == 1
    assert chunk_lanes(2, 254, spec, timing=True) == 1  # phase events sit on one stream


# ---------------------------------------------------------------------------- memory
def test_second_lane_has_its_own_group_buffers():
    from strata_rt.formats.registry import registry

    lay = registry()["iq3_xxs"].layout(SMALL_SPEC.hidden, SMALL_SPEC.ffn)
    one = fixed_regions(SMALL_SPEC, lay, 8)
    two = fixed_regions(SMALL_SPEC, lay, 8, lanes=2)
    gu2, dn2 = lane_buffers(LANES[1])
    assert lane_buffers(LANES[0]) == ("gate_up_buf", "down_buf")
    assert gu2 not in one and dn2 not in one
    assert two[gu2] == one["gate_up_buf"] == MMQ_GROUP * lay.gate_up_image_bytes
    assert two[dn2] == one["down_buf"]
    assert set(two) - set(one) == {gu2, dn2}


def _plan(lay, available, n_resident):
    def plan(lanes):
        return plan_memory(SMALL_SPEC, lay, Q8_1, available, 8, 1024, n_resident, lanes=lanes)
    return plan


def test_plan_lanes_under_each_setting():
    from strata_rt.formats.registry import registry

    lay = registry()["iq3_xxs"].layout(SMALL_SPEC.hidden, SMALL_SPEC.ffn)
    total = SMALL_SPEC.total_experts
    lanes, mp = plan_lanes("auto", total, total, _plan(lay, 8 * GIB, total))
    assert lanes == 2 and "gate_up_buf2" in mp.regions
    lanes, mp = plan_lanes("auto", total // 2, total, _plan(lay, 8 * GIB, total // 2))
    assert lanes == 1 and "gate_up_buf2" not in mp.regions
    lanes, mp = plan_lanes("2", 0, total, _plan(lay, 8 * GIB, 0))
    assert lanes == 2 and "down_buf2" in mp.regions
    lanes, _ = plan_lanes("auto", None, total, _plan(lay, 8 * GIB, None))
    assert lanes == 2  # the budget held every expert beside both lanes
    snug = _plan(lay, 8 * GIB, None)(1).total  # every expert beside one lane, nothing more
    lanes, mp = plan_lanes("auto", None, total, _plan(lay, snug, None))
    assert lanes == 1 and mp.n_resident == total  # not a resident slot given up for a lane


def test_auto_never_gives_up_a_chunk_token_or_a_fit_for_a_lane():
    """Where a second lane's buffers do not fit, or would shorten `prefill: auto`'s chunk,
    auto keeps one lane and the one-lane plan."""
    from strata_rt.formats.registry import registry

    lay = registry()["iq3_xxs"].layout(SMALL_SPEC.hidden, SMALL_SPEC.ffn)
    total = SMALL_SPEC.total_experts
    need = _plan(lay, 8 * GIB, total)(1).total  # a 1,024-token chunk beside every expert
    with pytest.raises(BudgetError):
        _plan(lay, need, total)(2)
    lanes, mp = plan_lanes("auto", total, total, _plan(lay, need, total))
    assert lanes == 1 and mp.tokens == 1024

    def auto_chunk(available):
        def plan(lanes):
            return plan_memory(SMALL_SPEC, lay, Q8_1, available, 8, "auto", total, lanes=lanes)
        return plan

    full = auto_chunk(8 * GIB)(1)
    lanes, mp = plan_lanes("auto", total, total, auto_chunk(full.total))
    assert mp.tokens == full.tokens
    assert lanes == 1  # a second lane there would have cost chunk tokens
    lanes, mp = plan_lanes("auto", total, total, auto_chunk(8 * GIB))
    assert lanes == 2 and mp.tokens == full.tokens


def test_a_second_lane_that_does_not_fit_says_how_to_drop_it():
    from strata_rt.formats.registry import registry

    lay = registry()["iq3_xxs"].layout(SMALL_SPEC.hidden, SMALL_SPEC.ffn)
    need = _plan(lay, 8 * GIB, 0)(1).total
    with pytest.raises(BudgetError, match="compute_lanes: 1"):
        _plan(lay, need + 1, 0)(2)


# ---------------------------------------------------------------------------- settings
def test_engine_config_reads_the_setting_and_the_environment(monkeypatch):
    check_engine_setting(monkeypatch, "compute_lanes", "STRATA_COMPUTE_LANES", "auto", "1", "2",
                         "4", "3")


def test_yaml_key(tmp_path):
    check_yaml_key(tmp_path, "compute_lanes", 2, "2", "many")


# ---------------------------------------------------------------------------- reference bytes
@pytest.fixture(scope="module")
def small() -> Model:
    return Model.synthetic(SMALL_SPEC, 77)


def _lanes_used(plan) -> set[str]:
    return {op.stream for _, op in plan.ops() if isinstance(op, Products)}


@pytest.mark.parametrize("cache", [0, SMALL_SPEC.total_experts // 2, SMALL_SPEC.total_experts])
def test_reference_bytes_do_not_depend_on_lanes(small, rng, cache, fixed_walk_rule):
    """A staging prompt and a walk prompt, streamed, mixed and all resident: two lanes (their
    own group buffers, poisoned until gathered) give the bytes of one. Table products off: a
    whole resident layer keeps its per-group products, which the lanes share out."""
    prompts = [rng.standard_normal((n, SMALL_SPEC.hidden), dtype=np.float32)
               for n in (200, 1100)]
    one, plans1 = run_reference(small, prompts, expert_cache=cache, compute_lanes="1",
                                table_products="off")
    two, plans2 = run_reference(small, prompts, expert_cache=cache, compute_lanes="2",
                                table_products="off")
    for a, b in zip(one, two):
        assert a.tobytes() == b.tobytes()
    assert all(_lanes_used(p) == {LANES[0]} for p in plans1)
    assert all(_lanes_used(p) == set(LANES) for p in plans2)


def test_auto_plans_two_lanes_when_every_expert_is_resident(small, rng, fixed_walk_rule):
    h = rng.standard_normal((1100, SMALL_SPEC.hidden), dtype=np.float32)
    _, (full,) = run_reference(small, [h], expert_cache=SMALL_SPEC.total_experts)
    _, (part,) = run_reference(small, [h], expert_cache=10)
    assert _lanes_used(full) == set(LANES) and _lanes_used(part) == {LANES[0]}
    forks = [op for _, op in full.ops() if isinstance(op, Wait) and op.event == lane_fork(0)]
    assert len(forks) == 1 and forks[0].stream == LANES[1]


# ---------------------------------------------------------------------------- CUDA backend
def test_cuda_backend_puts_each_group_on_its_lane(fake, fixed_walk_rule):
    """Two lanes on the recording runtime: a walk's gathers and GEMMs alternate between the
    compute streams group by group, each lane's gathers write its own buffers and its GEMMs
    read them; a captured walk takes the second lane into the capture (it waits for the
    fork first) and gives it back."""
    model = Model.synthetic(SMALL_SPEC, 5)
    spec = model.spec
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=spec.total_experts,
                       check_plan=True, timing=False)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        assert eng.backend.lanes == 2
        bufs = {lane: [rt.arena.ptr(name) for name in lane_buffers(lane)] for lane in LANES}
        rt.launched_on.clear()
        rt.tokens = 1024
        eng.prefill(np.ones((1024, spec.hidden), np.float32))
        gathers = [(s, args[MMQ_GROUP]) for name, s, args in rt.launched_on
                   if name == "iq3_dequant_gather"]
        groups = spec.n_experts // MMQ_GROUP
        assert [s for s, _ in gathers] == [LANES[g % 2] for g in range(groups)] * spec.n_layers
        assert all(buf == bufs[s][0] for s, buf in gathers)
        gemms = [(s, args[MMQ_GROUP]) for name, s, args in rt.launched_on
                 if name.startswith("gemm_f16")]
        assert len(gemms) == 2 * groups * spec.n_layers
        assert {s for s, _ in gemms} == set(LANES)
        assert all(w in bufs[s] for s, w in gemms)
        eng.prefill(np.ones((1024, spec.hidden), np.float32))  # the graph trial: a capture
        lane2 = eng.backend.dev.streams[LANES[1]]
        assert ("wait", "walk fork") in lane2.log and ("record", "walk join") in lane2.log
    assert EngineConfig(model=model).resolve().compute_lanes == "auto"


def test_cuda_backend_under_timing_plans_one_lane(fake, fixed_walk_rule):
    model = Model.synthetic(SMALL_SPEC, 6)
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=SMALL_SPEC.total_experts,
                       timing=True)
    with Engine.open(cfg) as eng:
        fake["rt"].tokens = 1024
        eng.prefill(np.ones((1024, SMALL_SPEC.hidden), np.float32))
        assert _lanes_used(eng.driver.last_plan) == {LANES[0]}
