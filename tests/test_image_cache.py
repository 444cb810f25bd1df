"""The image cache (strata_rt.schedule.vram.image_cache): its sizing and choice, the walk plans
that read it, the hazard checker's rules for it, its config keys, and the promise that it changes
no byte of an output (the reference backend here, the CUDA backend on a GPU)."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from strata_rt.config.run.run_config import validate
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.formats.registry import registry
from strata_rt.schedule import hazards
from strata_rt.schedule.plan import Gather, GatherBatch, Products
from strata_rt.schedule.planners.planner import plan_walk
from strata_rt.schedule.vram.image_cache import (
    ALL,
    ImageCache,
    block_bytes,
    capacity_blocks,
    check_setting,
    parse_setting,
)
from strata_rt.schedule.vram.memory_plan import fixed_regions
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import SMALL_SPEC, Model

SPEC = SMALL_SPEC  # 4 layers x 32 experts: two groups per layer
LAYOUT = registry()[SPEC.format].for_variant(None).layout(SPEC.hidden, SPEC.ffn)
GROUPS = SPEC.n_experts // MMQ_GROUP


@pytest.fixture(scope="module")
def small() -> Model:
    return Model.synthetic(SMALL_SPEC, 4321)


def _residency(pairs) -> Residency:
    return Residency(SPEC.n_layers, SPEC.n_experts, pairs, LAYOUT.slot_bytes)


def _group(layer: int, group: int) -> list[tuple[int, int]]:
    return [(layer, e) for e in range(group * MMQ_GROUP, (group + 1) * MMQ_GROUP)]


# ---------------------------------------------------------------------------- sizing
def test_capacity_counts_whole_blocks():
    gu, dn = block_bytes(LAYOUT)
    assert (gu, dn) == (MMQ_GROUP * LAYOUT.gate_up_image_bytes,
                        MMQ_GROUP * LAYOUT.down_image_bytes)
    every = SPEC.n_layers * GROUPS
    assert capacity_blocks(None, SPEC, LAYOUT) == 0
    assert capacity_blocks(0, SPEC, LAYOUT) == 0
    assert capacity_blocks(ALL, SPEC, LAYOUT) == every
    three = 3 * (gu + dn) / (1 << 20)
    assert capacity_blocks(three, SPEC, LAYOUT) == 3
    assert capacity_blocks(three * 0.99, SPEC, LAYOUT) == 2
    assert capacity_blocks(10**9, SPEC, LAYOUT) == every  # never more than every group
    with pytest.raises(ConfigError, match="image_cache_mib: got -1"):
        capacity_blocks(-1, SPEC, LAYOUT)


@pytest.mark.parametrize("bad", [-1, "some", True, float("nan"), float("inf"), [1]])
def test_bad_settings_are_named(bad):
    assert "a number of MiB >= 0" in check_setting(bad)
    with pytest.raises(ConfigError, match="image_cache_mib"):
        EngineConfig(model={}, image_cache_mib=bad).resolve()


def test_environment_setting(monkeypatch):
    assert parse_setting(None) is None and parse_setting(" ") is None
    assert parse_setting("all") == ALL and parse_setting("512") == 512.0
    for bad in ("lots", "inf", "-1", "nan"):
        with pytest.raises(ConfigError, match=f"STRATA_IMAGE_CACHE_MIB='{bad}'"):
            parse_setting(bad)
    monkeypatch.setenv("STRATA_IMAGE_CACHE_MIB", "all")
    assert EngineConfig(model={}).resolve().image_cache_mib == ALL
    assert EngineConfig(model={}, image_cache_mib=64).resolve().image_cache_mib == 64
    from strata_rt.config.settings import env

    monkeypatch.setenv("STRATA_IMAGE_CACHE_MIB", "-3")
    with pytest.raises(ConfigError, match="STRATA_IMAGE_CACHE_MIB"):
        env.validate_all()


def test_choice_takes_fully_resident_groups_layer_by_layer():
    pairs = _group(0, 1) + _group(2, 0) + _group(2, 1) + _group(3, 0)[:-1] + [(1, 0)]
    res = _residency(pairs)
    cache = ImageCache.choose(SPEC, res, capacity=8)
    assert cache.blocks == ((0, 1), (2, 0), (2, 1))  # layer 3 group 0 misses one expert
    assert cache.index(2, 1) == 2 and cache.index(3, 0) is None and cache.index(0, 0) is None
    assert cache.experts(0, SPEC) == tuple(range(16, 32))
    assert ImageCache.choose(SPEC, res, capacity=2).blocks == ((0, 1), (2, 0))
    assert ImageCache.choose(SPEC, res, capacity=0).blocks == ()
    fills = list(cache.fills(SPEC, res))
    assert len(fills) == 3 * MMQ_GROUP
    assert fills[0] == (0, 0, res.slot(0, 16)) and fills[-1] == (2, 15, res.slot(2, 31))
    with pytest.raises(ValueError, match="room for 1"):
        ImageCache(((0, 0), (0, 1)), capacity=1)


def test_report_warns_when_room_stays_unused(caplog):
    res = _residency(_group(0, 0))
    with caplog.at_level("INFO", logger="strata_rt.schedule.vram.image_cache"):
        ImageCache.choose(SPEC, res, 1).report(SPEC, LAYOUT)
        ImageCache.choose(SPEC, res, 4).report(SPEC, LAYOUT)
        ImageCache.choose(SPEC, res, 0).report(SPEC, LAYOUT)
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[0][0] == "INFO" and "1 of 8 groups cached, room for 1" in levels[0][1]
    assert levels[1][0] == "WARNING" and "rest stays unused" in levels[1][1]
    assert levels[2][0] == "WARNING" and "smaller than one group" in levels[2][1]


def test_memory_plan_holds_the_room():
    gu, dn = block_bytes(LAYOUT)
    plain = fixed_regions(SPEC, LAYOUT, 4)
    cached = fixed_regions(SPEC, LAYOUT, 4, image_blocks=5)
    assert "image_gate_up" not in plain
    assert cached["image_gate_up"] == 5 * gu and cached["image_down"] == 5 * dn
    assert {k: v for k, v in cached.items() if not k.startswith("image_")} == plain


# ---------------------------------------------------------------------------- plans
def _walk(res: Residency, cache: ImageCache | None, gather_one: bool = False):
    return plan_walk(SPEC, res, ring_slots=6, gather_one=gather_one, tokens=512, images=cache)


@pytest.mark.parametrize("gather_one", [False, True])
def test_walk_reads_cached_groups_without_gathers(gather_one):
    res = _residency(_group(0, 0) + _group(0, 1) + _group(1, 1) + [(3, 5)])
    cache = ImageCache.choose(SPEC, res, capacity=8)
    plan = _walk(res, cache, gather_one)
    hazards.check(plan, res, images=cache)
    products = [op for _, op in plan.ops() if isinstance(op, Products)]
    assert len(products) == SPEC.n_layers * GROUPS
    cached = {(op.layer, op.group): op.cached for op in products if op.cached is not None}
    assert cached == {(0, 0): 0, (0, 1): 1, (1, 1): 2}
    gathered = set()
    for _, op in plan.ops():
        for g in (op.gathers if isinstance(op, GatherBatch) else
                  (op,) if isinstance(op, Gather) else ()):
            gathered.add((g.layer, g.expert // MMQ_GROUP))
    assert gathered.isdisjoint(cached) and len(gathered) == SPEC.n_layers * GROUPS - 3
    # the same residency without a cache gathers every group and names no block
    plain = _walk(res, None, gather_one)
    assert all(op.cached is None for _, op in plain.ops() if isinstance(op, Products))
    assert plain.count(Products) == plan.count(Products)


def test_checker_refuses_what_a_block_does_not_hold():
    res = _residency(_group(0, 0) + _group(1, 0))
    cache = ImageCache.choose(SPEC, res, capacity=2)
    plan = _walk(res, cache)
    ops = [op for _, op in plan.ops()]
    i = next(j for j, op in enumerate(ops) if isinstance(op, Products) and op.cached == 0)
    good = ops[i]

    def fails(op, match, images=cache, residency=res):
        bad = ops[:i] + [op] + ops[i + 1:]
        with pytest.raises(PlanHazardError, match=match):
            hazards.Checker(plan.ring_slots, residency, images).feed(bad)

    fails(replace(good, cached=1), "holds layer 1 group 0")
    fails(replace(good, cached=7), "has 2 blocks")
    fails(good, "has no image cache", images=None)
    fails(replace(good, expert_ids=good.expert_ids[::-1]), "a block holds experts 0")
    smaller = _residency(_group(0, 0)[1:] + _group(1, 0))
    fails(good, r"experts \[0\] are not resident", residency=smaller)


# ---------------------------------------------------------------------------- config
def _doc(**extra):
    doc = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 32,
                                   "top_k": 4}},
           "format": "iq3_xxs", "backend": "reference", "prompts": [64]}
    doc.update(extra)
    return doc


def test_config_key(tmp_path):
    cfg = validate(_doc(expert_cache="all", image_cache_mib="all"), tmp_path)
    assert cfg.image_cache_mib == ALL and cfg.engine_config().image_cache_mib == ALL
    assert validate(_doc(expert_cache=8, image_cache_mib=256), tmp_path).image_cache_mib == 256
    assert validate(_doc(expert_cache=8), tmp_path).engine_config().image_cache_mib is None
    with pytest.raises(ConfigError) as e:
        validate(_doc(expert_cache=8, image_cache_mib="half"), tmp_path)
    assert "image_cache_mib: got 'half'; allowed: a number of MiB" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(_doc(vram_budget_mib=4096, image_cache_mib=100), tmp_path)
    assert "give `expert_cache` or `vram_reserve_mib` with it" in str(e.value)


# ---------------------------------------------------------------------------- runs
def _prefill(model, h, **cfg):
    with Engine.open(EngineConfig(model=model, check_plan=True, **cfg)) as eng:
        out, stats = eng.prefill(h)
        return out, stats, eng.backend.images, eng.driver.last_plan


@pytest.mark.parametrize("resident", [SPEC.total_experts, SPEC.total_experts - 20])
def test_reference_outputs_do_not_change_a_bit(small, rng, resident):
    """A walk chunk with and without the cache (every group cached, or the groups a partial
    residency holds whole) on the reference backend, which fills its blocks through the
    format's images like a gather."""
    h = rng.standard_normal((600, SPEC.hidden), dtype=np.float32)
    plain, ps, none, pplan = _prefill(small, h, backend="reference", expert_cache=resident)
    got, cs, cache, cplan = _prefill(small, h, backend="reference", expert_cache=resident,
                                     image_cache_mib=ALL)
    assert pplan.mode == cplan.mode == "walk" and none.blocks == ()
    n = len(cache.blocks)
    assert n == (SPEC.n_layers * GROUPS if resident == SPEC.total_experts else
                 sum(all(r) for r in _whole_groups(cache, resident)))
    assert n > 0
    assert got.tobytes() == plain.tobytes()
    assert cs.gathers_launched == ps.gathers_launched - n
    assert cs.mmq_launches == ps.mmq_launches


