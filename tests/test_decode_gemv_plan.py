"""The gemv decode plan (STRATA_DECODE=gemv: each layer's experts as one RoutedExperts, the
matrix-vector launches over the routed pairs): its shape, the hazard checker's rules for the
op, the switch and its refusal of a format without the kernels, and on the reference backend
the same bytes and counters as the routed decode plan whose groups it stands for."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata_rt.config.settings import env
from strata_rt.config.settings.engine_config import DECODES
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.gemm.ggml_gemv import GEMV_HEADER, GEMV_SOURCE, GEMV_WARPS
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.report.stats import Stats
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    HOST,
    RESIDENT,
    RING,
    ChunkInput,
    ChunkPlan,
    GatherRouted,
    LayerBegin,
    LayerEnd,
    LayerPlan,
    Products,
    Record,
    RoutedExperts,
    Wait,
    lane_fork,
    lane_join,
)
from strata_rt.schedule.plan_counts import add_counts, op_counts
from strata_rt.schedule.plan_keys import DECODE_KEY, GEMV_DECODE_KEY, decode_key, resolve_decode
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import plan_decode
from strata_rt.schedule.vram.residency import Residency

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                 ffn=256, n_experts=32, top_k=4, context=512)


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 11, "q4_k")


def _residency(model: Qwen3Model, n: int) -> Residency:
    return Residency.from_budget(model.moe, n)


def _plan(model: Qwen3Model, n_resident: int, **kw) -> ChunkPlan:
    return plan_decode(model.moe.spec, _residency(model, n_resident),
                       DenseSchedule(SPEC.n_layers, None, None), gemv=True, **kw)


@pytest.mark.parametrize("in_place", [False, True])
def test_one_routed_experts_per_layer(model, in_place) -> None:
    """Per layer: routing, one RoutedExperts naming every expert where it lies, the combine;
    no GatherRouted and no Products (in_place changes nothing: nothing is gathered)."""
    res = _residency(model, 20)
    plan = plan_decode(model.moe.spec, res, DenseSchedule(SPEC.n_layers, None, None),
                       in_place=in_place, gemv=True)
    assert plan.mode == "decode" and plan.count(RoutedExperts) == SPEC.n_layers
    assert plan.count(GatherRouted) == plan.count(Products) == 0
    for lp in plan.layers:
        kinds = [type(op) for op in lp.ops]
        assert kinds.index(LayerBegin) < kinds.index(RoutedExperts) < kinds.index(LayerEnd)
        op = next(op for op in lp.ops if isinstance(op, RoutedExperts))
        assert op.layer == lp.layer and len(op.sources) == SPEC.n_experts
        for e, src in enumerate(op.sources):
            slot = res.slot(lp.layer, e)
            assert src == ((HOST, 0) if slot is None else (RESIDENT, slot))
    check(plan, res)


def test_routed_experts_stands_for_the_routed_groups(model) -> None:
    """What the numpy executor runs for the op: the routed plan's GatherRouted + Products of
    every group of the layer, the same ops the plan without gemv holds."""
    res = _residency(model, 20)
    routed = plan_decode(model.moe.spec, res, DenseSchedule(SPEC.n_layers, None, None))
    gemv = _plan(model, 20)
    for lr, lg in zip(routed.layers, gemv.layers):
        op = next(op for op in lg.ops if isinstance(op, RoutedExperts))
        groups = [o for o in lr.ops if isinstance(o, GatherRouted | Products)]
        assert op.stands_for() == groups


def test_counters_count_two_launches(model) -> None:
    stats = Stats()
    ops = [op for _, op in _plan(model, 20).ops()]
    add_counts(stats, op_counts(ops), 0)
    assert stats.mmq_launches == 2 * SPEC.n_layers and stats.gathers_launched == 0


def _layer(*ops) -> ChunkPlan:
    return ChunkPlan(1, "decode", 0, [LayerPlan(0, (ChunkInput(), LayerBegin(0), *ops,
                                                    LayerEnd(0)))])


def _sources(res: Residency) -> list:
    return [res.source(0, e) for e in range(SPEC.n_experts)]


def _reject(plan: ChunkPlan, res: Residency, pattern: str) -> None:
    with pytest.raises(PlanHazardError, match=pattern):
        check(plan, res)


def test_checker_rules(model) -> None:
    """Sources where the experts lie, one per expert; no ring; no other products of the layer;
    before the combine; off the first lane only behind the fork, and joined before the
    combine."""
    res = _residency(model, 40)
    good = _sources(res)
    check(_layer(RoutedExperts(0, tuple(good))), res)
    resident = next(e for e, s in enumerate(good) if s[0] == RESIDENT)
    streamed = next(e for e, s in enumerate(good) if s[0] == HOST)
    bad = list(good)
    bad[resident] = (HOST, 0)
    _reject(_layer(RoutedExperts(0, tuple(bad))), res, "from the host store, but it resides")
    bad = list(good)
    bad[streamed] = (RESIDENT, 0)
    _reject(_layer(RoutedExperts(0, tuple(bad))), res, f"expert {streamed} .* is not resident")
    bad = list(good)
    bad[streamed] = (RING, 0)
    _reject(_layer(RoutedExperts(0, tuple(bad))), res, "never through the ring")
    _reject(_layer(RoutedExperts(0, tuple(good[:-1]))), res,
            f"31 sources for the layer's {SPEC.n_experts} experts")
    twice = RoutedExperts(0, tuple(good))
    _reject(_layer(twice, twice), res, "both write the layer's routed rows")
    _reject(_layer(twice, Products(0, 1, tuple(range(16, 32)))), res,
            "both write the layer's routed rows")
    late = ChunkPlan(1, "decode", 0, [LayerPlan(0, (ChunkInput(), LayerBegin(0), LayerEnd(0),
                                                    twice))])
    _reject(late, res, "runs after op #2 LayerEnd")
    _reject(_layer(RoutedExperts(0, tuple(good), "copy")), res, "run on a compute lane")
    off = RoutedExperts(0, tuple(good), "compute2")
    _reject(_layer(off), res, "may read the layer's routing before")
    forked = (Record(lane_fork(0), "compute"), Wait(lane_fork(0), "compute2"), off)
    _reject(_layer(*forked), res, "may still be writing")
    check(_layer(*forked, Record(lane_join(0), "compute2"), Wait(lane_join(0), "compute")), res)


def test_switch_choices_and_default(monkeypatch) -> None:
    assert DECODES[0] == "auto" and {"routed", "gemv"} <= set(DECODES)
    monkeypatch.setenv("STRATA_DECODE", "gemv")
    env.validate_all()
    assert env.choice("STRATA_DECODE", DECODES[0]) == "gemv"


def test_decode_key_rule(model) -> None:
    layers = range(SPEC.n_layers)
    assert decode_key("routed", model.moe.formats, layers) == DECODE_KEY
    assert decode_key(None, model.moe.formats, layers) == DECODE_KEY
    assert decode_key("gemv", model.moe.formats, layers) == GEMV_DECODE_KEY
    # auto: gemv where every layer's format offers the kernels (this model's do), else routed
    assert decode_key("auto", model.moe.formats, layers) == GEMV_DECODE_KEY
    q2 = Qwen3Model.synthetic(SPEC, 11, "q2_blob")
    assert resolve_decode("auto", q2.moe.formats, layers) == "routed"
    assert resolve_decode("auto", model.moe.formats, layers) == "gemv"
    assert decode_key("auto", q2.moe.formats, layers) == DECODE_KEY


def test_the_default_decode_is_auto_and_says_what_it_ran(model, monkeypatch) -> None:
    """Unset, STRATA_DECODE is auto: a model whose formats all offer gemv runs it (the same
    logits as routed on the reference backend), and `strata generate`'s summary names it."""
    from strata_rt.cli.generate import summary_lines
    from strata_rt.text.generate import EngineSession, generate

    monkeypatch.delenv("STRATA_DECODE", raising=False)
    ids = np.random.default_rng(4).integers(0, SPEC.vocab, 9)
    with Engine.open({"model": model, "backend": "reference", "prefill": 64}) as eng:
        assert eng.config.decode == "auto" and eng.driver.decode_mode == "gemv"
        assert eng.driver.decode_path == "gemv"
        result = generate(EngineSession(eng), ids, 3, None)
        assert eng.driver.last_plan.count(RoutedExperts) == SPEC.n_layers
        assert "tokens/s (gemv)" in summary_lines(result, eng.driver.decode_path)[1]
    q2 = Qwen3Model.synthetic(SPEC, 11, "q2_blob")
    with Engine.open({"model": q2, "backend": "reference", "prefill": 64}) as eng:
        assert eng.driver.decode_mode == "routed" and eng.driver.decode_path == "routed"


