"""The CUDA backend on the CPU: its memory plan, and its control flow through a recording
fake runtime (launch sequences, counters, graph capture, the trace, open/close order, a whole
model's dense launches). The same backend on a GPU: tests/test_cuda_engine.py."""


from dataclasses import replace

import numpy as np
import pytest

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import BudgetError, ConfigError
from strata_rt.formats.activations import Q8_1
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.gemm.fused_gemm import TILES as FUSED_TILES
from strata_rt.gemm.fused_gemm import at_name
from strata_rt.gemm.grouped_gemm import TILES as GEMM_TILES
from strata_rt.report.timing import NOTE, PHASES, format_table
from strata_rt.runtime.memory import plan_regions, regions_total
from strata_rt.schedule import hazards
from strata_rt.schedule.planners.planner import (
    AUTO_CHUNK_MAX,
    StagingPlanner,
    plan_walk,
    walk_ring_slots,
)
from strata_rt.schedule.vram.memory_plan import chunk_regions, fixed_regions, plan_memory
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import QWEN3_30B_SPEC, SMALL_SPEC, Model

MIB = 1 << 20
GIB = 1 << 30


# ============================================================================ CPU: memory plan
def _total(spec, lay, act, ring, tokens, resident):
    regions = {**fixed_regions(spec, lay, ring), "resident": resident * lay.slot_bytes,
               **chunk_regions(spec, act, tokens)}
    return regions_total(plan_regions(regions))


@pytest.mark.parametrize("spec", [SMALL_SPEC, QWEN3_30B_SPEC], ids=["small", "qwen3-30b"])
def test_auto_chunk_is_largest_that_fits_beside_fixed_residency(spec):
    from strata_rt.formats.registry import registry

    fmt = registry()["iq3_xxs"]
    lay = fmt.layout(spec.hidden, spec.ffn)
    n_res = spec.total_experts // 4
    big = plan_memory(spec, lay, Q8_1, 1 << 40, 8, "auto", n_res)
    assert big.tokens == AUTO_CHUNK_MAX and big.n_resident == n_res
    # a budget that holds 3,000 tokens but not 3,072
    avail = _total(spec, lay, Q8_1, 8, 3000, n_res)
    mp = plan_memory(spec, lay, Q8_1, avail, 8, "auto", n_res)
    assert mp.tokens == 2944 and mp.total <= avail
    assert _total(spec, lay, Q8_1, 8, mp.tokens + 64, n_res) > avail


def test_reserve_policy_fills_the_rest_with_residents():
    from strata_rt.formats.registry import registry

    spec = QWEN3_30B_SPEC
    lay = registry()["iq3_xxs"].layout(spec.hidden, spec.ffn)
    chunk_only = _total(spec, lay, Q8_1, 64, 8192, 0)
    avail = chunk_only + 1000 * lay.slot_bytes + 100
    mp = plan_memory(spec, lay, Q8_1, avail, 64, "auto", None)
    assert mp.tokens == 8192
    assert mp.n_resident in (999, 1000) and mp.total <= avail
    everything = plan_memory(spec, lay, Q8_1, 1 << 45, 64, "auto", None)
    assert everything.n_resident == spec.total_experts


def test_budget_error_names_the_sizes():
    from strata_rt.formats.registry import registry

    spec = QWEN3_30B_SPEC
    lay = registry()["iq3_xxs"].layout(spec.hidden, spec.ffn)
    with pytest.raises(BudgetError, match=r"8192-token chunk .* MiB .*gate_up_out"):
        plan_memory(spec, lay, Q8_1, 512 * MIB, 8, 8192, 0)
    with pytest.raises(BudgetError, match="resident experts"):
        plan_memory(spec, lay, Q8_1, 2 * GIB, 8, "auto", spec.total_experts)


def test_timing_table_lists_phases_in_order_with_the_note():
    text = format_table({"combine": 1.0, "rmsnorm": 3.0, "wait copy": 6.0, "extra": 0.5},
                        {"rmsnorm": 2}, wall_s=0.02, host_s=0.001)
    lines = text.splitlines()
    names = [ln.split("  ")[0].strip() for ln in lines[1:5]]
    assert names == ["rmsnorm", "wait copy", "combine", "extra"]
    assert NOTE in text and "slower" in NOTE
    assert "57.1%" in text  # 6 of 10.5 ms
    assert set(PHASES) >= {"rmsnorm", "router gemm", "softmax top-k", "sort", "quantize acts",
                           "wait copy", "gather", "gemm gate/up", "swiglu+quantize",
                           "gemm down", "combine"}


