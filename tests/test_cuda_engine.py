"""The CUDA backend on a GPU: its kernels against numpy, and whole prompts against the
reference backend and against itself (gather modes, repeats, residency, CUDA-graph replay).
Its memory plan and control flow without a GPU: tests/test_cuda_engine_cpu.py."""


import os
from dataclasses import replace

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.executor import ENGINE_SOURCE
from strata_rt.backends.nonfinite import NonFiniteError
from strata_rt.engine import Engine, EngineConfig, read_dump
from strata_rt.errors import BudgetError, ConfigError
from strata_rt.formats.activations import quantize_q8_1
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.formats.numerics import nmse
from strata_rt.report.timing import NOTE
from strata_rt.schedule.plan import LayerProducts, Products
from strata_rt.weights.model import QWEN3_30B_SPEC, SMALL_SPEC, Model

MIB = 1 << 20
GIB = 1 << 30


# ============================================================================ GPU
gpu = pytest.mark.gpu


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def small_model():
    seed = _seed()
    print(f"small model seed {seed}")
    return Model.synthetic(SMALL_SPEC, seed)


def _prompt(rng, tokens: int, hidden: int) -> np.ndarray:
    return rng.standard_normal((tokens, hidden), dtype=np.float32)


def _run(model, prompts, **cfg):
    """Runs prompts through one CUDA engine; -> (outputs, stats, backend facts)."""
    conf = EngineConfig(model=model, backend="cuda", **cfg)
    outs, stats = [], []
    with Engine.open(conf) as eng:
        for h in prompts:
            o, st = eng.prefill(h)
            assert np.isfinite(o).all()
            outs.append(o)
            stats.append(st)
        facts = {"chunk": eng.chunk_tokens, "graph_trials": dict(eng.driver.graph_trials),
                 "n_resident": eng.residency.n_slots}
    return outs, stats, facts


def _reference_rows(model, h, rows):
    """The reference backend on some rows of a prompt (tokens are independent)."""
    conf = EngineConfig(model=model, backend="reference", expert_cache=0)
    with Engine.open(conf) as eng:
        out, _ = eng.prefill(h[rows])
    return out


# ---------------------------------------------------------------------------- kernels
def _launch_setup(rt):
    return rt.module(ENGINE_SOURCE), rt.stream("test")


def _down(rt, s, buf, dtype, shape):
    """Reads an output back without the shared helper's tail check: these tests compare the
    output's own bytes, as they always have."""
    return download(rt, s, buf, dtype, shape, check_tail=False)


@gpu
def test_rmsnorm_flags_the_first_row_whose_squares_overflow(rt, rng):
    """Rows of 3e38 (finite, but their squares are not) and NaN lower the flag word to
    (layer << 32 | the lowest such row); the other rows are normalised as ever."""
    mod, s = _launch_setup(rt)
    T, H = 300, 512
    x = rng.standard_normal((T, H), dtype=np.float32)
    x[217, 9] = 3e38
    x[250, 0] = np.nan
    w = np.ones(H, np.float32)
    dx, dw, xn, flag = upload(rt, s, x), upload(rt, s, w), poisoned(rt, s, x.nbytes), \
        poisoned(rt, s, 8)
    mod.kernel("rmsnorm_rows", "PPPifPi").launch((T, 1, 1), (256, 1, 1), s,
                                                 (dx.ptr, dw.ptr, xn.ptr, H, 1e-6, flag.ptr, 7))
    assert int(_down(rt, s, flag, np.uint64, (1,))[0]) == (7 << 32) | 217
    g = _down(rt, s, xn, np.float32, (T, H))
    x64 = x[:200].astype(np.float64)
    np.testing.assert_allclose(g[:200], x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True)
                                                      + 1e-6), rtol=1e-5, atol=1e-6)


@gpu
def test_cuda_engine_refuses_an_rmsnorm_overflow_by_layer_and_position(small_model, rng):
    """The device check end to end: a 3e38 row in the third 64-token chunk is an error naming
    layer 0 and its position in the prompt, not the prompt handed back."""
    h = _prompt(rng, 200, SMALL_SPEC.hidden)
    h[150, 3] = 3e38
    with Engine.open(EngineConfig(model=small_model, backend="cuda", expert_cache=32,
                                  prefill=64)) as eng:
        with pytest.raises(NonFiniteError) as info:
            eng.prefill(h)
        assert (info.value.layer, info.value.position) == (0, 150)
        assert "checked on the device" in str(info.value)
        h[150, 3] = 1.0
        out, _ = eng.prefill(h)  # the flag is reset for the next prompt
        assert np.isfinite(out).all()


