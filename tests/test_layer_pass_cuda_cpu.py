"""The CUDA executor's side of a layer pass (strata_rt.backends.cuda.prompt_pass), without a GPU:
a pass plan (schedule.planners.layer_pass) executed on the recording fake runtime launches each
chunk's kernels on that chunk's rows of the prompt residual, with its row count; each chunk's
ChunkInput brings its own slice of the prompt (ids looked up, or hidden rows uploaded) behind
one wait at the input gate; the routing of every chunk is counted; a flagged row is reported
as a row of the prompt; a captured pass replays its windows; the ordinary chunk's state comes
back afterwards (after a failed pass too). The backend holds a pass only where prefill_order
asks for one, and the memory plan counts its residual. On a GPU, the layer order against the
chunk order: the last test."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.backends.cuda.device_open import with_pass
from strata_rt.backends.cuda.prompt_pass import NO_ROW, PassReplay, flag_error
from strata_rt.backends.nonfinite import NonFiniteError
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import BudgetError, ConfigError, StrataError
from strata_rt.formats.activations import Q8_1
from strata_rt.formats.registry import registry
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.report.stats import Stats
from strata_rt.schedule import hazards
from strata_rt.schedule.plan import Logits, PromptRows
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.layer_pass import plan_layer_pass, windows
from strata_rt.schedule.vram.memory_plan import pass_chunks, pass_regions, plan_memory
from strata_rt.weights.model import QWEN3_30B_SPEC, SMALL_SPEC, Model

#: a whole model on the fake runtime's MoE shape
SPEC = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                 n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                 n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
H, L, E = SPEC.hidden, SPEC.n_layers, SPEC.n_experts
CONTEXT, CHUNK = 2048, 512


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    # a tied Q8_0 head: the GPU looks the token ids up (input "tokens")
    return Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", tied=True, dense_type="Q8_0")


def _open(fake, monkeypatch, model, order: str | None = "layers", **kw) -> Engine:
    from _fake_runtime import NullCublas

    import strata_rt.backends.cuda.dense.kernels as dk
    import strata_rt.backends.cuda.executor as ex

    monkeypatch.setattr(dk, "Cublas", NullCublas)
    monkeypatch.setattr(ex, "host_device_pointer", lambda host: 1 << 40)
    settings = dict(model=model, backend="cuda", expert_cache=3 * L * E // 4, timing=False,
                    context=CONTEXT, prefill=CHUNK, prefill_order=order)
    return Engine.open(EngineConfig(**{**settings, **kw}))  # type: ignore[arg-type]


def _pass_ops(eng: Engine, rows: int, start: int, tail: str = "last") -> list:
    """The pass plan of a `rows`-row prompt at `start` (checked), then the driver's Logits."""
    b = eng.backend
    att = DenseSchedule(SPEC.n_layers, start, b.dense_ring, 0, b.input_kind)
    plan = plan_layer_pass(b.spec, b.residency, b.walk_slots, False, start,
                           windows(rows, b.tokens), att, b.images, b.lanes_for(b.tokens),
                           b.in_place_for(b.tokens))
    hazards.check(plan, b.residency, images=b.images)
    return [op for _, op in plan.ops()] + [Logits(tail)]  # type: ignore[arg-type]


def _stats(rows: int) -> Stats:
    stats = Stats(tokens=rows, n_chunks=pass_chunks(rows, CHUNK), n_layers=L)
    stats.routing_counts = np.zeros((L, E), np.int64)
    return stats


def _input(eng: Engine, rng, rows: int) -> np.ndarray:
    if eng.backend.input_kind == "tokens":
        return rng.integers(0, SPEC.vocab, rows).astype(np.int32)
    return rng.standard_normal((rows, H)).astype(np.float32)


def _launches(rt, name: str) -> list[tuple]:
    return [args for n, _, args in rt.launched_on if n == name]


