"""A whole model's token embedding looked up on the GPU, tested without a GPU: the row gather
(kernels/ggml/rows.cu) compiles for sm_80 and sm_90 with one kernel per type, its walk built as
host code equals gguf.quants.dequantize bit for bit for every type (NaN rows for ids outside
the matrix), its launcher's checks and arguments; the plans bring token ids where a whole
model's schedule says so and the hazard checker holds them to a whole model; the memory plan
counts the embedding in its type (once with a tied head); ids outside the vocabulary are
refused on the host before anything is enqueued; the CUDA executor's control flow on the
recording fake runtime; and the reference backend gives the same bytes on both paths. The bytes
on a GPU: tests/test_embedding_gpu.py."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from _dense_models import block_tensor, with_embedding
from _ggml_blocks import row_ids, row_matrix
from _launch_log import LoggingRuntime

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError, FormatError, PlanHazardError
from strata_rt.formats.ggml_types import TYPES, ggml_type
from strata_rt.gemm.ggml_rows import (
    ROWS_ARG_TYPES,
    ROWS_SOURCE,
    ROWS_THREADS,
    GgmlRows,
    rows_reference,
)
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.models.qwen3.whole_memory import (
    DenseTypes,
    WholeSizing,
    tensor_bytes,
    whole_chunk_regions,
    whole_fixed_regions,
)
from strata_rt.runtime.compile import compile_cubin, kernel_jobs, nvcc_available
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    Attention,
    ChunkInput,
    ChunkPlan,
    LayerBegin,
    LayerEnd,
    LayerPlan,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import StagingPlanner, plan_decode, plan_routed, plan_walk
from strata_rt.schedule.split import LayerSplit
from strata_rt.schedule.vram.residency import Residency
from strata_rt.weights.model import SMALL_SPEC

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or "
                                "STRATA_NVCC)")
IDS = [t.name for t in TYPES]
#: a whole model on the fake runtime's MoE shape
SPEC = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                 n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                 n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
TINY = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                 ffn=256, n_experts=8, top_k=2, context=512)


# ---------------------------------------------------------------------------- the kernel
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_rows_compile_one_kernel_per_type(arch):
    cubin = compile_cubin(ROWS_SOURCE, arch).read_bytes()
    names = set(re.findall(rb"ggml_rows_([A-Z0-9_]+?)\x00", cubin))
    assert {t.name.encode() for t in TYPES} <= names


def test_check_kernels_compiles_the_row_gather():
    assert ROWS_SOURCE.resolve() in [p for owner, p in kernel_jobs([]) if owner == "ggml"]


@needs_nvcc
@pytest.mark.parametrize("name", IDS)
def test_the_row_walk_equals_gguf_bit_for_bit(rng, name):
    """The walk each device thread runs (row_chunk8, built as host code) on a matrix of every
    type: rows picked by id with repeats, the first and the last row, equal to
    gguf.quants.dequantize of those rows bit for bit; ids outside the matrix give NaN rows."""
    from _ggml_host import host_decoder

    t = ggml_type(name)
    vocab, cols = 37, 512
    table = row_matrix(rng, t, vocab, cols)
    ids = np.concatenate([row_ids(rng, vocab, 40), [-1, vocab, 2**31 - 1]]).astype(np.int32)
    got = host_decoder().rows(t, table, ids, cols)
    want = rows_reference(t, table, ids, cols)
    assert np.array_equal(got[:-3].view(np.uint32), want[:-3].view(np.uint32)), name
    assert np.isnan(got[-3:]).all() and np.isnan(want[-3:]).all()
    assert np.isfinite(want[:-3]).all()  # the comparison above is of values, not of NaNs


@needs_nvcc
def test_the_row_walk_refuses_a_geometry_the_gather_cannot_take():
    from _ggml_host import host_decoder

    lib = host_decoder().lib
    table = np.zeros((2, 34), np.uint8)
    ids = np.zeros(1, np.int32)
    out = np.zeros(64, np.float32)
    assert lib.ggml_host_rows(8, table.ctypes.data, 34, 2, ids.ctypes.data, 1, 36,
                              out.ctypes.data) == -2  # not whole blocks, not 8-value steps
    assert lib.ggml_host_rows(8, table.ctypes.data, 33, 2, ids.ctypes.data, 1, 32,
                              out.ctypes.data) == -2  # row bytes that are not one row
    assert lib.ggml_host_rows(9, table.ctypes.data, 36, 2, ids.ctypes.data, 1, 32,
                              out.ctypes.data) == -1  # Q8_1: no decoder


# ---------------------------------------------------------------------------- the launcher
def test_rows_launch_arguments_and_grid():
    rt = LoggingRuntime(ROWS_ARG_TYPES)
    rows = GgmlRows(rt)  # type: ignore[arg-type]
    assert rt.sources == [ROWS_SOURCE]
    rows.rows("stream", "Q4_K", 0x1001, 0x2000, 0x10000, 300, 151936, 2048)
    name, grid, block, args = rt.log[-1]
    assert name == "ggml_rows_Q4_K" and block == (ROWS_THREADS, 1, 1)
    assert grid == (-(-300 * 2048 // 8 // ROWS_THREADS), 1, 1)
    assert args == (0x1001, 0x2000, 0x10000, 300, 151936, 2048 // 256 * 144, 2048)
    rows.rows("stream", ggml_type("F32"), 0x3000, 0x2000, 0x10000, 1, 10, 8)
    assert rt.log[-1][1] == (1, 1, 1) and rt.log[-1][3][5] == 32
    rows.rows("stream", "BF16", 0x3000, 0x2000, 0x10000, 100_000, 10, 4096)
    assert rt.log[-1][1] == (4096, 1, 1)  # at most ROWS_MAX_BLOCKS: the threads stride


@pytest.mark.parametrize("message, type_name, table, out, ids_off, tokens, hidden", [
    ("whole number", "Q4_K", 1, 1, 0, 1, 200),
    ("multiple of 8", "F16", 1, 1, 0, 1, 12),
    ("16-byte", "Q8_0", 1, 1, 8, 1, 32),
    ("device addresses", "Q8_0", 0, 1, 16, 1, 32),
    ("must be 1..", "Q8_0", 1, 1, 16, 0, 32),
    ("no decoder", "Q8_1", 1, 1, 16, 1, 32),
])
def test_rows_launcher_refuses_what_the_kernel_cannot_do(message, type_name, table, out, ids_off,
                                                         tokens, hidden):
    rows = GgmlRows(LoggingRuntime(ROWS_ARG_TYPES))  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=message):
        rows.rows(None, type_name, table, out, ids_off, tokens, 10, hidden)


def test_rows_reference_is_gguf_of_the_rows(rng):
    import gguf

    t = ggml_type("Q8_0")
    w = rng.standard_normal((6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, t.qtype)
    ids = np.array([5, 0, 5, 6, -1])
    got = rows_reference(t, raw, ids, 64)
    want = gguf.quants.dequantize(raw, t.qtype)
    assert np.array_equal(got[:3], want[[5, 0, 5]]) and np.isnan(got[3:]).all()


# ---------------------------------------------------------------------------- plans, hazards
def _moe(n_layers: int = 2, n_experts: int = 16):
    from strata_rt.weights.model import MoESpec

    spec = MoESpec(n_layers=n_layers, hidden=256, ffn=256, n_experts=n_experts, top_k=1)
    return spec, Residency(n_layers, n_experts, [(0, 1)], 256)


def _inputs(plan: ChunkPlan) -> list:
    return [op for _, op in plan.ops() if isinstance(op, ChunkInput)]


@pytest.mark.parametrize("ring", [None, 2])
def test_every_planner_brings_token_ids_where_the_schedule_says(ring):
    """The whole model's schedule names the input: the walk, the staging ring, the routed and
    the decode plans open with ChunkInput of that kind, and the checker accepts them; MoE
    layers alone keep hidden states."""
    spec, res = _moe()
    for kind in ("hidden", "tokens"):
        sched = DenseSchedule(spec.n_layers, 0, ring, input_kind=kind)
        plans = [plan_walk(spec, res, 4, False, tokens=300, attention=sched),
                 plan_routed(spec, res, sched, False, 300),
                 plan_decode(spec, res, DenseSchedule(spec.n_layers, None, ring,
                                                      input_kind=kind))]
        staging = StagingPlanner(spec, res, False, attention=sched)
        for layer in range(spec.n_layers):
            staging.plan_layer(layer, [0, 3])
        plans.append(staging.chunk_plan())
        for plan in plans:
            assert _inputs(plan) == [ChunkInput(kind)], plan.mode
            check(plan, res)
    assert _inputs(plan_walk(spec, res, 4, False, tokens=300)) == [ChunkInput()]


def test_a_split_brings_token_ids_to_its_first_part_only():
    from strata_rt.schedule.split.hazards import SplitChecker

    spec, res = _moe(n_layers=4)
    split = LayerSplit((0, 1), (0, 2, 4))
    plans = []
    for part in split.parts:
        sched = DenseSchedule(part.end, 0, None, part.first, "tokens")
        plans.append(plan_walk(spec, res, 4, False, tokens=64, attention=sched, part=part))
    assert _inputs(plans[0]) == [ChunkInput("tokens")] and _inputs(plans[1]) == []
    checker = SplitChecker(split, [res, res], [None, None])
    for i, plan in enumerate(plans):
        checker.feed(i, plan)


def test_the_checker_holds_token_ids_to_a_whole_model():
    """A ChunkInput of an unknown kind, or of token ids ahead of a layer that opens without
    its Attention (MoE layers alone have no embedding), is refused naming the op."""
    whole = [LayerPlan(0, (ChunkInput("tokens"), Attention(0, 0), LayerBegin(0), LayerEnd(0)))]
    check(ChunkPlan(4, "walk", 1, whole))
    moe = [LayerPlan(0, (ChunkInput("tokens"), LayerBegin(0), LayerEnd(0)))]
    with pytest.raises(PlanHazardError, match=r"op #1 LayerBegin.*no Attention of its layer.*"
                                              r"needs a whole model"):
        check(ChunkPlan(4, "walk", 1, moe))
    bad = [LayerPlan(0, (ChunkInput("floats"), LayerBegin(0), LayerEnd(0)))]  # type: ignore[arg-type]
    with pytest.raises(PlanHazardError, match=r"op #0 .*kind must be one of hidden, tokens"):
        check(ChunkPlan(4, "walk", 1, bad))
    late = [LayerPlan(0, (Attention(0, 0), ChunkInput("tokens"), LayerBegin(0), LayerEnd(0)))]
    with pytest.raises(PlanHazardError, match="no ChunkInput before it"):
        check(ChunkPlan(4, "walk", 1, late))


# ---------------------------------------------------------------------------- memory
def test_the_memory_plan_counts_the_embedding_in_its_type():
    """Untied: the embedding's own region, in its type; tied with the head on the device: the
    head's bytes serve it; a split part before the last holds it even when tied (the head is
    elsewhere), and a part that receives does not; the host path and a type without a GPU
    decoder hold none. Every chunk that looks ids up takes T int32 for them."""
    H, V = TINY.hidden, TINY.vocab
    untied = DenseTypes.uniform(TINY.n_layers, "Q8_0")
    tied = DenseTypes.uniform(TINY.n_layers, "Q8_0", tied=True)
    q8 = tensor_bytes("Q8_0", V, H)

    def regions(types: DenseTypes, **kw) -> tuple[int, int, int]:
        w = WholeSizing(TINY, types, 64, **kw)
        fixed = whole_fixed_regions(w)
        return fixed["embd"], fixed["head"], whole_chunk_regions(w, 100)["token_ids"]

    assert regions(untied) == (q8, q8, 400)
    assert regions(tied) == (0, q8, 400)
    assert regions(tied, head=False) == (q8, 0, 400)  # the first part of a split
    assert regions(untied, head=False, embedding=False) == (0, 0, 0)  # a receiving part
    assert regions(untied, embedding=False) == (0, q8, 0)  # STRATA_EMBEDDING=host
    odd = replace(untied, embd="TQ2_0")  # no GPU decoder: the host looks the rows up
    assert regions(odd) == (0, q8, 0) and not WholeSizing(TINY, odd, 64).embeds
    assert regions(replace(untied, embd=None)) == (0, q8, 0)


def test_auto_keeps_a_plain_float_embedding_on_the_host_unless_the_head_holds_it():
    """The default rule: a quantized embedding is looked up on the GPU (decoding its rows on
    the host is slow); an F32 / F16 / BF16 one only when a tied head on the device holds its
    bytes anyway (elsewhere its rows cost the host a copy, while in VRAM they would take expert
    slots); "device" takes every decodable type, "host" none."""
    from strata_rt.models.qwen3.whole_memory import embeds_on_gpu

    for t in ("F32", "F16", "BF16"):
        assert not embeds_on_gpu("auto", t, False) and embeds_on_gpu("auto", t, True)
        assert embeds_on_gpu("device", t, False) and not embeds_on_gpu("host", t, True)
    for t in ("Q8_0", "Q4_K", "Q6_K", "IQ3_XXS"):
        assert embeds_on_gpu("auto", t, False) and embeds_on_gpu("device", t, False)
        assert not embeds_on_gpu("host", t, False)
    assert not embeds_on_gpu("auto", "TQ2_0", True) and not embeds_on_gpu("device", None, False)
    H, V = TINY.hidden, TINY.vocab
    f16 = DenseTypes.uniform(TINY.n_layers, "F16")
    auto = WholeSizing(TINY, f16, 64, embedding_mode="auto")
    assert not auto.embeds and whole_fixed_regions(auto)["embd"] == 0
    assert whole_chunk_regions(auto, 100)["token_ids"] == 0
    dev = WholeSizing(TINY, f16, 64, embedding_mode="device")
    assert dev.embeds and whole_fixed_regions(dev)["embd"] == tensor_bytes("F16", V, H)
    tied = WholeSizing(TINY, DenseTypes.uniform(TINY.n_layers, "F16", tied=True), 64,
                       embedding_mode="auto")
    assert tied.embeds and tied.embd_in_head and whole_fixed_regions(tied)["embd"] == 0
    split_first = replace(tied, head=False)  # the head sits on another device: host rows
    assert not split_first.embeds


def test_a_run_configs_sizing_follows_the_embedding_switch(monkeypatch):
    """What a run config's checks size before the engine opens: the embedding on the GPU
    unless STRATA_EMBEDDING=host (the engine's own rule, EngineConfig.embedding)."""
    from strata_rt.config.run.whole import whole_sizing

    types = DenseTypes.uniform(TINY.n_layers, "Q8_0")
    monkeypatch.delenv("STRATA_EMBEDDING", raising=False)
    sizing = whole_sizing(TINY, types, None)
    assert sizing is not None and whole_fixed_regions(sizing)["embd"] > 0
    monkeypatch.setenv("STRATA_EMBEDDING", "host")
    sizing = whole_sizing(TINY, types, None)
    assert sizing is not None and whole_fixed_regions(sizing)["embd"] == 0
    plain = DenseTypes.uniform(TINY.n_layers, "F16")
    monkeypatch.delenv("STRATA_EMBEDDING", raising=False)  # auto: an F16 one stays on the host
    sizing = whole_sizing(TINY, plain, None)
    assert sizing is not None and whole_fixed_regions(sizing)["embd"] == 0
    monkeypatch.setenv("STRATA_EMBEDDING", "device")
    sizing = whole_sizing(TINY, plain, None)
    assert sizing is not None and whole_fixed_regions(sizing)["embd"] > 0


def test_dense_types_know_the_embedding(rng):
    model = with_embedding(Qwen3Model.synthetic(TINY, 1, "fp16", dense_type="Q8_0"), "Q4_K",
                           rng)
    types = DenseTypes.of_model(model)
    assert (types.embd, types.head, types.tied) == ("Q4_K", "Q8_0", False)
    tied = DenseTypes.of_model(Qwen3Model.synthetic(TINY, 1, "fp16", tied=True,
                                                    dense_type="BF16"))
    assert (tied.embd, tied.head, tied.tied) == ("BF16", "BF16", True)
    names = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0"}

    def type_of(name: str) -> str | None:
        return names.get(name, "F16" if name.startswith("blk.") else None)

    got = DenseTypes.lookup(TINY.n_layers, type_of)
    assert (got.embd, got.head, got.tied) == ("Q6_K", "Q8_0", False)
    del names["output.weight"]
    got = DenseTypes.lookup(TINY.n_layers, type_of)
    assert (got.embd, got.head, got.tied) == ("Q6_K", "Q6_K", True)


# ---------------------------------------------------------------------------- the reference
def _reference(model: Qwen3Model, embedding: str, prompt: np.ndarray, **kw):
    cfg = EngineConfig(model=model, backend="reference", check_plan=True, prefill=48,
                       embedding=embedding, **kw)
    with Engine.open(cfg) as eng:
        assert eng.backend is not None
        kind = eng.backend.input_kind
        logits, _ = eng.prefill(prompt, all_logits=True)
        steps = [eng.prefill(np.array([t]))[0] for t in (7, 299, 7)]  # decode steps
        plan = eng.driver.last_plan
    return kind, logits, steps, plan


@pytest.mark.parametrize("embd", ["Q4_K", "BF16"])
def test_the_reference_backend_gives_the_same_bytes_on_both_paths(rng, embd):
    """Token ids looked up at ChunkInput, or rows decoded by the engine before the chunk: the
    same logits, byte for byte, over several chunks and decode steps; the plans say which."""
    model = with_embedding(Qwen3Model.synthetic(TINY, 2, "fp16", dense_type="Q8_0"), embd,
                           rng)
    prompt = row_ids(rng, TINY.vocab, 100)
    dev = _reference(model, "device", prompt)
    host = _reference(model, "host", prompt)
    assert (dev[0], host[0]) == ("tokens", "hidden")
    assert dev[1].tobytes() == host[1].tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(dev[2], host[2]))
    assert _inputs(dev[3]) == [ChunkInput("tokens")] and _inputs(host[3]) == [ChunkInput()]


