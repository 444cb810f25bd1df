"""The layer pass (schedule.planners.layer_pass): a prompt of several chunks run layer by layer,
each layer's streamed experts copied once per prompt.

CPU: plans on random residencies, rings, lanes, gather modes, image caches and dense rings pass
the hazard checker, copy each streamed expert once, give every chunk of every layer its rows,
Attention position and combine, and release ring slots only in a layer's last chunk; plans
broken by hand (chunks out of prompt order, a chunk without its input, rows switched inside a
layer, slots released by an earlier chunk, a chunk that skips a layer or an Attention, or stops
short of the last layer) are rejected, each with its reason. On the reference backend the pass
gives the chunk order's logits, greedy token, routing counts and residual dump byte for byte
while streaming the experts once, and names a non-finite row by its position; the choice
(chunks / layers / auto) and its refusals. The CUDA executor's side:
tests/test_layer_pass_cuda_cpu.py and its GPU test."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _settings import check_engine_setting
from test_routed_walk import MOE, SPEC, _random_scenario

from strata_rt.engine import Engine
from strata_rt.errors import ConfigError, PlanHazardError, StrataError
from strata_rt.models.qwen3 import Qwen3Model
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    Attention,
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
    PromptRows,
    Record,
)
from strata_rt.schedule.planners import ring_builder
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.layer_pass import plan_layer_pass, ring_need, windows
from strata_rt.schedule.vram.image_cache import ImageCache
from strata_rt.schedule.vram.residency import Residency

START = 40  # the prompt's first position (a KV cache before it)


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 11, "iq3_xxs")


def _pass(res: Residency, ring: int, chunks, lanes: int = 1, gather_one: bool = False,
          dense: int | None = None, images: ImageCache | None = None,
          in_place: bool = False) -> ChunkPlan:
    attention = DenseSchedule(SPEC.n_layers, None, dense, 0, "tokens")
    return plan_layer_pass(MOE, res, ring, gather_one, START, chunks, attention, images, lanes,
                           in_place)


def _ring_reads(op) -> list[Gather]:
    gathers = op.gathers if isinstance(op, GatherBatch) else (op,) if isinstance(op, Gather) \
        else ()
    return [g for g in gathers if g.src[0] == "ring"]


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("dense", [None, 2])
def test_layer_passes_pass_the_checker(model, rng, lanes, dense) -> None:
    for _ in range(10):
        res, ring, images = _random_scenario(model, rng)
        need = ring_need(res, range(SPEC.n_layers))
        ring = need + int(rng.integers(0, need + 2))  # one layer .. more than two
        tokens = int(rng.integers(2, 90))
        chunks = windows(tokens, int(rng.integers(1, tokens)))
        plan = _pass(res, max(ring, 1), chunks, lanes, bool(rng.integers(2)), dense, images,
                     bool(rng.integers(2)))
        check(plan, res, images=images)
        assert plan.mode == "layer_pass" and plan.tokens == tokens
        ops = [op for _, op in plan.ops()]
        # each streamed expert crosses once per prompt
        copies = [(op.layer, op.expert) for op in ops if isinstance(op, Copy)]
        assert sorted(copies) == sorted(zip(*np.nonzero(~res.mask())))
        for lp in plan.layers:
            rows = [op for op in lp.ops if isinstance(op, PromptRows)]
            assert [(r.first, r.tokens) for r in rows] == chunks
            starts = [op.start for op in lp.ops if isinstance(op, Attention)]
            assert starts == [START + lo for lo, _ in chunks]
            assert sum(isinstance(op, LayerEnd) for op in lp.ops) == len(chunks)
            assert sum(isinstance(op, ChunkInput) for op in lp.ops) == (
                len(chunks) if lp.layer == 0 else 0)
            # slots are released (used, Consume) only after the last chunk's rows are chosen
            last = max(i for i, op in enumerate(lp.ops) if isinstance(op, PromptRows))
            for i, op in enumerate(lp.ops):
                if (isinstance(op, Record) and op.event[0] == "used") or isinstance(op, Consume):
                    assert i > last, f"{op} before the layer's last chunk"


def test_a_ring_smaller_than_a_layer_is_refused(model) -> None:
    res = Residency.from_budget(model.moe, 8)
    need = ring_need(res, range(SPEC.n_layers))
    with pytest.raises(ValueError, match=f"a layer here streams {need}"):
        _pass(res, need - 1, windows(20, 8))


def _reject(plan: ChunkPlan, res: Residency, *patterns: str) -> None:
    with pytest.raises(PlanHazardError) as ei:
        check(plan, res)
    for p in patterns:
        assert re.search(p, str(ei.value)), f"{p!r} not in: {ei.value}"


def _layer_chunks(lp: LayerPlan) -> tuple[list, list[list]]:
    """A layer's ops before its first PromptRows, and each chunk's ops."""
    heads = [i for i, op in enumerate(lp.ops) if isinstance(op, PromptRows)]
    parts = [list(lp.ops[a:b]) for a, b in zip(heads, heads[1:] + [len(lp.ops)])]
    return list(lp.ops[:heads[0]]), parts


def _with_layer(plan: ChunkPlan, layer: int, ops) -> ChunkPlan:
    return ChunkPlan(plan.tokens, plan.mode, plan.ring_slots,
                     [LayerPlan(lp.layer, tuple(ops)) if lp.layer == layer else lp
                      for lp in plan.layers])


def test_broken_layer_passes_are_rejected(model) -> None:
    res = Residency.from_budget(model.moe, 20)
    ring = ring_need(res, range(SPEC.n_layers))
    plan = _pass(res, ring, windows(20, 8))
    check(plan, res)
    # layer 1 attends over the second chunk before the first: its keys are not there yet
    head, (c0, c1, c2) = _layer_chunks(plan.layers[1])
    _reject(_with_layer(plan, 1, head + c1 + c0 + c2), res,
            r"attends over rows \[8, 16\) while layer 1's keys and values reach row 0")
    # the second chunk of layer 0 without its input
    head, (c0, c1, c2) = _layer_chunks(plan.layers[0])
    _reject(_with_layer(plan, 0, head + c0 + [op for op in c1 if not isinstance(op, ChunkInput)]
                        + c2), res, r"reads the chunk's hidden states, but no ChunkInput")
    # rows switched between a layer's routing and its combine
    end = max(i for i, op in enumerate(c0) if isinstance(op, LayerEnd))
    _reject(_with_layer(plan, 0, head + c0[:end] + c1 + c0[end:] + c2), res,
            r"switches chunks while layer 0 of rows \[0, 8\) is routed and not combined")
    # the last chunk skips layer 0's attention and MoE (its input and ring ops stay), or
    # stops before layer 1: its rows would leave the pass unfinished
    compute = (Attention, LayerBegin, LayerEnd, Gather, GatherBatch, Products)
    _reject(_with_layer(plan, 0, head + c0 + c1 + [op for op in c2
                                                   if not isinstance(op, compute)]), res,
            r"opens rows \[16, 20\) at layer 1: every chunk of the pass starts at its first "
            r"layer, 0")
    head1, (d0, d1, d2) = _layer_chunks(plan.layers[1])
    _reject(_with_layer(plan, 1, head1 + d0 + d1 + [
        op for op in d2 if not isinstance(op, (*compute, PromptRows))]), res,
        r"rows \[16, 20\) end at layer 0 \(combined\), not after the LayerEnd of the plan's "
        r"last layer 1")
    # the last chunk's layer 1 without its Attention: its keys and values never written
    _reject(_with_layer(plan, 1, head1 + d0 + d1 + [op for op in d2
                                                     if not isinstance(op, Attention)]), res,
            r"layer 1's Attention reaches row 16 of the prompt's 20")
    # the same pass whose earlier chunks release their slots: the next layer's copies may
    # then overwrite experts a later chunk still gathers
    hold = ring_builder.RingBuilder._release

    def never_hold(self, gathers):
        self.hold = False
        hold(self, gathers)

    ring_builder.RingBuilder._release = never_hold  # type: ignore[method-assign]
    try:
        leaky = _pass(res, ring, windows(20, 8))
    finally:
        ring_builder.RingBuilder._release = hold  # type: ignore[method-assign]
    _reject(leaky, res, r"Consume at op #\d+ passed entry \d+ .* before")


def _engine_runs(model, ids, order: str, monkeypatch, **conf):
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    settings = {"model": model, "backend": "reference", "prefill": 16, "expert_cache": 24,
                "prefill_order": order, **conf}
    with Engine.open(settings) as eng:
        first, s1 = eng.prefill(np.asarray(ids[:37]), record_routing=True)
        again, s2 = eng.prefill(np.asarray(ids[37:61]))  # after a cached prompt
        step, _ = eng.prefill(np.asarray(ids[61:62]))  # one token: the decode step
        token, s3 = eng.prefill_argmax(np.asarray(ids[62:]))
        walk = eng.driver.walk_bytes()
    return (first, again, step, token), (s1, s2, s3), walk


@pytest.mark.parametrize("conf", [{}, {"dense": "stream", "compute_lanes": 2},
                                  {"gather_one": True, "prefill": 11}])
def test_reference_layer_pass_gives_the_chunk_orders_bytes(model, monkeypatch, rng,
                                                           conf) -> None:
    ids = rng.integers(0, SPEC.vocab, 90)
    chunked, chunk_stats, walk = _engine_runs(model, ids, "chunks", monkeypatch, **conf)
    passed, pass_stats, _ = _engine_runs(model, ids, "layers", monkeypatch, **conf)
    for a, b in zip(chunked[:3], passed[:3]):
        assert a.tobytes() == b.tobytes()
    assert chunked[3] == passed[3]
    assert [s.prefill_order for s in chunk_stats] == ["chunks"] * 3
    assert [s.prefill_order for s in pass_stats] == ["layers"] * 3
    assert pass_stats[0].chunks == chunk_stats[0].chunks == -(-37 // conf.get("prefill", 16))
    assert np.array_equal(pass_stats[0].routing_counts, chunk_stats[0].routing_counts)
    assert pass_stats[0].routing_counts.sum() == 37 * SPEC.n_layers * SPEC.top_k
    # the pass streams every non-resident expert once; the chunks, once per walking chunk
    assert pass_stats[0].bytes_streamed == walk < chunk_stats[0].bytes_streamed


def test_reference_layer_pass_dumps_the_same_residual(model, monkeypatch, rng,
                                                      tmp_path) -> None:
    ids = rng.integers(0, SPEC.vocab, 70)
    dumps = []
    for order in ("chunks", "layers"):
        path = tmp_path / f"{order}.dump"
        monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(path))
        _engine_runs(model, ids, order, monkeypatch)
        dumps.append(path.read_bytes())
    assert dumps[0] == dumps[1] and len(dumps[0]) > 0


def test_auto_takes_the_pass_where_experts_stream(model, monkeypatch, rng) -> None:
    ids = rng.integers(0, SPEC.vocab, 70)
    _, (s, _, _), _ = _engine_runs(model, ids, "auto", monkeypatch)
    assert s.prefill_order == "layers"
    every = SPEC.n_layers * SPEC.n_experts
    _, (s, _, _), _ = _engine_runs(model, ids, "auto", monkeypatch, expert_cache=every)
    assert s.prefill_order == "chunks"  # nothing streams: the order would change nothing
    _, (s, _, _), _ = _engine_runs(model, ids, "auto", monkeypatch, ring_bytes=4 * 75264)
    assert s.prefill_order == "chunks"  # the ring holds less than a layer's streamed experts


def test_logits_of_every_row_keep_the_chunk_order(model, monkeypatch, rng) -> None:
    ids = rng.integers(0, SPEC.vocab, 40)
    with Engine.open({"model": model, "backend": "reference", "prefill": 16,
                      "expert_cache": 24, "prefill_order": "layers"}) as eng:
        logits, stats = eng.prefill(np.asarray(ids), all_logits=True)
    assert logits.shape == (40, SPEC.vocab) and stats.prefill_order == "chunks"


def test_layers_says_why_it_cannot_run(model, monkeypatch, rng) -> None:
    ids = rng.integers(0, SPEC.vocab, 70)
    with pytest.raises(StrataError, match=r"prefill_order layers: the walk's ring holds \d+ "
                       r"expert slots and a layer streams \d+ experts.*ring_mib"):
        _engine_runs(model, ids, "layers", monkeypatch, ring_bytes=4 * 75264)
    monkeypatch.setenv("STRATA_PREFILL_STREAM", "routed")
    with pytest.raises(StrataError, match="prefill_order layers: prefill_stream routed streams"):
        _engine_runs(model, ids, "layers", monkeypatch)


@pytest.mark.parametrize("conf, env, words", [
    ({"prefill_stream": "routed"}, {}, r"prefill_stream routed streams each chunk's routed "
     r"experts, .*\(prefill_order: layers, prefill_stream: routed\)"),
    ({}, {"STRATA_PREFILL_STREAM": "routed_walk"}, r"\(prefill_order: layers, "
     r"STRATA_PREFILL_STREAM: routed_walk\)"),
    ({"devices": [0, 0], "repeat_devices": True}, {}, r"a layer split runs each device's "
     r"layers chunk by chunk \(prefill_order: layers, devices: 0,0\)"),
])
def test_layers_that_no_prompt_can_take_are_refused_at_open(model, monkeypatch, conf, env,
                                                            words) -> None:
    """prefill_order layers beside a setting no layer pass runs under was refused only at
    the first prompt of several chunks, after the shorter prompts before it had run."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=words + "; with it, prefill_order takes chunks or "
                       "auto"):
        Engine.open({"model": model, "backend": "reference", "prefill": 16,
                     "expert_cache": 24, "prefill_order": "layers", **conf})
    monkeypatch.setenv("STRATA_PREFILL_ORDER", "layers")
    with pytest.raises(ConfigError, match="STRATA_PREFILL_ORDER: layers"):
        Engine.open({"model": model, "backend": "reference", "prefill": 16,
                     "expert_cache": 24, **conf})
    for order in ("chunks", "auto"):  # both run the chunk order there
        Engine.open({"model": model, "backend": "reference", "prefill": 16,
                     "expert_cache": 24, "prefill_order": order, **conf}).close()