# ---------------------------------------------------------------------------- open
@pytest.mark.parametrize("order", [None, "chunks", "layers", "auto"])
def test_a_pass_is_held_only_where_prefill_order_asks(fake, monkeypatch, model, order):
    with _open(fake, monkeypatch, model, order) as eng:
        b, regions = eng.backend, eng.backend.memory.regions
        wants = order in ("layers", "auto")
        assert b.pass_tokens == b.memory.pass_tokens == (CONTEXT if wants else 0)
        assert regions.get("pass_x", 0) == (CONTEXT * H * 4 if wants else 0)
        assert regions.get("pass_flags", 0) == (CONTEXT // CHUNK * 8 if wants else 0)
        if not wants:
            with pytest.raises(StrataError, match="holds no layer pass"):
                b.begin_pass(np.zeros(10, np.int32), _stats(10), 0)


def test_moe_layers_alone_hold_no_pass(fake, monkeypatch):
    with _open(fake, monkeypatch, Model.synthetic(SMALL_SPEC, 3), "layers",
               expert_cache=16, context=None) as eng:
        assert eng.backend.pass_tokens == 0 and "pass_x" not in eng.backend.memory.regions


def test_the_memory_plan_counts_the_prompt_residual():
    """The residual of every prompt row and one flag word per chunk, beside the chunk: under
    the reserve policy they cost resident experts; a fixed residency they do not fit beside
    leaves the plan as it was, with no pass (the driver reports it)."""
    spec = QWEN3_30B_SPEC
    lay = registry()["iq3_xxs"].layout(spec.hidden, spec.ffn)
    rows, budget = 32768, 8 << 30
    assert pass_regions(spec.hidden, 8192, rows) == {"pass_x": rows * spec.hidden * 4,
                                                      "pass_flags": 4 * 8}
    assert pass_regions(spec.hidden, 8192, 0) == {}
    plain = plan_memory(spec, lay, Q8_1, budget, 64, 8192, None)
    held = plan_memory(spec, lay, Q8_1, budget, 64, 8192, None, pass_tokens=rows)
    assert (plain.pass_tokens, held.pass_tokens) == (0, rows)
    assert held.regions["pass_x"] == rows * spec.hidden * 4 and held.total <= budget
    assert plain.n_resident - held.n_resident >= rows * spec.hidden * 4 // lay.slot_bytes
    slot = lay.slot_bytes
    beside = (held.total - held.n_resident * slot) - (plain.total - plain.n_resident * slot)
    assert beside >= rows * spec.hidden * 4  # the residual (and alignment), not residents
    fixed = plan_memory(spec, lay, Q8_1, plain.total, 64, 8192, plain.n_resident)

    def tight(pass_tokens: int):
        return plan_memory(spec, lay, Q8_1, plain.total, 64, 8192, plain.n_resident,
                           pass_tokens=pass_tokens)

    with pytest.raises(BudgetError):
        tight(rows)
    assert with_pass(fixed, rows, tight) is fixed and fixed.pass_tokens == 0
    roomy = plan_memory(spec, lay, Q8_1, budget, 64, 8192, held.n_resident)
    assert with_pass(roomy, rows, lambda pass_tokens: plan_memory(
        spec, lay, Q8_1, budget, 64, 8192, held.n_resident,
        pass_tokens=pass_tokens)).regions == held.regions


# ---------------------------------------------------------------------------- a pass
@pytest.mark.parametrize("embedding", [None, "host"], ids=["tokens", "hidden"])
def test_each_chunk_runs_on_its_rows_of_the_prompt(fake, monkeypatch, model, rng, embedding):
    """1,100 rows in chunks of 512 at position 7: every layer runs chunk 0, 1, 2 in turn, each
    chunk's routing, attention and combine on its rows of pass_x with its row count, its
    attention at its positions, its RMSNorm flag in its own word; each ChunkInput brings its
    rows of the prompt, only the first waits at the gate; the head reads the prompt's last
    row; the whole residual comes back and every chunk's routing is counted."""
    P, start = 1100, 7
    kw = {} if embedding is None else {"embedding": embedding}
    with _open(fake, monkeypatch, model, **kw) as eng:
        rt, b = fake["rt"], eng.backend
        ptr = b.dev.ptr
        base, flags, home = ptr["pass_x"], ptr["pass_flags"], ptr["x"]
        x = _input(eng, rng, P)
        chunks = windows(P, CHUNK)
        assert chunks == [(0, 512), (512, 512), (1024, 76)]
        ops = _pass_ops(eng, P, start)
        rt.tokens = CHUNK
        rt.launched_on.clear()
        rt.launches.clear()
        rt.htod.clear()
        rt.dtoh.clear()
        stats = _stats(P)
        b.begin_pass(x, stats, start)
        b.execute(ops, stats, None)
        order = [base + first * H * 4 for first, _ in chunks] * L  # layer-major
        assert [a[-1] for a in _launches(rt, "combine_residual")] == order
        assert [(a[0], a[5], a[6]) for a in _launches(rt, "rmsnorm_rows")] == [
            (base + first * H * 4, flags + c * 8, layer) for layer in range(L)
            for c, (first, _) in enumerate(chunks)]
        assert [(a[4], a[5]) for a in _launches(rt, "attend_hd64")] == [
            (n, start + first) for _ in range(L) for first, n in chunks]
        assert [(a[1], a[2]) for a in _launches(rt, "qk_norm_rope_hd64")] == [
            (n, start + first) for _ in range(L) for first, n in chunks]
        norms = [a[0] for a in _launches(rt, "dense_rmsnorm_f16")]
        assert norms[:-1] == [base + first * H * 4 for _ in range(L) for first, _ in chunks]
        assert norms[-1] == base + (P - 1) * H * 4  # the head: the prompt's last row
        assert rt.launches.count("gate") == 1
        if b.input_kind == "tokens":
            gathers = _launches(rt, "ggml_rows_Q8_0")
            assert [(a[2], a[3]) for a in gathers] == [(base + f * H * 4, n) for f, n in chunks]
            ids = [(dst, host.copy()) for dst, host, _ in rt.htod if dst == ptr["token_ids"]]
            assert len(ids) == len(chunks)
            for (_, got), (first, n) in zip(ids, chunks):
                assert np.array_equal(got, x[first: first + n])
        else:
            ups = [(dst, host) for dst, host, _ in rt.htod if base <= dst < base + P * H * 4]
            assert [dst for dst, _ in ups] == [base + first * H * 4 for first, _ in chunks]
            for (_, got), (first, n) in zip(ups, chunks):
                assert np.array_equal(got.reshape(n, H), x[first: first + n])
        assert not any(dst == home for dst, _, _ in rt.htod)
        bounds = [src for src, nbytes, _ in rt.dtoh if nbytes == (E + 1) * 4]
        assert bounds == [b._bounds_ptr(layer) for layer in range(L) for _ in chunks]
        out = b.end_chunk(stats)
        assert out.shape == (P, H) and out.dtype == np.float32
        assert (base, P * H * 4, "compute") in rt.dtoh
        # the fake routes rt.tokens rows per read-back: every chunk's were added
        assert (stats.routing_counts.sum(axis=1) == len(chunks) * CHUNK * SPEC.top_k).all()
        assert (ptr["x"], ptr["nonfinite"]) == (home, b._pass.home["nonfinite"])


def test_routing_counts_are_not_added_twice(fake, monkeypatch, model, rng):
    """The driver's collect_walk_routing after a pass adds nothing: the pass counted every
    chunk's routing already."""
    P = 700
    with _open(fake, monkeypatch, model) as eng:
        rt, b = fake["rt"], eng.backend
        rt.tokens = 100
        stats = _stats(P)
        b.begin_pass(_input(eng, rng, P), stats, 0)
        b.execute(_pass_ops(eng, P, 0), stats, None)
        b.collect_walk_routing(stats)
        b.end_chunk(stats)
        assert (stats.routing_counts.sum(axis=1) == 2 * 100 * SPEC.top_k).all()


def test_the_ordinary_state_comes_back(fake, monkeypatch, model, rng):
    """After a pass, and after a pass that failed midway, an ordinary prompt's chunks run on
    the chunk's own residual and flag word, and a decode step too."""
    with _open(fake, monkeypatch, model) as eng:
        rt, b = fake["rt"], eng.backend
        ptr = b.dev.ptr
        home = dict(ptr)
        rt.tokens = 64
        stats = _stats(600)
        b.begin_pass(_input(eng, rng, 600), stats, 0)
        b.execute(_pass_ops(eng, 600, 0), stats, None)
        b.end_chunk(stats)
        assert ptr == home
        b.begin_pass(_input(eng, rng, 600), _stats(600), 0)
        ops = _pass_ops(eng, 600, 0)
        b.execute(ops[: len(ops) // 2], stats, None)  # then the driver fails
        assert ptr["x"] != home["x"]
        rt.launched_on.clear()
        eng.prefill(_input(eng, rng, 300))
        assert ptr == home
        assert {a[-1] for a in _launches(rt, "combine_residual")} == {home["x"]}
        assert {a[5] for a in _launches(rt, "rmsnorm_rows")} == {home["nonfinite"]}
        rt.tokens = 1
        for _ in range(3):
            eng.prefill(_input(eng, rng, 1))
        assert b._T == 1 and ptr == home


def test_a_pass_refuses_what_it_cannot_hold(fake, monkeypatch, model, rng):
    with _open(fake, monkeypatch, model) as eng:
        b = eng.backend
        with pytest.raises(StrataError, match=r"2049 prompt rows; this backend holds 1\.\.2048"):
            b.begin_pass(_input(eng, rng, CONTEXT + 1), _stats(10), 0)
        with pytest.raises(StrataError, match=r"positions 2000\.\.2099; the KV cache holds 2048"):
            b.begin_pass(_input(eng, rng, 100), _stats(100), 2000)
        with pytest.raises(StrataError, match="outside a layer pass"):
            b.execute([PromptRows(0, 10)], _stats(10), None)
        with pytest.raises(ConfigError, match="vocabulary"):
            b.begin_pass(np.full(10, SPEC.vocab), _stats(10), 0)
        b.begin_pass(_input(eng, rng, 600), _stats(600), 0)
        for bad in (PromptRows(512, 100), PromptRows(0, 513), PromptRows(-1, 10)):
            with pytest.raises(StrataError, match="this pass holds prompt rows 0..599"):
                b.execute([bad], _stats(600), None)


def test_a_non_finite_hidden_row_is_refused(fake, monkeypatch, model, rng):
    with _open(fake, monkeypatch, model, embedding="host") as eng:
        rt, b = fake["rt"], eng.backend
        assert b.input_kind == "hidden"
        rt.tokens = 64
        x = _input(eng, rng, 900)
        x[700, 3] = np.inf
        b.begin_pass(x, _stats(900), 0)
        b.execute(_pass_ops(eng, 900, 0), _stats(900), None)
        with pytest.raises(ConfigError, match="NaN or Inf"):
            b.end_chunk(_stats(900))
        assert b.dev.ptr["x"] == b._pass.home["x"]


def test_a_flagged_row_is_named_by_its_row_of_the_prompt(fake, monkeypatch, model, rng):
    """Chunk 1 flags its row 7 at layer 2, chunk 2 its row 0 at layer 3: the earliest layer
    wins, at prompt row 512 + 7."""
    assert flag_error(NO_ROW) is None
    assert flag_error((3 << 32) | 5, 100).row == 105  # type: ignore[union-attr]
    with _open(fake, monkeypatch, model) as eng:
        rt, b = fake["rt"], eng.backend
        rt.tokens = 64
        plain = rt.memcpy_dtoh
        words = {1: (2 << 32) | 7, 2: 3 << 32}

        def flagging(host, src, stream):
            plain(host, src, stream)
            if src == b.dev.ptr["pass_flags"]:
                for c, word in words.items():
                    host[c] = word

        monkeypatch.setattr(rt, "memcpy_dtoh", flagging)
        b.begin_pass(_input(eng, rng, 1100), _stats(1100), 0)
        b.execute(_pass_ops(eng, 1100, 0), _stats(1100), None)
        with pytest.raises(NonFiniteError) as e:
            b.end_chunk(_stats(1100))
        assert (e.value.layer, e.value.row) == (2, 519)
        assert b.dev.ptr["x"] == b._pass.home["x"]


def test_a_captured_pass_replays_its_windows(fake, monkeypatch, model, rng):
    """The capture of a pass ends at its last chunk; replayed in a later pass, the executor
    stands at that chunk again, so the live Logits reads the prompt's last row."""
    P = 1100
    with _open(fake, monkeypatch, model, cuda_graph=True) as eng:
        rt, b = fake["rt"], eng.backend
        base = b.dev.ptr["pass_x"]
        rt.tokens = 64
        ops = _pass_ops(eng, P, 0)
        b.begin_pass(_input(eng, rng, P), _stats(P), 0)
        replay = b.capture(ops[:-1])
        assert isinstance(replay, PassReplay)
        assert replay.windows == tuple(windows(P, CHUNK))
        b.execute(ops[-1:], _stats(P), None)
        b.end_chunk(_stats(P))
        assert b.dev.ptr["x"] == b._pass.home["x"]
        rt.launched_on.clear()
        rt.launches.clear()
        stats = _stats(P)
        b.begin_pass(_input(eng, rng, P), stats, 0)
        b.replay(replay)
        assert b._T == 76 and b.dev.ptr["x"] == base + 1024 * H * 4
        b.execute(ops[-1:], stats, None)
        assert rt.launches[:1] == ["graph"]
        assert [a[0] for a in _launches(rt, "dense_rmsnorm_f16")] == [base + (P - 1) * H * 4]
        # what the graph's read-backs write on a device (the fake's graph runs nothing):
        # every chunk's row bounds, each expert taking c + 1 rows in chunk c
        b._pass.bounds[:3] = np.arange(E + 1) * np.arange(1, 4)[:, None, None]
        b.end_chunk(stats)
        assert (stats.routing_counts == 1 + 2 + 3).all()
        replay.free()


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_layer_pass_equals_the_chunk_order(monkeypatch, rng):
    """On the GPU, a 300-token prompt in chunks of 128 with 40 of 64 experts streamed:
    prefill_order "layers" gives the chunk order's logits byte for byte and the same greedy
    token, run plainly, then captured and replayed."""
    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=32, top_k=4, context=512)
    gpu_model = Qwen3Model.synthetic(spec, 6, "iq3_xxs")
    ids = rng.integers(0, spec.vocab, 300)
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")

    def run(order: str) -> tuple[list, dict]:
        out = []
        with Engine.open({"model": gpu_model, "backend": "cuda", "prefill": 128,
                          "expert_cache": 24, "context": 512, "prefill_order": order}) as eng:
            assert eng.backend.pass_tokens == (512 if order == "layers" else 0)
            for _ in range(3):  # plain, captured and replayed, then the faster
                eng.reset()
                logits, _ = eng.prefill(np.asarray(ids))
                mode = eng.driver.last_plan.mode
                eng.reset()
                token, _ = eng.prefill_argmax(np.asarray(ids))
                out.append((logits.copy(), token, mode))
            trials = {k: dict(v) for k, v in eng.driver.graph_trials.items()}
        return out, trials

    chunks, _ = run("chunks")
    layers, trials = run("layers")
    for (lc, tc, _), (ll, tl, mode) in zip(chunks, layers):
        assert mode == "layer_pass"
        assert ll.tobytes() == lc.tobytes() and tl == tc
    assert any("graph" in t and "error" not in t for t in trials.values())


@pytest.mark.parametrize("rows", [300, 700])  # one chunk; a layer pass of two
def test_the_residual_comes_back_only_for_a_dump(fake, monkeypatch, model, rng, tmp_path,
                                                 rows):
    """A whole model's prefill reads its logits, not its hidden states: the residual (the
    chunk's, or the pass's whole prompt) crosses back to the host only when the residual dump
    asks for it."""
    def residual_reads(eng: Engine) -> list[int]:
        rt, ptr = fake["rt"], eng.backend.dev.ptr
        rt.tokens = 64
        homes = {ptr["x"], ptr["pass_x"]}
        rt.dtoh.clear()
        eng.reset()
        eng.prefill(_input(eng, rng, rows))
        return [n for src, n, _ in rt.dtoh if src in homes]

    with _open(fake, monkeypatch, model) as eng:
        assert residual_reads(eng) == []
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(tmp_path / "r.dump"))
    with _open(fake, monkeypatch, model) as eng:
        assert residual_reads(eng) == [rows * H * 4]