def _generate(model, steps: int, decode: str, monkeypatch, **kw):
    """Greedy steps after a prompt (the hazard checker on every plan): every step's logits,
    the experts and bytes the steps streamed, and the steps' RoutedExperts counts."""
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    ids = np.random.default_rng(4).integers(0, SPEC.vocab, 37)
    conf = {"model": model, "backend": "reference", "prefill": 64, "expert_cache": 24,
            "decode": decode, **kw}
    with Engine.open(conf) as eng:
        logits, _ = eng.prefill(ids)
        out, streamed, nbytes, ops = [logits], 0, 0, []
        for _ in range(steps):
            logits, stats = eng.prefill(np.array([int(logits.argmax())]))
            out.append(logits)
            streamed += stats.experts_streamed
            nbytes += stats.bytes_streamed
            ops.append(eng.driver.last_plan.count(RoutedExperts))
    return out, streamed, nbytes, ops


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_gemv_plan_equals_the_routed_plan(model, monkeypatch, dense) -> None:
    """Five greedy steps with 24 of 64 experts resident on the reference backend: the gemv
    plan gives the routed plan's logits byte for byte and streams the same experts and
    bytes."""
    gemv = _generate(model, 5, "gemv", monkeypatch, dense=dense)
    routed = _generate(model, 5, "routed", monkeypatch, dense=dense)
    assert gemv[3] == [SPEC.n_layers] * 5 and routed[3] == [0] * 5
    for a, b in zip(gemv[0], routed[0]):
        assert np.array_equal(a, b)
    assert gemv[1] == routed[1] > 0 and gemv[2] == routed[2] > 0