def test_prefill_order_setting(monkeypatch) -> None:
    check_engine_setting(monkeypatch, "prefill_order", "STRATA_PREFILL_ORDER", "chunks",
                         "layers", "auto", "rows", "sideways")


def test_a_budget_holds_the_pass_residual_under_layers_or_auto(monkeypatch) -> None:
    """The config's budget check plans the arena the backend will allocate: under
    prefill_order layers or auto the prompt's residual of the context's rows comes out of the
    resident experts (the 235B shape under 16 GiB; arithmetic only, nothing allocated)."""
    from pathlib import Path

    from strata_rt.config.run.run_config import load_config

    monkeypatch.setenv("STRATA_HOST_MEMORY_CHECK", "0")
    path = Path(__file__).resolve().parents[1] / "configs" / "qwen3-235b-a22b-whole-16g.yaml"
    cfg = load_config(path)
    fmt = cfg.expert_format(None)
    plain = cfg.memory_plan(fmt)
    assert plain is not None and plain.pass_tokens == 0
    for order in ("layers", "auto"):
        monkeypatch.setenv("STRATA_PREFILL_ORDER", order)
        held = cfg.memory_plan(fmt)
        assert held is not None and held.pass_tokens == 30720  # the config's context
        lost = (plain.n_resident - held.n_resident) * fmt.layout(cfg.spec.hidden,
                                                                  cfg.spec.ffn).slot_bytes
        assert 30720 * cfg.spec.hidden * 4 <= lost < 30720 * cfg.spec.hidden * 4 + 2 * (8 << 20)


