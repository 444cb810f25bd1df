"""Products that read resident experts in place (plan.Products.slots;
strata_rt.schedule.vram.in_place).

CPU: the setting and the rule; the planners (walk, staging, decode) skip exactly the gathers of
groups whose experts are all resident; the hazard checker refuses slots that do not hold the
experts; the reference backend gives the gathered path's bytes over residencies, lanes and
chunk kinds; the CUDA executor (recording fake runtime) launches the in-place kernel with each
expert's slot addresses. The kernel itself, byte for byte against f16_gemm, is in
tests/test_fused_gemm.py; the engine on a GPU in tests/test_cuda_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fake_runtime import MMQ_TABLE, table_kernels
from _settings import check_engine_setting, check_yaml_key, run_reference

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError, PlanHazardError, PluginError
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.formats.ggml_format import F16_FUSED
from strata_rt.formats.testing_abi import Recorder
from strata_rt.gemm.fused_gemm import TILES, at_name
from strata_rt.quants.fp16 import FP16
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.q2_blob import Q2Blob
from strata_rt.schedule import hazards
from strata_rt.schedule.plan import (
    ChunkPlan,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerPlan,
    LayerProducts,
    Products,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import StagingPlanner, plan_decode, plan_walk
from strata_rt.schedule.vram.in_place import (
    check_in_place,
    chunk_in_place,
    parse_in_place,
    resident_parts,
)
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import QWEN3_30B_SPEC, SMALL_SPEC, Model

IQ3_GEMM = IQ3XXS().for_variant(None)
IQ3_FUSED = IQ3XXS().for_variant(F16_FUSED)
IQ3_EXACT = IQ3XXS().for_variant("int8")


# ---------------------------------------------------------------------------- setting, rule
@pytest.mark.parametrize("value,want", [(None, "auto"), ("auto", "auto"), ("ON", "on"),
                                        (" off ", "off"), (True, "on"), (False, "off")])
def test_settings_parse(value, want):
    assert parse_in_place(value) == want


def test_bad_setting_names_the_choices():
    with pytest.raises(ConfigError, match="in_place: got 'sometimes'.*auto, on, off"):
        parse_in_place("sometimes")


def test_on_is_refused_for_a_format_that_cannot_read_in_place():
    for fmt in (IQ3_EXACT, FP16(), Q2Blob().for_variant(None)):
        assert fmt.in_place_max_rows == 0
        with pytest.raises(ConfigError, match="cannot read experts in place"):
            check_in_place("on", fmt)
        check_in_place("auto", fmt)
        check_in_place("off", fmt)
    check_in_place("on", IQ3_GEMM)


def test_auto_reads_in_place_while_experts_have_few_rows():
    spec = QWEN3_30B_SPEC  # rows hint = 2 * tokens * 8 / 128 = tokens / 8
    limit = IQ3_GEMM.in_place_max_rows
    assert limit > 0
    assert chunk_in_place("auto", IQ3_GEMM, 8 * limit, spec)
    assert not chunk_in_place("auto", IQ3_GEMM, 8 * limit + 1, spec)
    assert chunk_in_place("auto", IQ3_GEMM, 1, spec)
    assert chunk_in_place("on", IQ3_GEMM, 8192, spec)
    assert not chunk_in_place("off", IQ3_GEMM, 1, spec)
    # f16_fused multiplies the same way either way: always in place under auto
    assert chunk_in_place("auto", IQ3_FUSED, 32768, spec)
    for fmt in (IQ3_EXACT, FP16()):
        assert not chunk_in_place("auto", fmt, 1, spec)


def test_engine_config_reads_the_setting_and_the_environment(monkeypatch):
    check_engine_setting(monkeypatch, "in_place", "STRATA_IN_PLACE", "auto", "off", "on",
                         "maybe", "1")


def test_yaml_key(tmp_path):
    check_yaml_key(tmp_path, "in_place", "off", "off", "later")


def test_resident_parts_are_slot_plus_part_offset():
    lay = IQ3_GEMM.layout(2048, 768)
    gu, dn = resident_parts(1 << 30, (3, 0, 7), lay)
    assert gu == [(1 << 30) + s * lay.slot_bytes + lay.gate_up_offset for s in (3, 0, 7)]
    assert dn == [(1 << 30) + s * lay.slot_bytes + lay.down_offset for s in (3, 0, 7)]


# ---------------------------------------------------------------------------- planners
@pytest.fixture(scope="module")
def small() -> Model:
    return Model.synthetic(SMALL_SPEC, 41)


def _mixed_residency(model: Model) -> Residency:
    """Layer 0 all resident; layer 1 group 0 resident and group 1 half; layers 2.. none."""
    spec = model.spec
    pairs = [(0, e) for e in range(spec.n_experts)]
    pairs += [(1, e) for e in range(MMQ_GROUP + MMQ_GROUP // 2)]
    return Residency(spec.n_layers, spec.n_experts, pairs, 1)


def _gathered(plan) -> set[tuple[int, int]]:
    """(layer, expert) of every gather of the plan."""
    out = set()
    for _, op in plan.ops():
        members = (op.gathers if isinstance(op, GatherBatch | GatherRouted)
                   else (op,) if isinstance(op, Gather) else ())
        out |= {(g.layer, g.expert) for g in members}
    return out


def _check_in_place_products(plan, res: Residency, expect_in_place: bool) -> None:
    for _, op in plan.ops():
        if not isinstance(op, Products):
            continue
        slots = [res.slot(op.layer, e) for e in op.expert_ids]
        all_resident = all(s is not None for s in slots)
        if expect_in_place and all_resident:
            assert op.slots == tuple(slots), op
        else:
            assert op.slots is None, op


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("in_place", [False, True])
def test_walk_skips_the_gathers_of_resident_groups(small, in_place, lanes):
    spec, res = small.spec, _mixed_residency(small)
    plan = plan_walk(spec, res, 4, False, tokens=100, lanes=lanes, in_place=in_place)
    hazards.check(plan, res)
    _check_in_place_products(plan, res, in_place)
    gathered = _gathered(plan)
    for layer in range(spec.n_layers):
        for g in range(spec.n_experts // MMQ_GROUP):
            group = range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP)
            resident = all(res.slot(layer, e) is not None for e in group)
            want = not (in_place and resident)
            assert all(((layer, e) in gathered) == want for e in group), (layer, g)


def test_staging_and_decode_plans_read_resident_groups_in_place(small):
    spec, res = small.spec, _mixed_residency(small)
    planner = StagingPlanner(spec, res, False, tokens=3, in_place=True)
    for layer in range(spec.n_layers):
        planner.plan_layer(layer, [0, 5, 17, 30])  # layer 1: expert 30 streams
    staging = planner.chunk_plan()
    hazards.check(staging, res)
    _check_in_place_products(staging, res, True)
    assert (0, 17) not in _gathered(staging) and (1, 17) in _gathered(staging)

    decode = plan_decode(spec, res, DenseSchedule(spec.n_layers, None, None), in_place=True)
    hazards.check(decode, res)
    _check_in_place_products(decode, res, True)
    routed = [op for _, op in decode.ops() if isinstance(op, GatherRouted)]
    # layer 0: both groups resident; layer 1: group 0; the other layers gather everything
    assert len(routed) == 2 * spec.n_layers - 3


# ---------------------------------------------------------------------------- checker
def _all_resident(spec) -> Residency:
    return Residency(spec.n_layers, spec.n_experts,
                     [(layer, e) for layer in range(spec.n_layers)
                      for e in range(spec.n_experts)], 1)


def _with_group0(res: Residency, bad: Products) -> ChunkPlan:
    """An in-place walk whose first layer's group-0 products are replaced by `bad`."""
    plan = plan_walk(SMALL_SPEC, res, 4, False, tokens=10, in_place=True)
    layers = list(plan.layers)
    layers[0] = LayerPlan(0, tuple(bad if isinstance(op, Products) and op.group == 0 else op
                                   for op in layers[0].ops))
    return ChunkPlan(10, "walk", 4, layers)