def test_ids_outside_the_vocabulary_are_refused_on_the_host(rng):
    """The engine refuses them before any chunk; a chunk given to the driver directly is
    refused by the executor's check, naming the id and its index in the chunk."""
    model = Qwen3Model.synthetic(TINY, 2, "fp16", dense_type="Q8_0")
    with Engine.open(EngineConfig(model=model, backend="reference")) as eng:
        with pytest.raises(ConfigError, match=r"token id 300 at index 2 is outside the "
                                              r"vocabulary 0..299"):
            eng.prefill(np.array([1, 2, 300]))
        assert eng.backend is not None and eng.backend.input_kind == "tokens"
        from strata_rt.report.stats import Stats

        with pytest.raises(ConfigError, match=r"token id -4 at index 1"):
            eng.driver.run_chunk(np.array([3, -4], np.int32), Stats(), 0, "last")
        logits, _ = eng.prefill(np.array([1, 2, 3]))  # the engine goes on
        assert np.isfinite(logits).all() and eng.kv_length == 3


# ---------------------------------------------------------------------------- CUDA, faked
class _Gemms:
    """Stands in for cuBLAS on the fake runtime."""

    version = (0, 0, 0)

    def __init__(self, workspace, workspace_bytes, owner=None):
        pass

    def gemm(self, *args):
        pass

    def destroy(self):
        pass