def test_gemv_refuses_a_format_without_the_kernels(monkeypatch) -> None:
    """No silent fallback: a model whose format has no gemv_routed is refused at open, named."""
    q2 = Qwen3Model.synthetic(SPEC, 11, "q2_blob")
    conf = {"model": q2, "backend": "reference", "prefill": 64, "decode": "gemv"}
    with pytest.raises(ConfigError, match="format q2_blob of layer 0 does not offer"):
        Engine.open(conf)


def test_gemv_kernels_are_listed_and_their_geometry_read() -> None:
    """The GGML formats list gemv.cu (check-kernels compiles it), and the launcher's rows per
    block come from the header's one line."""
    from strata_rt.formats.registry import registry

    fmt = registry().formats["q4_k"].format
    assert GEMV_SOURCE in fmt.kernel_sources() and fmt.offers_gemv_routed()
    assert not registry().formats["q2_blob"].format.offers_gemv_routed()
    line = re.search(r"GEMV_WARPS = (\d+);", GEMV_HEADER.read_text())
    assert line is not None and int(line.group(1)) == GEMV_WARPS


@pytest.mark.parametrize("host_experts", [0, 3])
def test_routed_experts_tell_the_format_when_they_read_host_memory(monkeypatch,
                                                                    host_experts) -> None:
    """RoutedExpertsRunner on a stand-in backend: the layer's table row holds each expert's
    address where its source says, and gemv_routed hears host_reads exactly when some source
    is the host store (the launches then take more warps: ggml_gemv.gemv_warps)."""
    from types import SimpleNamespace

    from strata_rt.backends.cuda.experts import routed_experts as rx

    calls: list[dict] = []

    class Kernels:
        def gemv_routed(self, stream, experts, ids, row_of, acts, mid, out, pairs,
                        host_reads=False):
            calls.append({"experts": experts, "pairs": pairs, "host_reads": host_reads})

    rows: list[np.ndarray] = []
    dev = SimpleNamespace(ptr={"resident": 1 << 30, "expert_table": 1 << 33, "topk_ids": 8,
                               "row_of": 16, "act_hidden": 24, "act_ffn": 32, "down_out": 40},
                          compute="compute")
    backend = SimpleNamespace(
        spec=SimpleNamespace(n_experts=8, top_k=2), lay=SimpleNamespace(slot_bytes=4096),
        fks=[Kernels()], rt=SimpleNamespace(memcpy_htod=lambda ptr, row, s: rows.append(row)),
        store=SimpleNamespace(arena=object(), offset=lambda layer, e: 100 * e), first=0, _T=1,
        _device=lambda: dev, _mark=lambda phase: None, store_device_address=lambda: 1 << 40)
    sources = tuple((HOST, 0) if e < host_experts else (RESIDENT, e) for e in range(8))
    op = RoutedExperts(layer=0, sources=sources, stream="compute")
    rx.RoutedExpertsRunner(backend).run(op)  # type: ignore[arg-type]
    assert calls == [{"experts": 1 << 33, "pairs": 2, "host_reads": host_experts > 0}]
    want = [(1 << 40) + 100 * e if e < host_experts else (1 << 30) + 4096 * e for e in range(8)]
    assert rows[0].tolist() == want