def test_the_final_norms_refusal_names_the_prompts_last_position(model, monkeypatch,
                                                                  rng) -> None:
    """A last row whose mean square overflows at the output head is named by its position in
    either order (the head runs after the pass over the whole prompt's rows, so no chunk's
    first row is added to it)."""
    from strata_rt.backends.nonfinite import NonFiniteError
    from strata_rt.backends.reference.executor import ReferenceBackend

    combine, armed = ReferenceBackend._combine, [False]

    def overflowing(self, h):
        combine(self, h)
        if armed[0] and self._state.layer == SPEC.n_layers - 1:
            h[-1] = 1e30  # finite, but its square is not

    monkeypatch.setattr(ReferenceBackend, "_combine", overflowing)
    ids = rng.integers(0, SPEC.vocab, 45)
    for order in ("chunks", "layers"):
        armed[0] = False
        with Engine.open({"model": model, "backend": "reference", "prefill": 16,
                          "expert_cache": 24, "prefill_order": order}) as eng:
            eng.prefill(np.asarray(ids[:5]))
            armed[0] = True
            with pytest.raises(NonFiniteError, match="final RMSNorm") as e:
                eng.prefill(np.asarray(ids[5:]))
        assert (e.value.layer, e.value.position) == (None, 44), order


def test_a_whole_resident_layer_merges_its_products_per_chunk(model) -> None:
    """Table products in a pass: each chunk of a layer whose experts are all resident (read in
    place) gets its own LayerProducts; layers that stream keep their groups."""
    from strata_rt.schedule.plan import LayerProducts, Products
    from strata_rt.schedule.planners.layer_products import merge_layer_products

    pairs = [(0, e) for e in range(SPEC.n_experts)] + [(1, 3)]
    res = Residency(SPEC.n_layers, SPEC.n_experts, pairs, 256)
    chunks = windows(20, 8)
    plan = merge_layer_products(_pass(res, ring_need(res, range(SPEC.n_layers)), chunks,
                                      in_place=True), SPEC.n_experts, lambda layer: True)
    check(plan, res)
    first, second = plan.layers
    assert sum(isinstance(op, LayerProducts) for op in first.ops) == len(chunks)
    assert not any(isinstance(op, Products) for op in first.ops)
    assert not any(isinstance(op, LayerProducts) for op in second.ops)
