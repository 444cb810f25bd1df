"""A routed walk's copies over several copy streams (plan.COPY_CHAINS, `copy_chains`).

Entry k goes on COPY_CHAINS[k % chains]; each chain waits for its layer's copies_routed and
records each slot's copied itself. CPU: such plans on random residencies pass the hazard
checker with that shape; hand-broken ones (a chain not waiting for the switches, a refill not
waiting for the slot's readers, a plain walk's copy off the first stream) are rejected; on the
reference backend every chain count gives the walk's logits byte for byte; the setting is
checked and resolved once. GPU: the captured routed walk on four chains against the walk."""

from __future__ import annotations

import numpy as np
import pytest
from _settings import check_engine_setting
from test_routed_walk import MOE, SPEC, _prefill, _random_scenario, _reject

from strata_rt.config.settings.engine_config import EngineConfig
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    COPY_CHAINS,
    ChunkPlan,
    Copy,
    LayerPlan,
    Wait,
    copies_routed,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import plan_walk
from strata_rt.schedule.vram.image_cache import ImageCache
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import SMALL_SPEC


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 5, "iq3_xxs")


def _walk(res: Residency, chains: int, ring: int = 20, lanes: int = 1,
          start: int | None = None, in_place: bool = False,
          images: ImageCache | None = None, routed: bool = True) -> ChunkPlan:
    attention = None if start is None else DenseSchedule(SPEC.n_layers, start, None)
    return plan_walk(MOE, res, ring, False, tokens=64, attention=attention, lanes=lanes,
                     in_place=in_place, routed_copies=routed, images=images,
                     copy_chains=chains)


@pytest.mark.parametrize("chains", [2, 3, 4])
@pytest.mark.parametrize("lanes,start", [(1, None), (2, 9)])
def test_chained_routed_walks_pass_the_checker(model, rng, chains, lanes, start) -> None:
    """Random residencies, rings, in-place reads and image caches: the checker is content, each
    Copy runs on its entry's chain, and every chain waits for the layer's switches before its
    first copy of that layer."""
    for _ in range(8):
        res, ring, images = _random_scenario(model, rng)
        plan = _walk(res, chains, ring, lanes, start, bool(rng.integers(2)), images)
        check(plan, res, images=images)
        waited: set[tuple[str, int]] = set()
        used_chains = set()
        for _, op in plan.ops():
            if isinstance(op, Wait) and op.event[0] == copies_routed(0)[0]:
                waited.add((op.stream, op.event[1]))
            if isinstance(op, Copy):
                assert op.stream == COPY_CHAINS[op.entry % chains]
                assert (op.stream, op.layer) in waited
                used_chains.add(op.stream)
        if int((~res.mask()).sum()) >= chains:
            assert used_chains == set(COPY_CHAINS[:chains])


def _drop(plan: ChunkPlan, gone) -> ChunkPlan:
    return ChunkPlan(plan.tokens, plan.mode, plan.ring_slots,
                     [LayerPlan(lp.layer, tuple(op for op in lp.ops if not gone(op)))
                      for lp in plan.layers])


def test_broken_chained_walks_are_rejected() -> None:
    res = Residency(SPEC.n_layers, SPEC.n_experts, [(0, 3), (1, 5)], 256)
    plan = _walk(res, 4)
    check(plan, res)
    _reject(_drop(plan, lambda op: op == Wait(copies_routed(1), "copy3")), res,
            r"Copy\(entry \d+, layer 1.*\) may run before", r"Wait\(copies_routed\[1\]\) on "
            r"copy3")
    # the ring's second round: a refill on copy2 that no longer waits for the slot's readers
    refills = [op for _, op in plan.ops() if isinstance(op, Wait) and op.event[0] == "used"
               and op.stream == "copy2"]
    assert refills
    _reject(_drop(plan, lambda op: op == refills[0]), res, r"refills the slot while",
            rf"no Wait\(used\[{refills[0].event[1]}\]\) on copy2")
    plain = _walk(res, 1, routed=False)
    moved = ChunkPlan(plain.tokens, plain.mode, plain.ring_slots, [
        LayerPlan(lp.layer, tuple(Copy(op.entry, op.layer, op.expert, op.slot, False, "copy2")
                                  if isinstance(op, Copy) else op for op in lp.ops))
        for lp in plain.layers])
    _reject(moved, res, r"runs on copy2: a copy goes on copy, or in a routed walk on one of")


def test_copy_chains_out_of_range_are_refused() -> None:
    res = Residency(SPEC.n_layers, SPEC.n_experts, [], 256)
    with pytest.raises(ValueError, match="copy_chains=5: a routed walk has 1..4"):
        _walk(res, 5)
    assert {op.stream for _, op in _walk(res, 4, routed=False).ops()
            if isinstance(op, Copy)} == {"copy"}  # a plain walk keeps one copy stream


def test_reference_chained_routed_walks_give_the_walks_bytes(model, monkeypatch, rng) -> None:
    ids = rng.integers(0, SPEC.vocab, 8)
    [(lw, _, _, _)], _ = _prefill(model, ids, "walk", monkeypatch)
    streamed = set()
    for chains in ("1", "2", "4"):
        [(lr, sr, mr, _)], _ = _prefill(model, ids, "routed_walk", monkeypatch,
                                        copy_chains=chains)
        assert mr == "routed_walk" and lr.tobytes() == lw.tobytes()
        streamed.add(sr.bytes_streamed)
    assert len(streamed) == 1


def test_copy_chains_setting(monkeypatch) -> None:
    check_engine_setting(monkeypatch, "copy_chains", "STRATA_COPY_CHAINS", "1", "2", "4", "5",
                         "0")
    monkeypatch.delenv("STRATA_COPY_CHAINS")
    cfg = EngineConfig(model=SMALL_SPEC, copy_chains="3").resolve()  # type: ignore[arg-type]
    assert cfg.copy_streams == 3
    timed = EngineConfig(model=SMALL_SPEC, copy_chains="3",  # type: ignore[arg-type]
                         timing=True).resolve()
    assert timed.copy_streams == 1  # the phase timer times copies on the first stream


@pytest.mark.gpu
def test_cuda_chained_routed_walk_equals_the_walk(monkeypatch, rng) -> None:
    """On the GPU, plain, captured and replayed: the routed walk on four copy streams gives the
    walk's logits byte for byte and streams fewer bytes."""
    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=32, top_k=4, context=512)
    gpu_model = Qwen3Model.synthetic(spec, 6, "iq3_xxs")
    ids = rng.integers(0, spec.vocab, 12)
    walk, _ = _prefill(gpu_model, ids, "walk", monkeypatch, "cuda", 3)
    routed, walk_bytes = _prefill(gpu_model, ids, "routed_walk", monkeypatch, "cuda", 3,
                                  copy_chains="4")
    for (lw, sw, _, _), (lr, sr, mr, _) in zip(walk, routed):
        assert mr == "routed_walk" and lr.tobytes() == lw.tobytes()
        assert 0 < sr.bytes_streamed < sw.bytes_streamed == walk_bytes
    (trial,) = [t for key, t in routed[-1][3].items() if key[1] == "routed_walk"]
    assert "error" not in trial and "graph" in trial
    np.testing.assert_array_equal(routed[-1][0], walk[-1][0])