def _fake_engine(fake, monkeypatch, model: Qwen3Model, **kw) -> tuple[Engine, list]:
    """A whole model on the fake runtime; returns the engine and a log of its host-to-device
    copies (dst, bytes, dtype) made after open."""
    import strata_rt.backends.cuda.dense.kernels as dk
    import strata_rt.backends.cuda.executor as ex

    monkeypatch.setattr(dk, "Cublas", _Gemms)
    monkeypatch.setattr(ex, "host_device_pointer", lambda host: 1 << 40)
    eng = Engine.open(EngineConfig(model=model, backend="cuda", expert_cache=SPEC.n_experts,
                                   timing=False, check_plan=True, context=1024, prefill=256,
                                   **kw))
    htod: list = []
    for rt in fake["rts"]:
        rt.memcpy_htod = lambda dst, host, stream, log=htod: log.append(
            (dst, host.nbytes, host.dtype))
    for b in getattr(eng.backend, "backends", [eng.backend]):
        if b._whole is not None and b._whole.has_head:
            # no head launches: each Logits op leaves zeros
            monkeypatch.setattr(b._whole, "logits_op", lambda stream, op, T, w=b._whole: setattr(
                w, "logits", np.zeros((1 if op.rows == "last" else T, SPEC.vocab), np.float32)))
    return eng, htod