def _whole_groups(cache, resident):
    res = Residency.from_budget(Model.synthetic(SPEC, 1), resident)
    return [[res.slot(layer, e) is not None for e in range(g * 16, g * 16 + 16)]
            for layer in range(SPEC.n_layers) for g in range(GROUPS)]


# ---------------------------------------------------------------------------- GPU
def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["iq3_xxs", "q2_blob", "fp16"])
def test_cuda_outputs_do_not_change_a_bit(rng, fmt):
    """Every loaded format, every expert resident and half of them: walk chunks of 256 and
    2,048 tokens (each run twice, so the second is a CUDA-graph replay) and a staging chunk of
    8 tokens, with the cache (room for every group) and without: the same bytes, fewer
    gathers, and the blocks the cache reports."""
    if fmt not in registry():
        pytest.skip(f"format {fmt} not loaded")
    spec = replace(SMALL_SPEC, format=fmt)
    blob = registry()[fmt].layout(spec.hidden, spec.ffn).blob_bytes
    model = Model.synthetic(spec, _seed(), pool_bytes=24 * blob)
    prompts = [rng.standard_normal((n, spec.hidden), dtype=np.float32)
               for n in (256, 2048, 8)]
    prompts = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[2]]
    for resident in (spec.total_experts, spec.total_experts // 2):
        runs = {}
        # in_place off: without the cache, short chunks would gather nothing either; the
        # third run has the cache and the groups it does not hold read in place
        for room, in_place in ((None, "off"), (ALL, "off"), (ALL, "auto")):
            conf = EngineConfig(model=model, backend="cuda", expert_cache=resident,
                                image_cache_mib=room, in_place=in_place, check_plan=True)
            with Engine.open(conf) as eng:
                runs[(room, in_place)] = ([eng.prefill(h) for h in prompts],
                                          eng.backend.images)
        (plain, none), (cached, cache) = runs[(None, "off")], runs[(ALL, "off")]
        for (a, _), (b, _) in zip(plain, runs[(ALL, "auto")][0]):
            assert a.tobytes() == b.tobytes(), "the cache beside in-place products differs"
        assert none.blocks == () and len(cache.blocks) > 0
        if resident == spec.total_experts:
            assert len(cache.blocks) == spec.n_layers * GROUPS
        for h, (a, sa), (b, sb) in zip(prompts, plain, cached):
            assert np.isfinite(b).all()
            assert a.tobytes() == b.tobytes(), (f"{fmt}, {resident} resident: {len(h)} tokens "
                                                "differ with the image cache")
            if len(h) >= 256:
                assert sb.gathers_launched < sa.gathers_launched
        assert cached[2][0].tobytes() == cached[0][0].tobytes()  # the replayed walk