def test_checker_accepts_the_planned_slots_and_refuses_others():
    res = _all_resident(SMALL_SPEC)
    ids = tuple(range(MMQ_GROUP))
    slots = tuple(int(res.slot(0, e)) for e in ids)  # type: ignore[arg-type]
    hazards.check(_with_group0(res, Products(0, 0, ids, slots=slots)), res)
    bad = {
        "lies in resident slot": Products(0, 0, ids, slots=slots[::-1]),
        "one slot per expert": Products(0, 0, ids, slots=slots[:-1]),
        "products read one source": Products(0, 0, ids, cached=0, slots=slots),
        # layer 1's slots named for layer 0's experts
        "expert 0 of layer 0 lies in resident slot 0, not in slot": Products(
            0, 0, ids, slots=tuple(int(res.slot(1, e)) for e in ids)),  # type: ignore[arg-type]
    }
    for match, op in bad.items():
        with pytest.raises(PlanHazardError, match=match):
            hazards.check(_with_group0(res, op), res)


def test_checker_refuses_a_streamed_expert_read_in_place():
    spec = SMALL_SPEC
    pairs = [(layer, e) for layer in range(spec.n_layers) for e in range(spec.n_experts)
             if (layer, e) != (0, 3)]
    res = Residency(spec.n_layers, spec.n_experts, pairs, 1)
    ids = tuple(range(MMQ_GROUP))
    slots = tuple(0 if e == 3 else int(res.slot(0, e)) for e in ids)  # type: ignore[arg-type]
    plan = plan_walk(spec, res, 4, False, tokens=10, in_place=True)
    hazards.check(plan, res)  # the planner gathers group 0 of layer 0 (expert 3 streams)
    assert any(isinstance(op, Products) and op.layer == 0 and op.group == 0
               and op.slots is None for _, op in plan.ops())
    with pytest.raises(PlanHazardError, match="expert 3 of layer 0 is not resident"):
        hazards.check(_with_group0(_all_resident(spec), Products(0, 0, ids, slots=slots)), res)