@gpu
@pytest.mark.parametrize("T,H,E,K", [(200, 512, 32, 4), (1500, 2048, 128, 8)])
def test_routing_kernels_match_numpy(rt, rng, T, H, E, K):
    mod, s = _launch_setup(rt)
    x = rng.standard_normal((T, H), dtype=np.float32)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    router = (rng.standard_normal((E, H)) * 2 / np.sqrt(H)).astype(np.float32)
    x[3] = 0.0  # an all-zero row must not divide by zero
    dx, dw, dr = upload(rt, s, x), upload(rt, s, w), upload(rt, s, router)
    xn, logits = poisoned(rt, s, x.nbytes), poisoned(rt, s, T * E * 4)
    ids, wts = poisoned(rt, s, T * K * 4), poisoned(rt, s, T * K * 4)
    bounds, st, ro = (poisoned(rt, s, (E + 1) * 4), poisoned(rt, s, T * K * 4),
                      poisoned(rt, s, T * K * 4))
    flag = poisoned(rt, s, 8)
    mod.kernel("rmsnorm_rows", "PPPifPi").launch((T, 1, 1), (256, 1, 1), s,
                                                 (dx.ptr, dw.ptr, xn.ptr, H, 1e-6, flag.ptr, 5))
    assert int(_down(rt, s, flag, np.uint64, (1,))[0]) == (1 << 64) - 1, "finite rows flagged"
    mod.kernel("router_logits", "PPPiii").launch((-(-T // 64), -(-E // 64), 1), (256, 1, 1), s,
                                                 (xn.ptr, dr.ptr, logits.ptr, T, H, E))
    mod.kernel("topk_softmax", "PiiiPP").launch((-(-T // 128), 1, 1), (128, 1, 1), s,
                                                (logits.ptr, T, E, K, ids.ptr, wts.ptr))
    mod.kernel("expert_bounds", "PiiP").launch((1, 1, 1), (1024, 1, 1), s,
                                               (ids.ptr, T * K, E, bounds.ptr), shared=E * 4)
    mod.kernel("expert_scatter", "PiiPPP").launch((E, 1, 1), (1024, 1, 1), s,
                                                  (ids.ptr, T * K, K, bounds.ptr, st.ptr, ro.ptr))
    g_xn = _down(rt, s, xn, np.float32, (T, H))
    x64 = x.astype(np.float64)
    want_xn = x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(g_xn, want_xn, rtol=1e-5, atol=1e-6)
    g_logits = _down(rt, s, logits, np.float32, (T, E))
    np.testing.assert_allclose(g_logits, g_xn.astype(np.float64) @ router.T.astype(np.float64),
                               rtol=1e-4, atol=1e-4)
    # top-k from the GPU's own logits, in float64: the same ids (ties to the lower id) except
    # where two probabilities lie within float32 rounding of each other
    l64 = g_logits.astype(np.float64)
    p = np.exp(l64 - l64.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want_ids = np.argsort(-p, axis=1, kind="stable")[:, :K]
    g_ids = _down(rt, s, ids, np.int32, (T, K))
    pk = np.take_along_axis(p, g_ids, axis=1)
    np.testing.assert_allclose(pk, np.take_along_axis(p, want_ids, axis=1), rtol=1e-6)
    assert (g_ids != want_ids).any(axis=1).mean() <= 0.005
    np.testing.assert_allclose(_down(rt, s, wts, np.float32, (T, K)),
                               pk / pk.sum(axis=1, keepdims=True), rtol=1e-5)
    # counting sort: exact
    flat = g_ids.reshape(-1)
    want_bounds = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))])
    np.testing.assert_array_equal(_down(rt, s, bounds, np.int32, (E + 1,)), want_bounds)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(_down(rt, s, st, np.int32, (T * K,)), order // K)
    want_ro = np.empty(T * K, np.int64)
    want_ro[order] = np.arange(T * K)
    np.testing.assert_array_equal(_down(rt, s, ro, np.int32, (T * K,)), want_ro)


@gpu
def test_topk_ties_go_to_the_lower_id(rt):
    mod, s = _launch_setup(rt)
    T, E, K = 3, 32, 4
    logits = np.zeros((T, E), np.float32)  # row 0: all equal
    logits[1, [5, 9, 20, 30]] = 1.0        # row 1: four equal winners
    logits[2, [7, 3]] = 2.0
    logits[2, [31, 1, 12]] = 1.0           # row 2: 3, 7 then 1, 12 (31 loses the tie)
    dl = upload(rt, s, logits)
    ids, wts = poisoned(rt, s, T * K * 4), poisoned(rt, s, T * K * 4)
    mod.kernel("topk_softmax", "PiiiPP").launch((1, 1, 1), (128, 1, 1), s,
                                                (dl.ptr, T, E, K, ids.ptr, wts.ptr))
    got = _down(rt, s, ids, np.int32, (T, K))
    np.testing.assert_array_equal(got, [[0, 1, 2, 3], [5, 9, 20, 30], [3, 7, 1, 12]])
    np.testing.assert_allclose(_down(rt, s, wts, np.float32, (T, K))[0], 0.25, rtol=1e-6)


@gpu
@pytest.mark.parametrize("kind", ["q8_1", "f16"])
def test_swiglu_kernels_cover_exactly_the_group_rows(rt, rng, kind):
    mod, s = _launch_setup(rt)
    F, E, rows = 768, 16, 700
    cuts = np.sort(rng.integers(0, rows, E - 1))
    bounds = np.concatenate([[0], cuts, [rows]]).astype(np.int32)
    lo, hi = 3, 11
    gu = rng.standard_normal((rows, 2 * F), dtype=np.float32) * 2
    gu[int(bounds[lo]), :32] = 0.0  # an all-zero 32-group gives d = 0, q = 0
    dgu, db = upload(rt, s, gu), upload(rt, s, bounds)
    per_row = F // 128 * 144 if kind == "q8_1" else F * 2
    out = poisoned(rt, s, rows * per_row)
    name = "swiglu_q8_1" if kind == "q8_1" else "swiglu_f16"
    mod.kernel(name, "PPiiiP").launch((37, 1, 1), (128, 1, 1), s,
                                      (dgu.ptr, db.ptr, lo, hi, F, out.ptr))
    got = _down(rt, s, out, np.uint8, (rows, per_row))
    r0, r1 = int(bounds[lo]), int(bounds[hi])
    assert (got[:r0] == 0xFF).all() and (got[r1:] == 0xFF).all(), "wrote outside the group"
    g, u = gu[r0:r1, :F], gu[r0:r1, F:]
    v = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    if kind == "f16":
        gv = got[r0:r1].view(np.float16).astype(np.float32)
        np.testing.assert_allclose(gv, v.astype(np.float16).astype(np.float32), rtol=1e-3,
                                   atol=1e-6)
        return
    from strata_rt.formats.activations import Q8_1Acts

    acts = Q8_1Acts.from_device_bytes(got[r0:r1].reshape(-1), r1 - r0, F)
    want = quantize_q8_1(v)
    np.testing.assert_allclose(acts.d, want.d, rtol=1e-6)
    diff = np.abs(acts.q.astype(np.int32) - want.q)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3  # expf vs np.exp: 1 ulp apart
    assert (acts.q[0, :32] == 0).all() and acts.d[0, 0] == 0


@gpu
@pytest.mark.parametrize("T,splits", [(300, 1), (300, 2), (1, 2), (1, 3), (5, 3)])
def test_combine_is_bit_exact(rt, rng, T, splits):
    """Whatever the column split of the grid (a decode step's row over several blocks)."""
    mod, s = _launch_setup(rt)
    H, K = 512, 4
    y = rng.standard_normal((T * K, H), dtype=np.float32)
    row_of = rng.permutation(T * K).astype(np.int32)
    w = rng.random((T, K), dtype=np.float32)
    x = rng.standard_normal((T, H), dtype=np.float32)
    dy, dro, dw, dx = upload(rt, s, y), upload(rt, s, row_of), upload(rt, s, w), upload(rt, s, x)
    mod.kernel("combine_residual", "PPPiiP").launch((T, splits, 1), (256, 1, 1), s,
                                                    (dy.ptr, dro.ptr, dw.ptr, K, H, dx.ptr))
    acc = np.zeros((T, H), np.float32)
    rows = row_of.reshape(T, K)
    for k in range(K):
        acc = acc + w[:, k, None] * y[rows[:, k]]  # float32 product, then float32 sum
    want = x + acc
    got = _down(rt, s, dx, np.float32, (T, H))
    assert got.tobytes() == want.tobytes()


# ---------------------------------------------------------------------------- engine
@gpu
@pytest.mark.parametrize("fmt", ["iq3_xxs", "q2_blob", "fp16"])
def test_gpu_matches_reference_backend(rng, fmt, fixed_walk_rule, monkeypatch):
    """Small config, every loaded format: a staging prompt and a walk prompt; the reference
    runs on a slice of rows (tokens are independent, so rows compare one to one). The routing
    is the float32 kernel set, so both backends pick the same experts (the tensor-core routing
    can flip a near-tie: tests/test_routing_kernels.py bounds how often)."""
    monkeypatch.setenv("STRATA_ROUTING", "fp32")
    from strata_rt.formats.registry import registry

    if fmt not in registry():
        pytest.skip(f"format {fmt} not loaded")
    spec = replace(SMALL_SPEC, format=fmt)
    blob = registry()[fmt].layout(spec.hidden, spec.ffn).blob_bytes
    # 24 distinct experts tiled over the layers: the q2 quantizer is slow in numpy
    model = Model.synthetic(spec, _seed(), pool_bytes=24 * blob)
    prompts = [_prompt(rng, 96, SMALL_SPEC.hidden), _prompt(rng, 1024, SMALL_SPEC.hidden)]
    outs, stats, _ = _run(model, prompts, expert_cache=SMALL_SPEC.total_experts // 3)
    for h, out, rows in zip(prompts, outs, (slice(0, 96), slice(900, 1024))):
        ref = _reference_rows(model, h, rows)
        err = nmse(out[rows], ref)
        print(f"{fmt} {h.shape[0]} tokens: NMSE vs reference {err:.3e}")
        assert err <= 5e-4
    # the walk waits once, at its end, which brings its routing back with its output (the
    # record schedule/prefill_stream.py reads where the format gathers routed experts)
    assert stats[0].host_syncs == SMALL_SPEC.n_layers + 1 and stats[1].host_syncs == 1


PROMPTS = (128, 256, 512, 1024, 2048, 4096, 8192, 9200)


@gpu
def test_gather_modes_byte_identical_small(small_model, rng, tmp_path, fixed_walk_rule):
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in PROMPTS]
    cache = SMALL_SPEC.total_experts // 2
    res = {}
    for one in (True, False):
        dump = tmp_path / f"dump_{int(one)}.bin"
        outs, stats, facts = _run(small_model, prompts, expert_cache=cache, gather_one=one,
                                  dump_r=str(dump), prefill=8192)
        res[one] = (outs, stats, facts, dump)
    (o1, s1, f1, d1), (ob, sb, fb, db) = res[True], res[False]
    assert f1["chunk"] == fb["chunk"] == 8192  # 9,200 tokens run as two chunks
    for n, a, b, sa, sbb in zip(PROMPTS, o1, ob, s1, sb):
        assert a.tobytes() == b.tobytes(), f"{n} tokens differ between gather modes"
        assert sa.experts_streamed == sbb.experts_streamed
        if 1024 <= n <= 8192:  # one walk chunk: one launch per group of 16
            assert sbb.gathers_launched * MMQ_GROUP == sa.gathers_launched
        else:  # staging batches are cut short when the 8-slot ring fills
            assert sbb.gathers_launched < sa.gathers_launched
    assert sb[-1].chunks == 2
    assert d1.read_bytes() == db.read_bytes()  # every prompt's dump, appended in order
    pos, vals = read_dump(db, SMALL_SPEC.hidden)
    last = len(range(0, 9200, 64))
    np.testing.assert_array_equal(pos[-last:], np.arange(0, 9200, 64))
    assert vals[-last:].tobytes() == ob[-1][::64].tobytes()


@gpu
def test_repeats_byte_identical_and_graph_replay(small_model, rng, monkeypatch):
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in (2048, 512)]
    runs = [prompts[0]] * 3 + [prompts[1]] * 2
    outs, _, facts = _run(small_model, runs, expert_cache=40)
    for i in (1, 2):
        assert outs[i].tobytes() == outs[0].tobytes(), f"run {i} of 2048 tokens differs"
    assert outs[4].tobytes() == outs[3].tobytes()
    trial = facts["graph_trials"][(2048, False, None)]
    print(f"2048-token walk: plain {trial['plain'] * 1e3:.2f} ms, graph "
          f"{trial['graph'] * 1e3:.2f} ms -> {trial['choice']}")
    monkeypatch.setenv("STRATA_CUDA_GRAPH", "0")
    plain, _, facts0 = _run(small_model, runs[:2], expert_cache=40)
    assert plain[1].tobytes() == outs[0].tobytes()
    assert facts0["graph_trials"] == {(2048, False, None): {}}


@gpu
def test_residency_does_not_change_a_bit(small_model, rng):
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in (256, 2048)]
    total = SMALL_SPEC.total_experts
    got = {}
    for cache in (0, total // 2, total):
        outs, stats, facts = _run(small_model, prompts, expert_cache=cache)
        assert facts["n_resident"] == cache
        got[cache] = outs
        if cache == total:
            assert all(st.experts_streamed == 0 for st in stats)
        if cache == 0:
            assert stats[1].experts_streamed == total
    for cache in (total // 2, total):
        for a, b in zip(got[0], got[cache]):
            assert a.tobytes() == b.tobytes(), f"residency {cache} changed the output"


@gpu
def test_timing_table_and_untimed_output(small_model, rng):
    h = _prompt(rng, 1100, SMALL_SPEC.hidden)
    plain, _, _ = _run(small_model, [h], expert_cache=20)
    timed, stats, _ = _run(small_model, [h], expert_cache=20, timing=True)
    assert timed[0].tobytes() == plain[0].tobytes()
    table = stats[0].phase_table
    assert NOTE in table and "gemm gate/up" in table
    assert {"router gemm", "softmax top-k", "sort", "gather", "gemm gate/up", "gemm down",
            "combine"} <= set(stats[0].phase_s)


@gpu
def test_budget_error_on_the_device(small_model):
    with pytest.raises(BudgetError, match="MiB"):
        _run(small_model, [], vram_reserve_mib=1 << 30, prefill=8192)


@gpu
def test_qwen3_30b_shape_gather_modes_and_check_plan(rng, tmp_path, fixed_walk_rule):
    """The Qwen3-30B-A3B shape, a quarter resident, STRATA_CHECK_PLAN on: staging (512), the
    walk (2048) and two chunks (9200) byte-identical between gather modes."""
    spec = QWEN3_30B_SPEC
    model = Model.synthetic(spec, _seed())
    prompts = [_prompt(rng, n, spec.hidden) for n in (512, 2048, 9200)]
    results = {}
    for one in (False, True):
        outs, stats, facts = _run(model, prompts, expert_cache=spec.total_experts // 4,
                                  gather_one=one, check_plan=True)
        results[one] = outs
        for n, st in zip((512, 2048, 9200), stats):
            print(f"qwen3-30b gather_one={int(one)} {n} tokens: {st.wall_s * 1e3:.1f} ms, "
                  f"{st.bytes_streamed / st.wall_s / 1e9:.1f} GB/s streamed, host "
                  f"{st.host_s * 1e3:.1f} ms, gathers {st.gathers_launched}")
    for a, b in zip(results[False], results[True]):
        assert a.tobytes() == b.tobytes()



@gpu
def test_default_walk_rule_gives_the_staging_bytes(small_model, rng, monkeypatch):
    """256 tokens route nearly every expert: by default the chunk walks (no host sync per
    layer) and its bytes equal those of the staging ring the tests pin elsewhere."""
    h = _prompt(rng, 256, SMALL_SPEC.hidden)
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", "1024")
    ring, ring_stats, _ = _run(small_model, [h], expert_cache=40)
    monkeypatch.delenv("STRATA_WALK_MIN_TOKENS")
    walk, walk_stats, _ = _run(small_model, [h], expert_cache=40)
    assert ring_stats[0].host_syncs == SMALL_SPEC.n_layers + 1
    assert walk_stats[0].host_syncs == 1  # its end, which brings its routing back too
    assert walk[0].tobytes() == ring[0].tobytes()


@gpu
def test_non_finite_input_is_refused_and_the_engine_goes_on(small_model, rng, fixed_walk_rule):
    """The input's finite check runs in the host pass the device's upload waits for: a walk
    chunk (threaded pass, its walk already streaming) and a staging chunk holding NaN or
    infinity raise ConfigError, and the engine then gives the same bytes as before (the
    gate was left closed, the graph trials and replays unharmed)."""
    H = SMALL_SPEC.hidden
    walk, staging = _prompt(rng, 4096, H), _prompt(rng, 300, H)
    conf = EngineConfig(model=small_model, backend="cuda",
                        expert_cache=SMALL_SPEC.total_experts // 2)
    with Engine.open(conf) as eng:
        want = [eng.prefill(h)[0] for h in (walk, staging, walk)]  # plain, then the graph
        assert np.array_equal(want[0], want[2])
        for h, bad in ((walk, np.nan), (staging, np.inf), (walk, -np.inf)):
            broken = h.copy()
            broken[int(rng.integers(h.shape[0])), int(rng.integers(H))] = bad
            with pytest.raises(ConfigError, match="NaN or Inf"):
                eng.prefill(broken)
        for h, out in zip((walk, staging, walk), want):
            assert np.array_equal(eng.prefill(h)[0], out)


@gpu
@pytest.mark.parametrize("cache,images", [("all", None), ("all", "all"), ("half", None)])
def test_two_lanes_give_the_same_bytes(small_model, rng, cache, images, fixed_walk_rule):
    """Staging and walk chunks (each walk run three times: plain launches, the graph trial,
    then the faster) on two compute lanes against one: the same bytes, and the plans really
    used the second lane."""
    total = SMALL_SPEC.total_experts
    experts = total if cache == "all" else total // 2
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in (200, 1024, 2048)]
    runs = [prompts[0], *[prompts[1]] * 3, *[prompts[2]] * 3]
    got = {}
    for lanes in ("1", "2"):
        conf = EngineConfig(model=small_model, backend="cuda", expert_cache=experts,
                            compute_lanes=lanes, image_cache_mib=images, check_plan=True)
        with Engine.open(conf) as eng:
            assert eng.backend.lanes == int(lanes)
            outs = [eng.prefill(h)[0] for h in runs]
            streams = {op.stream for _, op in eng.driver.last_plan.ops()}
        assert ("compute2" in streams) == (lanes == "2")
        got[lanes] = outs
    for i, (a, b) in enumerate(zip(got["1"], got["2"])):
        assert a.tobytes() == b.tobytes(), f"run {i} differs between one and two lanes"


@gpu
@pytest.mark.parametrize("cache,lanes", [("all", "2"), ("half", "1"), ("all", "1")])
def test_in_place_products_give_the_same_bytes(small_model, rng, cache, lanes,
                                               fixed_walk_rule):
    """Products reading resident experts in place (no gather) against gathering first, on
    staging and walk chunks (each walk run three times: plain launches, the graph trial, then
    the faster) and a residency with streamed experts: the same bytes, and the plans really
    read slots in place (or, off, never)."""
    total = SMALL_SPEC.total_experts
    experts = total if cache == "all" else total // 2
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in (200, 1024, 2048)]
    runs = [prompts[0], *[prompts[1]] * 3, *[prompts[2]] * 3]
    got = {}
    for setting in ("off", "on", "auto"):
        conf = EngineConfig(model=small_model, backend="cuda", expert_cache=experts,
                            compute_lanes=lanes, in_place=setting, check_plan=True)
        with Engine.open(conf) as eng:
            outs = [eng.prefill(h)[0] for h in runs]
            in_place = [part for _, op in eng.driver.walk_plan(2048)[0].ops()
                        for part in (op.stands_for() if isinstance(op, LayerProducts) else [op])
                        if isinstance(part, Products) and part.slots is not None]
        assert bool(in_place) == (setting == "on"), setting
        got[setting] = outs
    for setting in ("on", "auto"):
        for i, (a, b) in enumerate(zip(got["off"], got[setting])):
            assert a.tobytes() == b.tobytes(), f"run {i}: in_place {setting} differs from off"


@gpu
@pytest.mark.parametrize("lanes", ["1", "2"])
def test_table_products_give_the_same_bytes(small_model, rng, lanes, fixed_walk_rule):
    """Every expert resident and read in place: each layer's products as one table launch per
    product (table_products auto) against one in-place launch per group (off), on staging and
    walk chunks (each walk run three times: plain launches, the graph trial, then the
    faster): the same bytes, and the auto plans really ran a LayerProducts per layer."""
    if not small_model.formats.format(0).offers_mmq_table():
        pytest.skip(f"format {small_model.fmt.name} offers no table products")
    prompts = [_prompt(rng, n, SMALL_SPEC.hidden) for n in (200, 1024, 2048)]
    runs = [prompts[0], *[prompts[1]] * 3, *[prompts[2]] * 3]
    got = {}
    for setting in ("off", "auto"):
        conf = EngineConfig(model=small_model, backend="cuda", compute_lanes=lanes,
                            expert_cache=SMALL_SPEC.total_experts, in_place="on",
                            table_products=setting, check_plan=True)
        with Engine.open(conf) as eng:
            outs = [eng.prefill(h)[0] for h in runs]
            merged = eng.driver.walk_plan(2048)[0].count(LayerProducts)
        assert merged == (SMALL_SPEC.n_layers if setting == "auto" else 0), setting
        got[setting] = outs
    for i, (a, b) in enumerate(zip(got["off"], got["auto"])):
        assert a.tobytes() == b.tobytes(), f"run {i}: table products differ from off"


@gpu
def test_table_products_give_the_tiny_whole_models_logits():
    """The tiny whole model (configs/tiny-qwen3moe.yaml) with every expert resident: a
    prompt's logits and greedy decode steps are the same bytes with table products on and
    off, and the merged plans ran."""
    from _generate_cases import TINY_CONFIG

    from strata_rt.config.run.run_config import load_config

    def run(setting: str) -> tuple[list[np.ndarray], set[type]]:
        ecfg = load_config(TINY_CONFIG).engine_config(backend="cuda")
        ecfg.expert_cache, ecfg.table_products, ecfg.check_plan = 16, setting, True
        rows, kinds = [], set()
        with Engine.open(ecfg) as eng:
            if not eng.model.formats.format(0).offers_mmq_table():
                pytest.skip("the tiny model's format offers no table products")
            ids = np.arange(100, dtype=np.int64) * 7 % 512
            rows.append(eng.prefill(ids, all_logits=True)[0])
            kinds |= {type(op) for _, op in eng.driver.last_plan.ops()}
            for _ in range(4):
                token = int(np.argmax(rows[-1].reshape(-1, rows[-1].shape[-1])[-1]))
                rows.append(eng.prefill(np.array([token]))[0])
                kinds |= {type(op) for _, op in eng.driver.last_plan.ops()}
        return rows, kinds

    off, kinds_off = run("off")
    on, kinds_on = run("auto")
    assert LayerProducts in kinds_on and LayerProducts not in kinds_off
    for i, (a, b) in enumerate(zip(off, on)):
        assert a.tobytes() == b.tobytes(), f"step {i}: table products differ from off"


def test_combine_spreads_a_short_chunks_rows_over_column_blocks():
    from strata_rt.backends.cuda.layer_kernels import (
        COMBINE_SPLIT_BELOW,
        ROW_THREADS,
        combine_splits,
    )

    assert combine_splits(1, 2048) == 2048 // ROW_THREADS
    assert combine_splits(COMBINE_SPLIT_BELOW - 1, 4096) == 4096 // ROW_THREADS
    assert combine_splits(COMBINE_SPLIT_BELOW, 2048) == 1
    assert combine_splits(1, ROW_THREADS - 1) == 1
