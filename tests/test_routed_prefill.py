"""The routed plan for prefill chunks (planner.plan_routed) and the walk-or-routed rule
(schedule/prefill_stream.py): plans the hazard checker accepts, the walk's bytes on the
reference backend, only routed non-resident experts counted as streamed, and a rule that
follows the routing measured on earlier chunks."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.config.settings import env
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import HOST, RESIDENT, Copy, GatherRouted, Products
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import plan_routed
from strata_rt.schedule.prefill_stream import StreamChooser
from strata_rt.schedule.vram.residency import Residency

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                 ffn=256, n_experts=32, top_k=4, context=512)


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 5, "iq3_xxs")


@pytest.mark.parametrize("ring", [None, 2])
@pytest.mark.parametrize("start", [None, 0, 77])
def test_routed_plans_are_checked_on_random_residencies(model, ring, start) -> None:
    """Random resident sets: no Copy, every group gathered by one GatherRouted (resident
    members from their slots, the rest from the host store) or read in place, and the hazard
    checker accepts every plan."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        res = Residency.from_budget(model.moe, int(rng.integers(0, SPEC.n_layers
                                                               * SPEC.n_experts + 1)))
        attention = None if start is None else DenseSchedule(SPEC.n_layers, start, ring)
        in_place = bool(rng.integers(2))
        plan = plan_routed(model.moe.spec, res, attention, in_place, 100)
        assert plan.mode == "routed" and plan.tokens == 100 and plan.count(Copy) == 0
        check(plan, res)
        for lp in plan.layers:
            for op in lp.ops:
                if isinstance(op, GatherRouted):
                    for g in op.gathers:
                        slot = res.slot(g.layer, g.expert)
                        assert g.src == ((HOST, 0) if slot is None else (RESIDENT, slot))
                if isinstance(op, Products) and op.slots is not None:
                    assert in_place


def _prefill(model, ids_list, stream: str, monkeypatch, expert_cache: int = 24):
    monkeypatch.setenv("STRATA_PREFILL_STREAM", stream)
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    conf = {"model": model, "backend": "reference", "prefill": 128,
            "expert_cache": expert_cache}
    out = []
    with Engine.open(conf) as eng:
        for ids in ids_list:
            eng.reset()
            logits, stats = eng.prefill(np.asarray(ids))
            out.append((logits, stats, eng.driver.last_plan.mode,
                        eng.driver.walk_bytes()))
    return out


def test_routed_plan_gives_the_walks_bytes_and_streams_only_routed_experts(
        model, monkeypatch) -> None:
    """A 60-token prompt, 24 of 64 experts resident: the routed plan's logits equal the
    walk's byte for byte; it counts as streamed only the routed non-resident experts, never
    more than the walk copies."""
    ids = np.random.default_rng(8).integers(0, SPEC.vocab, 60)
    (walk_logits, walk_stats, walk_mode, walk_bytes), = _prefill(model, [ids], "walk",
                                                                 monkeypatch)
    (rt_logits, rt_stats, rt_mode, _), = _prefill(model, [ids], "routed", monkeypatch)
    assert walk_mode == "walk" and rt_mode == "routed"
    assert rt_logits.tobytes() == walk_logits.tobytes()
    assert walk_stats.bytes_streamed == walk_bytes > 0
    assert 0 < rt_stats.bytes_streamed <= walk_stats.bytes_streamed


@pytest.mark.parametrize("switches", [True, False])
def test_auto_streams_only_routed_experts_once_a_length_routes_few(model, monkeypatch,
                                                                   switches) -> None:
    """One token repeated 40 times routes the same top-4 experts at every position, so a
    layer routes 4 of its 32 experts: the first prompt of that length walks and measures it,
    the next streams only its routed experts, by the routed walk where the backend switches
    copies and by the routed plan where it cannot, with the same logits; a varied prompt of a
    length never measured walks."""
    from strata_rt.backends.reference.executor import ReferenceBackend

    monkeypatch.setattr(ReferenceBackend, "routed_copies", switches)
    same = np.full(40, 7)
    varied = np.random.default_rng(9).integers(0, SPEC.vocab, 50)
    runs = _prefill(model, [same, same, varied], "auto", monkeypatch)
    (l0, s0, m0, wb), (l1, s1, m1, _), (_, _, m2, _) = runs
    assert (m0, m1, m2) == ("walk", "routed_walk" if switches else "routed", "walk")
    assert l1.tobytes() == l0.tobytes()
    assert s0.bytes_streamed == wb and s1.bytes_streamed < 0.5 * wb


def test_chooser_rule() -> None:
    c = StreamChooser(share=0.5, max_tokens=4096)  # a round share for the arithmetic
    assert c.choose(254, 1000) == "walk"  # nothing measured
    c.observe(1030, 400)
    assert c.estimate(254) == 400 and c.estimate(2000) is None
    assert c.choose(254, 1000) == "routed" and c.choose(2000, 1000) == "walk"
    c.observe(254, 600)
    assert c.choose(254, 1000) == "walk"  # its own measurement wins over the longer one's
    assert c.choose(8192, 1000) == "walk" and c.choose(254, 0) == "walk"
    assert c.choose(254, 1000, forced="routed") == "routed"
    assert c.choose(100, 10**9, forced="routed_walk") == "routed_walk"
    c.observe(300, 100)
    assert c.choose(300, 1000, routed_copies=True) == "routed_walk"
    assert c.choose(300, 1000, routed_copies=False) == "routed"
    assert c.choose(100, 10**9, forced="walk") == "walk"
    assert not c.wants_routing(8192) and c.wants_routing(4096)


def test_prefill_stream_switch_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("STRATA_PREFILL_STREAM", "copy")
    with pytest.raises(ConfigError, match="STRATA_PREFILL_STREAM"):
        env.validate_all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["iq3_xxs", "q4_k", "q6_k"])
@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_cuda_routed_plan_equals_the_walk(monkeypatch, fmt, dense) -> None:
    """On the GPU, three prompts of two lengths (the second run of a length replays its
    captured graph): the routed plan's logits equal the walk's byte for byte, and it streams
    fewer bytes than the walk copies."""
    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=32, top_k=4, context=512)  # a head the GPU kernels have
    model = Qwen3Model.synthetic(spec, 6, fmt)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, spec.vocab, n) for n in (48, 48, 100)]
    got = {}
    for stream in ("walk", "routed"):
        monkeypatch.setenv("STRATA_PREFILL_STREAM", stream)
        monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
        conf = {"model": model, "backend": "cuda", "prefill": 128, "expert_cache": 24,
                "dense": dense}
        with Engine.open(conf) as eng:
            runs = []
            for ids in prompts:
                eng.reset()
                logits, stats = eng.prefill(ids)
                runs.append((logits.copy(), stats.bytes_streamed, eng.driver.last_plan.mode))
        got[stream] = runs
    for (lw, bw, mw), (lr, br, mr) in zip(got["walk"], got["routed"]):
        assert (mw, mr) == ("walk", "routed")
        assert lr.tobytes() == lw.tobytes()
        assert 0 < br < bw