def test_check_plan_clean_on_qwen3_30b_shape(rng):
    """STRATA_CHECK_PLAN on the Qwen3-30B-A3B shape: the walk (both gather modes, quarter
    residency, the default ring) and the staging ring over 48 layers of random routing."""
    spec = QWEN3_30B_SPEC
    model = Model.synthetic(replace(spec, n_layers=1), 0)  # only the layout matters
    slot = model.layout.slot_bytes
    pairs = [(layer, e) for layer in range(spec.n_layers) for e in range(spec.n_experts)]
    picks = rng.choice(len(pairs), spec.total_experts // 4, replace=False)
    res = Residency(spec.n_layers, spec.n_experts, [pairs[i] for i in picks], slot)
    ring = walk_ring_slots(None, slot, spec.total_experts - res.n_slots)
    for gather_one in (False, True):
        plan = plan_walk(spec, res, ring, gather_one, tokens=8192)
        hazards.check(plan, res)
        planner = StagingPlanner(spec, res, gather_one, tokens=512)
        checker = hazards.Checker(8, res)
        for layer in range(spec.n_layers):
            routed = rng.choice(spec.n_experts, int(rng.integers(8, 120)), replace=False)
            checker.feed(planner.plan_layer(layer, routed).ops)


# ============================================================================ CPU: fake runtime
@pytest.mark.parametrize("gather_one", [False, True])
def test_backend_control_flow_on_fake_runtime(fake, gather_one, fixed_walk_rule):
    model = Model.synthetic(SMALL_SPEC, 3)
    spec = model.spec
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=spec.total_experts // 2,
                       gather_one=gather_one, check_plan=True, timing=False)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        assert eng.chunk_tokens == AUTO_CHUNK_MAX
        h = np.ones((300, spec.hidden), np.float32)
        rt.tokens = 300
        _, st = eng.prefill(h)
        assert st.host_syncs == spec.n_layers + 1  # one routed-set read-back per layer
        # the default IQ3_XXS variant: grouped fp16 GEMMs after dequantizing gathers, and the
        # fused kernels' in-place twins for groups whose experts are all resident
        gemms = {t.name for t in GEMM_TILES}
        in_place = {at_name(t) for t in FUSED_TILES}
        assert st.mmq_launches == sum(n in gemms | in_place for n in rt.launches)
        assert any(n in in_place for n in rt.launches) and any(n in gemms for n in rt.launches)
        assert rt.launches.count("route_scatter") == spec.n_layers
        assert st.gathers_launched == rt.launches.count("iq3_dequant_gather")
        assert st.experts_streamed > 0
        # the walk: planned ahead, no read-back per layer; then graph capture and replay
        rt.launches.clear()
        h = np.ones((2048, spec.hidden), np.float32)
        _, st1 = eng.prefill(h)
        # the chunk's end, which brings its routing back with its output: the record the
        # walk-or-routed rule reads (schedule/prefill_stream.py)
        assert st1.host_syncs == 1
        streamed = spec.total_experts - spec.total_experts // 2
        assert st1.experts_streamed == streamed
        assert st1.gathers_launched == (spec.total_experts if gather_one
                                        else spec.n_layers * spec.n_experts // MMQ_GROUP)
        assert st1.mmq_launches == 2 * spec.n_layers * spec.n_experts // MMQ_GROUP
        rt.launches.clear()
        _, st2 = eng.prefill(h)
        assert rt.launches == ["graph"]
        trial = eng.driver.graph_trials[(2048, gather_one, None)]
        assert set(trial) == {"plain", "graph", "choice"}
        assert st2.as_dict()["experts_streamed"] == st1.experts_streamed
    assert fake["rt"].closed


def test_trace_of_both_streams(fake, tmp_path, fixed_walk_rule):
    """STRATA_PREFILL_TRACE: timing turns on, every prompt adds a lane with compute phases and
    one span per copy, and the file is whole JSON after each prompt."""
    import json

    model = Model.synthetic(SMALL_SPEC, 3)
    path = tmp_path / "trace.json"
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=SMALL_SPEC.total_experts // 2,
                       trace=str(path))
    with Engine.open(cfg) as eng:
        assert eng.config.timing
        fake["rt"].tokens = 2048
        _, st = eng.prefill(np.ones((2048, SMALL_SPEC.hidden), np.float32))
        doc = json.loads(path.read_text())
        fake["rt"].tokens = 300
        eng.prefill(np.ones((300, SMALL_SPEC.hidden), np.float32))
        doc2 = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    copies = [e for e in spans if e["tid"] == 2]
    assert len(copies) == st.experts_streamed and copies[0]["name"].startswith("copy L0 ")
    assert {"router gemm", "gemm gate/up", "combine"} <= {e["name"] for e in spans
                                                          if e["tid"] == 1}
    lanes = {e["args"]["name"] for e in doc2["traceEvents"] if e["name"] == "process_name"}
    assert lanes == {"prompt 1 (2048 tokens)", "prompt 2 (300 tokens)"}
    assert not (tmp_path / "trace.json.partial").exists()


