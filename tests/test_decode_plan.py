"""The decode plan (a whole model's one-token step with its routed set kept on the device):
its shape, the hazard checker's rules for gathers that read the host store, and on the
reference backend the same bytes and counters as the staging ring it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.config.settings import env
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    HOST,
    RESIDENT,
    Attention,
    ChunkInput,
    ChunkPlan,
    Copy,
    Gather,
    GatherRouted,
    LayerBegin,
    LayerEnd,
    LayerPlan,
    Products,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import plan_decode
from strata_rt.schedule.vram.residency import Residency

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                 ffn=256, n_experts=32, top_k=4, context=512)


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 11, "iq3_xxs")


def _residency(model: Qwen3Model, n: int) -> Residency:
    return Residency.from_budget(model.moe, n)


@pytest.mark.parametrize("ring", [None, 2])
def test_plan_shape_and_checker(model, ring) -> None:
    """Per layer: Attention without a start, routing, one GatherRouted and one Products per
    group of 16, combine; resident experts from their slots, the rest from the host store;
    no Copy. The checker accepts it, with resident and with streamed dense weights."""
    res = _residency(model, 20)
    plan = plan_decode(model.moe.spec, res, DenseSchedule(SPEC.n_layers, None, ring))
    assert plan.mode == "decode" and plan.tokens == 1 and plan.count(Copy) == 0
    for lp in plan.layers:
        kinds = [type(op) for op in lp.ops]
        att = next(op for op in lp.ops if isinstance(op, Attention))
        assert att.start is None and (att.dense_slot is None) == (ring is None)
        assert kinds.index(Attention) < kinds.index(LayerBegin) < kinds.index(GatherRouted)
        assert kinds[-1] is LayerEnd and kinds.count(GatherRouted) == kinds.count(Products) == 2
        for op in lp.ops:
            if isinstance(op, GatherRouted):
                for pos, g in enumerate(op.gathers):
                    assert g.pos == pos and g.expert == 16 * op.group + pos
                    slot = res.slot(lp.layer, g.expert)
                    assert g.src == ((HOST, 0) if slot is None else (RESIDENT, slot))
    check(plan, res)


def test_plan_refuses_a_fixed_start(model) -> None:
    with pytest.raises(ValueError, match="reads its position on the device"):
        plan_decode(model.moe.spec, _residency(model, 0), DenseSchedule(SPEC.n_layers, 7))


def _one_layer(*ops) -> ChunkPlan:
    return ChunkPlan(1, "decode", 0,
                     [LayerPlan(0, (ChunkInput(), LayerBegin(0), *ops, LayerEnd(0)))])


def test_checker_rules_for_host_reads(model) -> None:
    res = _residency(model, 40)  # layer 0 experts 0..; some resident, some not
    resident = next(e for e in range(SPEC.n_experts) if res.slot(0, e) is not None)
    streamed = next(e for e in range(SPEC.n_experts) if res.slot(0, e) is None)
    host = Gather(0, 0, 0, streamed, (HOST, 0))
    check(_one_layer(GatherRouted(0, (host,)), Products(0, 0, (streamed,))), res)
    with pytest.raises(PlanHazardError, match="only a GatherRouted reads the host store"):
        check(_one_layer(host, Products(0, 0, (streamed,))), res)
    wrong = Gather(0, 0, 0, resident, (HOST, 0))
    with pytest.raises(PlanHazardError, match="resides in slot"):
        check(_one_layer(GatherRouted(0, (wrong,))), res)
    with pytest.raises(PlanHazardError, match="not group 0 position 0"):
        check(_one_layer(GatherRouted(0, (Gather(0, 1, 0, streamed, (HOST, 0)),))), res)
    with pytest.raises(PlanHazardError, match="no expert ring"):
        check(_one_layer(Copy(0, 0, streamed, 0)), res)


def _generate(model, steps: int, decode: str, monkeypatch, **kw):
    """Greedy steps after a prompt; every step's logits and the counters of the steps."""
    monkeypatch.setenv("STRATA_DECODE", decode)
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    ids = np.random.default_rng(4).integers(0, SPEC.vocab, 37)
    conf = {"model": model, "backend": "reference", "prefill": 64, "expert_cache": 24, **kw}
    with Engine.open(conf) as eng:
        logits, _ = eng.prefill(ids)
        out, streamed, nbytes, modes = [logits], 0, 0, []
        for _ in range(steps):
            logits, stats = eng.prefill(np.array([int(logits.argmax())]))
            out.append(logits)
            streamed += stats.experts_streamed
            nbytes += stats.bytes_streamed
            modes.append(eng.driver.last_plan.mode)
    return out, streamed, nbytes, modes


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_decode_plan_equals_the_staging_ring(model, monkeypatch, dense) -> None:
    """Six greedy steps with 24 of 64 experts resident: the same logits byte for byte and the
    same experts and bytes streamed (routed, non-resident) as the staging ring."""
    routed = _generate(model, 6, "routed", monkeypatch, dense=dense)
    staged = _generate(model, 6, "staging", monkeypatch, dense=dense)
    assert routed[3] == ["decode"] * 6 and staged[3] == ["staging"] * 6
    for a, b in zip(routed[0], staged[0]):
        assert np.array_equal(a, b)
    assert routed[1] == staged[1] > 0 and routed[2] == staged[2] > 0


def test_decode_switch_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("STRATA_DECODE", "graph")
    with pytest.raises(ConfigError, match="STRATA_DECODE"):
        env.validate_all()


def test_decode_field_beats_the_switch_and_takes_the_next_step(model, monkeypatch) -> None:
    """EngineConfig.decode over STRATA_DECODE; changed on an open engine (an in-process
    comparison of the two paths), the next step takes it, with the same logits."""
    monkeypatch.setenv("STRATA_DECODE", "staging")
    ids = np.random.default_rng(4).integers(0, SPEC.vocab, 37)
    conf = {"model": model, "backend": "reference", "prefill": 64, "expert_cache": 24,
            "decode": "routed"}
    with Engine.open(conf) as eng:
        logits, _ = eng.prefill(ids)
        token = np.array([int(logits.argmax())])
        routed, _ = eng.prefill(token)
        assert eng.driver.last_plan.mode == "decode"
        eng.config.decode = "staging"
        eng.reset()  # the same prompt and step again, the step on the staging ring
        eng.prefill(ids)
        staged, _ = eng.prefill(token)
        assert eng.driver.last_plan.mode == "staging"
    assert np.array_equal(routed, staged)