# ---------------------------------------------------------------------------- reference bytes
def _in_place_count(plan) -> int:
    """Products reading slots in place, a whole layer's (LayerProducts) counted by its parts."""
    return sum(isinstance(part, Products) and part.slots is not None for _, op in plan.ops()
               for part in (op.stands_for() if isinstance(op, LayerProducts) else (op,)))


@pytest.mark.parametrize("cache,lanes", [(SMALL_SPEC.total_experts, "2"),
                                         (SMALL_SPEC.total_experts // 2, "1"), (0, "1")])
def test_reference_bytes_do_not_depend_on_reading_in_place(small, rng, cache, lanes,
                                                           fixed_walk_rule):
    """A staging prompt and a walk prompt: reading resident groups in place gives the bytes
    of gathering them (the reference reads the slots' images; the group buffers stay
    poisoned), whether every expert, half of them or none is resident."""
    prompts = [rng.standard_normal((n, SMALL_SPEC.hidden), dtype=np.float32)
               for n in (200, 1100)]
    off, plans_off = run_reference(small, prompts, expert_cache=cache, compute_lanes=lanes,
                          in_place="off")
    on, plans_on = run_reference(small, prompts, expert_cache=cache, compute_lanes=lanes,
                        in_place="on")
    for a, b in zip(off, on):
        assert a.tobytes() == b.tobytes()
    assert all(_in_place_count(p) == 0 for p in plans_off)
    assert all((_in_place_count(p) > 0) == (cache > 0) for p in plans_on)


def test_auto_reads_in_place_on_short_chunks_only(small, rng, fixed_walk_rule):
    spec = SMALL_SPEC  # rows hint = tokens / 4; IQ3_XXS f16_gemm reads in place up to 64
    short, long = (rng.standard_normal((n, spec.hidden), dtype=np.float32) for n in (200, 1100))
    _, (p_short, p_long) = run_reference(small, [short, long], expert_cache=spec.total_experts)
    assert _in_place_count(p_short) == spec.n_layers * spec.n_experts // MMQ_GROUP
    assert _in_place_count(p_long) == 0


def test_on_is_refused_at_open_for_an_exact_variant(small, monkeypatch):
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "int8")
    with pytest.raises(ConfigError, match="cannot read experts in place"):
        Engine.open(EngineConfig(model=Model.synthetic(SMALL_SPEC, 3), backend="reference",
                                 in_place="on"))


# ---------------------------------------------------------------------------- CUDA backend
def test_cuda_backend_launches_the_in_place_kernel_on_the_slots(fake, fixed_walk_rule):
    """A short walk with every expert resident and table products off: no gather launch, and
    each group's two products run the in-place kernel with the addresses of its experts' slot
    parts."""
    model = Model.synthetic(SMALL_SPEC, 5)
    spec = model.spec
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=spec.total_experts,
                       check_plan=True, timing=False, table_products="off")
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        rt.launched_on.clear()
        rt.tokens = 200
        eng.prefill(np.ones((200, spec.hidden), np.float32))
        names = [name for name, _, _ in rt.launched_on]
        assert not [n for n in names if "gather" in n]
        at = {at_name(t) for t in TILES}
        launches = [args for name, _, args in rt.launched_on if name in at]
        groups = spec.n_experts // MMQ_GROUP
        assert len(launches) == 2 * groups * spec.n_layers
        lay, res = eng.backend.lay, eng.backend.residency
        base = rt.arena.ptr("resident")
        for i, args in enumerate(launches):
            layer, rest = divmod(i, 2 * groups)
            group, part = divmod(rest, 2)
            ids = tuple(range(group * MMQ_GROUP, (group + 1) * MMQ_GROUP))
            gu, dn = resident_parts(base, tuple(res.slot(layer, e) for e in ids), lay)
            assert list(args[:MMQ_GROUP]) == (gu if part == 0 else dn)
            assert args[MMQ_GROUP: 2 * MMQ_GROUP] == ids


@pytest.mark.parametrize("fmt", [IQ3_GEMM, IQ3_FUSED], ids=["f16_gemm", "f16_fused"])
def test_format_kernels_read_in_place_with_the_fused_twin(fmt):
    """Both IQ3_XXS fp16 variants' mmq_in_place launch the in-place fused kernel with the
    given addresses, nothing else; a format without it refuses by name."""
    rec = Recorder()
    kern = fmt.kernels(rec, fmt.layout(2048, 768))  # type: ignore[arg-type]
    kern.mmq_in_place(None, [1 << 30, 5 << 30], (7, 8), 3 << 30, 4 << 30, 6 << 30, 1536,
                      2048, 20)
    (launch,) = rec.launches
    assert launch.name == "iq3_fused_at_m32"
    assert launch.args[:3] == (1 << 30, 5 << 30, 0)
    exact = IQ3_EXACT.kernels(Recorder(), IQ3_EXACT.layout(2048, 768))  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="cannot read experts in place"):
        exact.mmq_in_place(None, [1 << 30], (7,), 0, 0, 0, 1536, 2048, 20)