def test_open_closes_the_runtime_when_a_later_step_fails(fake, tmp_path):
    """The runtime opens first and holds the pinned store; a failure after it (here a missing
    profile file, read once the store exists) closes it, leaking neither."""
    model = Model.synthetic(SMALL_SPEC, 3)
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=4,
                       profile=str(tmp_path / "missing.json"))
    with pytest.raises(Exception, match="missing.json"):
        Engine.open(cfg)
    assert fake["rt"].closed


def test_engine_close_frees_in_reverse_order(fake):
    model = Model.synthetic(SMALL_SPEC, 3)
    eng = Engine.open(EngineConfig(model=model, backend="cuda", expert_cache=4))
    backend = eng.backend
    eng.close()
    assert backend.dev is None and fake["rt"].closed
    eng.close()  # twice is harmless
    with pytest.raises(Exception, match="closed"):
        eng.prefill(np.ones((4, SMALL_SPEC.hidden), np.float32))


class _RecordingCublas:
    """Stands in for cuBLAS on the fake runtime: records each GEMM's shape."""

    version = (0, 0, 0)
    calls: list[tuple] = []

    def __init__(self, workspace, workspace_bytes, owner=None):
        pass

    def gemm(self, stream, x, w, out, rows, n_out, k, out_f32, accumulate):
        assert all(isinstance(v, int) and v > 0 for v in (x, w, out, rows, n_out, k))
        _RecordingCublas.calls.append((rows, n_out, k, out_f32, accumulate))

    def destroy(self):
        pass


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_whole_model_control_flow_on_fake_runtime(fake, monkeypatch, dense, fixed_walk_rule):
    """A whole model on the CUDA backend, without a GPU: the layer's five dense launches per
    Attention (norm, qkv GEMM, q/k norms + RoPE, attention, o GEMM accumulating into x), the
    head per chunk, dense copies only when streaming, and the hazard checker on every plan."""
    import strata_rt.backends.cuda.dense.kernels as dk
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec

    monkeypatch.setattr(dk, "Cublas", _RecordingCublas)
    _RecordingCublas.calls = []
    spec = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                     n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                     n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
    whole = Qwen3Model.synthetic(spec, 3, "iq3_xxs")
    cfg = EngineConfig(model=whole, backend="cuda", expert_cache=spec.n_experts,
                       check_plan=True, timing=False, dense=dense, context=2048, prefill=512)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        assert eng.backend.dense_ring == (2 if dense == "stream" else None)
        assert eng.context_tokens == 2048
        copies0 = rt.copies
        rt.tokens = 700
        ids = np.arange(700) % spec.vocab
        logits, st = eng.prefill(ids)  # the fake's pinned logits: zeros
        assert logits.shape == (spec.vocab,) and eng.kv_length == 700
        L = spec.n_layers
        assert rt.launches.count("qk_norm_rope_hd64") == 2 * L  # two chunks
        assert rt.launches.count("attend_hd64") == 2 * L
        # each layer's norm in both chunks, and the head's over the last chunk's last row
        assert rt.launches.count("dense_rmsnorm_f16") == 2 * L + 1
        qkv = [c for c in _RecordingCublas.calls if c[1] == spec.q_dim + 2 * spec.kv_dim]
        out = [c for c in _RecordingCublas.calls if c[1] == spec.hidden]
        assert sorted(c[0] for c in qkv) == sorted([512] * L + [188] * L)
        assert all(c[3] and c[4] and c[2] == spec.q_dim for c in out)  # fp32 x += o Wo^T
        dense_copies = rt.copies - copies0 - 2  # minus the two chunks' uploads of x
        assert dense_copies >= (2 * L if dense == "stream" else 0)
        plan = eng.driver.last_plan
        assert plan is not None and plan.tokens == 188
        with pytest.raises(Exception, match="exceed the context of 2048"):
            eng.prefill(np.zeros(2000, np.int64))


def _whole_spec():
    from strata_rt.models.qwen3 import Qwen3Spec

    return Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                     n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                     n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)