def _rows_launches(rt) -> list[tuple]:
    return [(name, args) for name, stream, args in rt.launched_on if name.startswith("ggml_rows_")
            and stream == "compute"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_cuda_executor_uploads_ids_and_gathers_their_rows(fake, monkeypatch, rng, tied,
                                                              fixed_walk_rule):
    """Each chunk uploads its T int32 ids (no float rows) and launches the row gather of the
    embedding's type from the embedding's region (a tied head's region when tied) into x,
    behind the input gate; the embedding went to the device once, at open."""
    model = Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", tied=tied, dense_type="Q8_0")
    if not tied:
        model = with_embedding(model, "Q4_K", rng)
    eng, htod = _fake_engine(fake, monkeypatch, model)
    with eng:
        rt, b = fake["rt"], eng.backend
        assert b.input_kind == "tokens"
        regions, ptr = b.memory.regions, b.dev.ptr
        embd = model.dense.token_embd
        assert regions["embd"] == (0 if tied else embd.nbytes)
        assert regions["token_ids"] == 256 * 4
        rt.tokens = 300
        rt.launched_on.clear()
        rt.launches.clear()
        eng.prefill(row_ids(rng, SPEC.vocab, 300))
        table = ptr["head" if tied else "embd"]
        row = SPEC.hidden // 32 * 34 if tied else SPEC.hidden // 256 * 144
        want = [(f"ggml_rows_{embd.type_name}",
                 (table, ptr["token_ids"], ptr["x"], T, SPEC.vocab, row, SPEC.hidden))
                for T in (256, 44)]
        assert _rows_launches(rt) == want
        uploads = [(dst, n, dt) for dst, n, dt in htod if dst in (ptr["x"], ptr["token_ids"])]
        assert uploads == [(ptr["token_ids"], 4 * T, np.int32) for T in (256, 44)]
        assert rt.launches.count("gate") == 2
        assert _inputs(eng.driver.last_plan) == [ChunkInput("tokens")]
        rt.tokens = 1
        for _ in range(3):  # a decode step: planned, then plain, then replayed (the rows
            eng.prefill(np.array([5]))  # gather captured with it)
        assert rt.launches[-1] == "graph"


def test_the_host_path_uploads_rows_and_holds_no_embedding(fake, monkeypatch, rng,
                                                           fixed_walk_rule):
    model = with_embedding(Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", dense_type="Q8_0"),
                           "Q4_K", rng)
    eng, htod = _fake_engine(fake, monkeypatch, model, embedding="host")
    with eng:
        rt, b = fake["rt"], eng.backend
        assert b.input_kind == "hidden" and b.memory.regions["embd"] == 0
        assert b.memory.regions["token_ids"] == 0
        rt.tokens = 100
        rt.launched_on.clear()
        eng.prefill(row_ids(rng, SPEC.vocab, 100))
        assert _rows_launches(rt) == []
        assert [n for dst, n, _ in htod if dst == b.dev.ptr["x"]] == [100 * SPEC.hidden * 4]
        assert _inputs(eng.driver.last_plan) == [ChunkInput()]


def test_an_embedding_without_a_gpu_decoder_is_looked_up_on_the_host(fake, monkeypatch, rng,
                                                                     fixed_walk_rule):
    """A type the GGML decoders do not read (TQ2_0 here) keeps the host path, on both
    backends alike (their plans stay the same)."""
    from gguf import GGMLQuantizationType

    base = Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", dense_type="Q8_0")
    q4 = block_tensor("token_embd.weight", (SPEC.vocab, SPEC.hidden), "Q4_K", rng)
    raw = np.zeros((SPEC.vocab, SPEC.hidden // 256 * 66), np.uint8)  # TQ2_0: 66 bytes / 256
    odd = replace(q4, type=GGMLQuantizationType.TQ2_0, data=raw)
    model = Qwen3Model(SPEC, replace(base.dense, token_embd=odd), base.moe)
    eng, _ = _fake_engine(fake, monkeypatch, model)
    with eng:
        assert eng.backend.input_kind == "hidden" and eng.backend.memory.regions["embd"] == 0
    with Engine.open(EngineConfig(model=model, backend="reference")) as ref:
        assert ref.backend.input_kind == "hidden"


def test_ids_outside_the_vocabulary_never_reach_the_fake_device(fake, monkeypatch, rng,
                                                                fixed_walk_rule):
    """The executor's check runs before anything is enqueued: no gate opened, no copy, no
    launch; the next chunk runs as usual."""
    from strata_rt.report.stats import Stats

    model = Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", dense_type="Q8_0")
    eng, htod = _fake_engine(fake, monkeypatch, model)
    with eng:
        rt, b = fake["rt"], eng.backend
        (gate,) = rt.gates
        opened, launched = gate.opened, len(rt.launched_on)
        for bad, what in (([4, 1000], "token id 1000 at index 1"),
                          ([-1], "token id -1 at index 0"),
                          (np.zeros((2, 2), np.int32), "1-D integer array"),
                          (np.ones(3, np.float32), "1-D integer array")):
            with pytest.raises(ConfigError, match=what):
                b.begin_chunk(np.asarray(bad), Stats(), 0)
        assert gate.opened == opened and len(rt.launched_on) == launched and not htod
        rt.tokens = 8
        eng.prefill(np.arange(8))
        assert gate.opened == opened + 1 and len(_rows_launches(rt)) == 1


def test_a_cuda_split_looks_ids_up_on_its_first_part(fake, monkeypatch, rng, fixed_walk_rule):
    """The first part holds the embedding (here tied: the head is on the last part, so the
    first holds its own copy) and gathers the rows; the last part receives the residual."""
    model = Qwen3Model.synthetic(SPEC, 3, "iq3_xxs", tied=True, dense_type="Q8_0")
    eng, htod = _fake_engine(fake, monkeypatch, model, devices=[0, 0], repeat_devices=True)
    with eng:
        rt = fake["rt"]
        first, second = eng.backend.backends
        assert (first.input_kind, second.input_kind) == ("tokens", "hidden")
        assert eng.backend.input_kind == "tokens"
        assert first.memory.regions["embd"] == model.dense.token_embd.nbytes
        assert second.memory.regions["embd"] == second.memory.regions["token_ids"] == 0
        rt.tokens = 100
        rt.launched_on.clear()
        eng.prefill(row_ids(rng, SPEC.vocab, 100))
        ((_, args),) = _rows_launches(rt)
        assert args[:3] == (first.dev.ptr["embd"], first.dev.ptr["token_ids"],
                            first.dev.ptr["x"])