def test_cuda_backend_runs_a_whole_resident_layer_as_two_table_launches(fake, monkeypatch,
                                                                         fixed_walk_rule):
    """Every expert resident, read in place, and a format offering table products (a
    recording mmq_table): each layer's products are two table launches over the layer's row
    of the products table (the gate/up and the down parts' offsets, every expert), around one
    SwiGLU over the whole layer, on staging and walk chunks alike; each row (every expert's
    slot address) is written once, by the first chunk, and never again."""
    model = Model.synthetic(SMALL_SPEC, 5)
    spec = model.spec
    E, H, F = spec.n_experts, spec.hidden, spec.ffn
    table_kernels(monkeypatch, model.formats.format(0))
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=spec.total_experts,
                       check_plan=True, timing=False, cuda_graph=False, in_place="on")
    with Engine.open(cfg) as eng:
        rt, backend = fake["rt"], eng.backend
        base = rt.arena.ptr("products_table")
        swiglu = backend.kernels._swiglu.name
        per_group = {at_name(t) for t in TILES}
        for tokens in (200, 200, 1100, 1100):
            rt.launched_on.clear()
            rt.tokens = tokens
            eng.prefill(np.ones((tokens, H), np.float32))
            plan = eng.driver.last_plan
            assert plan.count(LayerProducts) == spec.n_layers and plan.count(Products) == 0
            # no expert gather (the routing's fp16 row gather encodes activations) and no
            # per-group in-place launch
            names = {name for name, _, _ in rt.launched_on} - {"gather_f16_rows"}
            assert not [n for n in names if "gather" in n or n in per_group]
            table = [(stream, args) for name, stream, args in rt.launched_on
                     if name == MMQ_TABLE]
            assert len(table) == 2 * spec.n_layers
            for i, (stream, args) in enumerate(table):
                layer, part = divmod(i, 2)
                row, offset, _, _, _, m, k, _, n = args
                assert stream == "compute" and row == base + layer * E * 8 and n == E
                lay = model.formats.layout(layer)
                assert (offset, m, k) == ((lay.gate_up_offset, 2 * F, H) if part == 0 else
                                          (lay.down_offset, H, F))
            swiglus = [args for name, _, args in rt.launched_on if name == swiglu]
            assert [args[2:4] for args in swiglus] == [(0, E)] * spec.n_layers
        rows = [(dst, host) for dst, host, _ in rt.htod if base <= dst < base + rt.arena.regions[
            "products_table"][1]]
        assert [dst for dst, _ in rows] == [base + layer * E * 8 for layer in range(spec.n_layers)]
        res, resident = backend.residency, rt.arena.ptr("resident")
        for layer, (_, host) in enumerate(rows):
            assert host.dtype == np.uint64
            assert host.tolist() == [resident + res.slot(layer, e) * backend.lay.slot_bytes
                                     for e in range(E)]