@pytest.mark.parametrize("store_memory", ["alloc", "register"])
def test_streamed_dense_layers_are_page_locked_as_store_memory_says(fake, monkeypatch,
                                                                   store_memory,
                                                                   fixed_walk_rule):
    """A whole model's streamed dense layers wait in host memory the context lends, as the
    expert store does: under "register" an arena for them, unregistered while their images
    are written and registered once afterwards (in the runtime's context); under "alloc" one
    pinned allocation of n_layers x slot bytes and no arena. Each DenseCopy reads its layer's
    own slot image out of that memory, in both cases."""
    from _fake_runtime import NullCublas

    import strata_rt.backends.cuda.dense.host_store as hs
    import strata_rt.backends.cuda.dense.kernels as dk
    from strata_rt.backends.cuda.dense.slots import dense_slot_bytes
    from strata_rt.models.qwen3 import Qwen3Model
    from strata_rt.models.qwen3.whole_memory import DenseLayout, DenseTypes

    monkeypatch.setattr(dk, "Cublas", NullCublas)
    spec = _whole_spec()
    whole = Qwen3Model.synthetic(spec, 3, "iq3_xxs")
    lay = DenseLayout.of(spec, DenseTypes.of_model(whole))
    L, slot_bytes = spec.n_layers, lay.slot_bytes
    images = [dense_slot_bytes(whole, i, s).tobytes() for i, s in enumerate(lay.slots)]
    #: at each layer's image: the registrations of the dense arenas made so far
    seen: list[list[int]] = []

    def watched(w, layer, slot):
        seen.append([a.registered for a in fake["rt"].host_arenas if a.what == hs.WHAT])
        return dense_slot_bytes(w, layer, slot)

    monkeypatch.setattr(hs, "dense_slot_bytes", watched)
    cfg = EngineConfig(model=whole, backend="cuda", expert_cache=spec.n_experts, timing=False,
                       dense="stream", context=2048, prefill=512, store_memory=store_memory)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        assert eng.backend.dense_ring == 2
        dense_alloc = [a for sizes, a in rt.pinned_arenas if sizes == {"store": L * slot_bytes}]
        if store_memory == "register":
            assert [a.what for a in rt.host_arenas] == ["the expert store", hs.WHAT]
            arena = rt.host_arenas[1]
            assert seen == [[0]] * L  # written while not page-locked
            assert arena.registered == 1 and arena.registered_current
            assert arena.nbytes == L * slot_bytes and not dense_alloc
            assert arena.registered_bytes is not None
            rows = np.frombuffer(arena.registered_bytes, np.uint8).reshape(L, slot_bytes)
            assert [rows[i, : len(b)].tobytes() for i, b in enumerate(images)] == images
            memory = arena.array
        else:
            assert not rt.host_arenas and seen == [[]] * L
            (pinned,) = dense_alloc
            assert rt.portable == [False] * len(rt.portable)  # one device: not portable
            memory = pinned.view("store")
        base = rt.region("dense")
        rt.tokens = 700
        rt.htod.clear()
        eng.prefill(np.arange(700) % spec.vocab)
        copies = [(dst, host) for dst, host, _ in rt.htod if base <= dst < base + 2 * slot_bytes]
        assert len(copies) >= 2 * L  # every layer in each of the two chunks
        layers = []
        for dst, host in copies:
            assert np.shares_memory(host, memory)
            at = host.ctypes.data - memory.ctypes.data
            layer = at // slot_bytes
            assert at % slot_bytes == 0 and dst == base + (layer % 2) * slot_bytes
            assert host.tobytes() == images[layer]
            layers.append(layer)
        assert sorted(set(layers)) == list(range(L))


def test_chunk_input_waits_at_the_gate(fake, fixed_walk_rule):
    """Every chunk's upload is enqueued behind the input gate before any kernel reads the
    hidden states (staging ring and walk); every pass opens the gate, a refused input's
    too, so a device would never wait forever; the engine goes on after a refusal."""
    model = Model.synthetic(SMALL_SPEC, 3)
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=SMALL_SPEC.total_experts // 2)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        (gate,) = rt.gates
        for n, tokens in enumerate((300, 2048), start=1):
            rt.tokens = tokens
            rt.launches.clear()
            eng.prefill(np.ones((tokens, SMALL_SPEC.hidden), np.float32))
            assert rt.launches[0] == "gate" and rt.launches.count("gate") == 1
            assert gate.opened == n
        bad = np.ones((300, SMALL_SPEC.hidden), np.float32)
        bad[7, 3] = np.nan
        rt.tokens = 300
        with pytest.raises(ConfigError, match="NaN or Inf"):
            eng.prefill(bad)
        assert gate.opened == 3
        out, _ = eng.prefill(np.ones((300, SMALL_SPEC.hidden), np.float32))
        assert gate.opened == 4 and out.shape == (300, SMALL_SPEC.hidden)
