"""The reference backend and the Engine API on the CPU (small config, IQ3_XXS by default)."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.engine import DUMP_STRIDE, Engine, EngineConfig, read_dump
from strata_rt.errors import ConfigError, PlanHazardError
from strata_rt.formats.numerics import nmse
from strata_rt.schedule import driver as driver_mod
from strata_rt.schedule.plan import ChunkPlan, LayerPlan, Wait
from strata_rt.schedule.planners import planner as planner_mod
from strata_rt.schedule.planners.planner import AUTO_CHUNK_MAX
from strata_rt.schedule.vram.residency import RoutingProfile
from strata_rt.weights.model import SMALL_SPEC, Model, reference_moe_f64, rms_norm, route

NMSE_MAX = 5e-4


@pytest.fixture(scope="module")
def small() -> Model:
    return Model.synthetic(SMALL_SPEC, 1234)


def _hidden(rng: np.random.Generator, tokens: int, hidden: int = SMALL_SPEC.hidden
            ) -> np.ndarray:
    """Fresh inputs per run (the `rng` fixture seeds from os.urandom and reports the seed)."""
    return rng.standard_normal((tokens, hidden), dtype=np.float32)


def _run(model, h, **cfg):
    """-> (output, stats, what the run left to inspect: the executor's routes and the driver's
    last plan)."""
    cfg.setdefault("backend", "reference")
    with Engine.open(EngineConfig(model=model, **cfg)) as eng:
        out, stats = eng.prefill(h)
        return out, stats, SimpleNamespace(routes=eng.backend.routes,
                                           last_plan=eng.driver.last_plan,
                                           residency=eng.residency)


def test_small_config_matches_float64(small, rng, fixed_walk_rule):
    """Whole model, 200 tokens (staging ring, mixed residency): the MoE output h_out - h
    against float64 on the dequantized weights with the same expert choice, and the expert
    choice itself against float64 routing on the first layer (same input there)."""
    h = _hidden(rng, 200)
    out, stats, be = _run(small, h, expert_cache=40, check_plan=True)
    ref = reference_moe_f64(small, h, routes=be.routes)
    err = nmse(out - h, ref - h)
    print(f"delta NMSE vs float64: {err:.3g}")
    assert err <= NMSE_MAX
    xn = rms_norm(h.astype(np.float64), small.norm[0].astype(np.float64), SMALL_SPEC.rms_eps)
    ids64, _ = route(xn, small.router[0].astype(np.float64), SMALL_SPEC.top_k)
    assert (be.routes[0] != ids64).any(axis=1).mean() <= 0.01
    assert stats.tokens == 200 and stats.chunks == 1
    assert stats.host_syncs == SMALL_SPEC.n_layers + 1


def test_each_layer_matches_float64_on_its_own_input(small, rng):
    """Layer by layer (each fed the engine's previous output), float64 routes by itself."""
    h = _hidden(rng, 300)
    for layer in range(SMALL_SPEC.n_layers):
        sub = small.slice_layers(layer, layer + 1)
        out, _, _ = _run(sub, h)
        ref = reference_moe_f64(sub, h)
        assert nmse(out - h, ref - h) <= NMSE_MAX, layer
        h = out


@pytest.mark.parametrize("tokens,cache", [(200, 0), (200, 50), (1100, 0), (1100, 70)])
def test_gather_modes_are_byte_identical(small, rng, tokens, cache, fixed_walk_rule):
    """Staging ring (200) and streamed walk (1100), with and without resident experts."""
    model = small
    h = _hidden(rng, tokens)
    one, s1, b1 = _run(model, h, expert_cache=cache, gather_one=True, check_plan=True)
    bat, s2, b2 = _run(model, h, expert_cache=cache, gather_one=False, check_plan=True)
    assert one.tobytes() == bat.tobytes()
    assert b1.last_plan.mode == b2.last_plan.mode == ("walk" if tokens >= 1024 else "staging")
    assert s2.gathers_launched < s1.gathers_launched
    assert s1.experts_streamed == s2.experts_streamed
    assert s1.bytes_streamed == s1.experts_streamed * model.layout.blob_bytes
    if tokens >= 1024:  # the walk streams every non-resident expert
        assert s1.experts_streamed == model.spec.total_experts - b1.residency.n_slots
        assert s1.host_syncs == 1


def test_chunks_and_paths_agree_exactly(small, rng):
    """Tokens are independent: a 1,100-token prompt as one walk chunk, as two staging chunks,
    or as 1,024 + 76 gives the same bytes."""
    model = small
    h = _hidden(rng, 1100)
    whole, st, _ = _run(model, h, expert_cache=10)
    halves, sh, _ = _run(model, h, expert_cache=10, prefill=550)
    split, _, _ = _run(model, h, expert_cache=10, prefill=1024)
    assert (st.chunks, sh.chunks) == (1, 2)
    assert whole.tobytes() == halves.tobytes() == split.tobytes()


def test_other_formats_run(rng):
    """The engine never names a format: fp16 (native) and q2_blob (not native: one gather per
    expert even when batching is asked for) run through the same plans."""
    from strata_rt.formats.registry import registry

    for name in ("fp16", "q2_blob"):
        fmt = registry()[name]
        spec = replace(SMALL_SPEC, n_layers=1, n_experts=8, top_k=2, hidden=256, ffn=256,
                       format=name)
        m = Model.synthetic(spec, 3, fmt)
        h = _hidden(rng, 64, 256)
        out, stats, be = _run(m, h, expert_cache=3, check_plan=True, gather_one=False)
        ref = reference_moe_f64(m, h, routes=be.routes)
        assert nmse(out - h, ref - h) < 5e-3, name
        routed = set(np.unique(be.routes[0]).tolist())
        assert stats.experts_streamed == len(routed - {0, 1, 2}), name
        if not fmt.native:
            assert stats.gathers_launched == len(routed), name


def test_dump_file_format(small, rng, tmp_path):
    model = small.slice_layers(0, 1)
    h = _hidden(rng, 300)
    path = tmp_path / "sub" / "r.bin"
    out, stats, _ = _run(model, h, prefill=100, dump_r=str(path))
    assert stats.chunks == 3
    pos, vals = read_dump(path, SMALL_SPEC.hidden)
    assert pos.tolist() == list(range(0, 300, DUMP_STRIDE))
    assert np.array_equal(vals, out[::DUMP_STRIDE])
    raw = path.read_bytes()
    rec = 8 + 4 * SMALL_SPEC.hidden
    assert len(raw) == rec * len(pos)
    assert int.from_bytes(raw[rec: rec + 8], "little") == DUMP_STRIDE
    # a second engine starts the file afresh
    _run(model, h[:10], dump_r=str(path))
    assert read_dump(path, SMALL_SPEC.hidden)[0].tolist() == [0]


def test_env_switches(small, monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_PREFILL_GATHER_ONE", "1")
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(tmp_path / "d.bin"))
    cfg = EngineConfig(model=small).resolve()
    assert cfg.gather_one and cfg.check_plan and cfg.dump_r == str(tmp_path / "d.bin")
    assert EngineConfig(model=small, gather_one=False).resolve().gather_one is False
    monkeypatch.setenv("STRATA_CHECK_PLAN", "yes")
    with pytest.raises(ConfigError, match="STRATA_CHECK_PLAN='yes'"):
        EngineConfig(model=small).resolve()


def test_check_plan_catches_a_broken_planner(small, monkeypatch):
    real = planner_mod.plan_walk

    def broken(*a, **kw):
        plan = real(*a, **kw)
        ops = [op for _, op in plan.ops() if op != Wait(("used", 0), "copy")]
        return ChunkPlan(plan.tokens, plan.mode, plan.ring_slots, [LayerPlan(0, tuple(ops))])

    monkeypatch.setattr(driver_mod, "plan_walk", broken)
    model = small.slice_layers(0, 1)
    h = np.zeros((1024, SMALL_SPEC.hidden), np.float32)
    with pytest.raises(PlanHazardError, match="slot 0"):
        _run(model, h, ring_bytes=4 * model.layout.slot_bytes, check_plan=True)


def test_record_routing_and_profile(small, rng, tmp_path):
    model = small.slice_layers(0, 2)
    h = _hidden(rng, 150)
    with Engine.open(EngineConfig(model=model, backend="reference")) as eng:
        _, stats = eng.prefill(h, record_routing=True)
        _, plain = eng.prefill(h)
    assert plain.routing_counts is None
    c = stats.routing_counts
    assert c.shape == (2, 32) and (c.sum(axis=1) == 150 * SMALL_SPEC.top_k).all()
    path = tmp_path / "prof.json"
    RoutingProfile(c).save(path)
    with Engine.open(EngineConfig(model=model, backend="reference", expert_cache=5,
                                  profile=str(path))) as eng:
        top = np.argsort(-c.reshape(-1), kind="stable")[:5]
        assert eng.residency.pairs == sorted((int(i) // 32, int(i) % 32) for i in top)


def test_backend_auto_falls_back_with_a_line(small, monkeypatch, caplog):
    import strata_rt.runtime as runtime

    monkeypatch.setattr(runtime, "cuda_available", lambda: (False, "no device here"))
    with caplog.at_level("WARNING", logger="strata_rt.engine"):
        with Engine.open({"model": small.slice_layers(0, 1), "backend": "auto"}) as eng:
            assert eng.config.backend == "reference"
    assert "backend auto -> reference (no device here)" in caplog.text


def test_engine_config_errors(small):
    with pytest.raises(ConfigError) as ei:
        Engine.open(EngineConfig(model=small, backend="gpu", prefill=0, expert_cache=-1))
    msg = str(ei.value)
    assert "backend: got 'gpu'" in msg and "prefill: got 0" in msg and "expert_cache" in msg
    with pytest.raises(ConfigError, match="model: got int"):
        Engine.open(EngineConfig(model=3, backend="reference"))
    with Engine.open(EngineConfig(model=small.slice_layers(0, 1), backend="reference")) as eng:
        assert eng.chunk_tokens == AUTO_CHUNK_MAX
        with pytest.raises(ConfigError, match=r"expected \[tokens, 512\]"):
            eng.prefill(np.zeros((4, 256), np.float32))
        with pytest.raises(ConfigError, match="NaN"):
            eng.prefill(np.full((4, 512), np.nan, np.float32))


def test_model_from_spec_dict(tmp_path):
    spec = replace(SMALL_SPEC, n_layers=1, n_experts=4, top_k=1, hidden=256, ffn=256)
    with Engine.open({"model": {"spec": spec, "seed": 2}, "backend": "reference",
                      "prefill": 16}) as eng:
        out, stats = eng.prefill(_hidden(np.random.default_rng(1), 40, 256))
    assert out.shape == (40, 256) and stats.chunks == 3
    assert eng.backend is None  # closed


TINY = replace(SMALL_SPEC, n_layers=2, n_experts=20, top_k=3, hidden=256, ffn=256)


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model.synthetic(TINY, 77)


@pytest.fixture(scope="module")
def tiny_input() -> tuple[np.ndarray, dict[int, np.ndarray]]:
    h = np.random.default_rng(int.from_bytes(os.urandom(4), "little")).standard_normal(
        (1030, TINY.hidden), dtype=np.float32)
    return h, {}


@settings(max_examples=12, deadline=None)
@given(tokens=st.sampled_from([40, 1030]), cache=st.integers(0, 40),
       ring=st.integers(1, 45), gather_one=st.booleans(), prof_seed=st.integers(0, 9))
def test_output_does_not_depend_on_where_experts_come_from(tiny, tiny_input, tokens, cache,
                                                           ring, gather_one, prof_seed):
    """Residency set, ring size and gather mode only move bytes: the output is the same to
    the last bit as the all-streamed, one-gather-per-expert run."""
    h_all, want = tiny_input
    h = h_all[:tokens]
    if tokens not in want:
        want[tokens] = _run(tiny, h, expert_cache=0, gather_one=True)[0]
    counts = np.random.default_rng(prof_seed).integers(0, 100, (2, 20))
    cfg = EngineConfig(model=tiny, backend="reference", expert_cache=cache, check_plan=True,
                       gather_one=gather_one, ring_bytes=ring * tiny.layout.slot_bytes)
    cfg._profile = RoutingProfile(counts)
    with Engine.open(cfg) as eng:
        out, _ = eng.prefill(h)
        assert eng.residency.n_slots == cache
    assert out.tobytes() == want[tokens].tobytes()


def test_engine_runs_the_chosen_mmq_variant(small, rng, monkeypatch):
    """IQ3_XXS runs its default variant (f16_gemm: fp16 images and activations) unless
    STRATA_MMQ_KERNEL names another; the exact kernels' variant gives other bytes, both close
    to float64, and the model's own format object is left as it was."""
    from strata_rt.formats.activations import F16, Q8_1

    model = small.slice_layers(0, 1)
    h = _hidden(rng, 40)
    with Engine.open(EngineConfig(model=model, backend="reference", expert_cache=0)) as eng:
        assert eng.model.fmt.activation is F16 and not eng.model.fmt.exact
        assert eng.model.layout.gate_up_image_bytes == 2 * 2 * 256 * 512
        gemm, _ = eng.prefill(h)
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "f16_pipe")
    with Engine.open(EngineConfig(model=model, backend="reference", expert_cache=0)) as eng:
        assert eng.model.fmt.activation is Q8_1 and eng.model.fmt.exact
        exact, _ = eng.prefill(h)
    assert model.fmt.variant == "f16_gemm"  # the registered object is untouched
    ref = reference_moe_f64(model, h)
    assert nmse(gemm - h, ref - h) <= NMSE_MAX and nmse(exact - h, ref - h) <= NMSE_MAX
    assert gemm.tobytes() != exact.tobytes()
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "bf16x")
    with pytest.raises(ConfigError, match="bf16x"):
        Engine.open(EngineConfig(model=model, backend="reference"))


def test_timing_table_on_the_reference_backend(tiny):
    _, stats, _ = _run(tiny, np.ones((8, TINY.hidden), np.float32), timing=True)
    assert "host seconds per phase" in stats.phase_table and "products" in stats.phase_table
    _, plain, _ = _run(tiny, np.ones((8, TINY.hidden), np.float32))
    assert plain.phase_table is None


def test_walk_rule_follows_the_routed_share():
    """Top-8 of 128 routes half a layer's experts at ~11 tokens: the walk from there on; a
    fixed threshold overrides the rule."""
    spec = replace(SMALL_SPEC, n_experts=128, top_k=8)
    share = [1 - (1 - 8 / 128) ** t for t in (10, 11)]
    assert share[0] < planner_mod.WALK_ROUTED_SHARE <= share[1]
    assert not planner_mod.takes_walk(10, spec) and planner_mod.takes_walk(11, spec)
    assert planner_mod.takes_walk(254, spec)
    assert not planner_mod.takes_walk(254, spec, walk_min_tokens=1024)
    assert planner_mod.takes_walk(1024, spec, walk_min_tokens=1024)


def test_default_rule_takes_the_walk_for_a_short_prompt_with_the_same_bytes(
        small, rng, monkeypatch):
    """200 tokens route nearly every expert of the small config: by default the chunk walks
    (one host sync in all, not one per layer), and its bytes equal the staging ring's."""
    h = _hidden(rng, 200)
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", "1024")
    ring, st_ring, _ = _run(small, h, expert_cache=10)  # the fixed rule: the ring
    monkeypatch.delenv("STRATA_WALK_MIN_TOKENS")
    walk, st_walk, backend = _run(small, h, expert_cache=10)
    assert backend.last_plan.mode == "walk" and st_walk.host_syncs == 1
    assert st_ring.host_syncs == SMALL_SPEC.n_layers + 1
    assert walk.tobytes() == ring.tobytes()


@pytest.mark.parametrize("prefill", [AUTO_CHUNK_MAX, 128])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_is_refused_before_anything_is_kept(small, rng, tmp_path, monkeypatch,
                                                             prefill, bad):
    """One chunk (its executor checks it on the way in) or several (the engine checks the
    whole prompt first): ConfigError, the residual dump of earlier prompts stays whole and
    where it was, and the engine runs the next prompt as before. A float64 value beyond
    float32's range becomes infinity on the way in and is refused too."""
    dump = tmp_path / "d.bin"
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(dump))
    h = _hidden(rng, 300)
    with Engine.open(EngineConfig(model=small, backend="reference", prefill=prefill)) as eng:
        want, _ = eng.prefill(h)
        kept = dump.read_bytes()
        for broken in (h.copy(), h.astype(np.float64)):
            broken[int(rng.integers(300)), int(rng.integers(SMALL_SPEC.hidden))] = (
                bad if broken.dtype == np.float32 else 1e300)
            with pytest.raises(ConfigError, match="prefill input holds NaN or Inf"):
                eng.prefill(broken)
            assert dump.read_bytes() == kept
            assert not dump.with_name(dump.name + ".partial").exists()
        again, _ = eng.prefill(h)
    assert again.tobytes() == want.tobytes()
    pos, _ = read_dump(dump, SMALL_SPEC.hidden)  # the two prompts that ran, nothing else
    assert pos.tolist() == 2 * list(range(0, 300, DUMP_STRIDE))
    assert dump.read_bytes()[: len(kept)] == kept
