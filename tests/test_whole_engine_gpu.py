"""A whole Qwen3-MoE model on the CUDA backend: logits against transformers' golden logits and
against the reference engine, the same bytes on every run and in both gather modes, the KV cache
across calls, and the hazard checker on the plans."""

from __future__ import annotations

import numpy as np
import pytest
from test_qwen3_reference import FIXTURES, GOLDEN, build_case

from strata_rt.engine import Engine, read_dump
from strata_rt.formats.numerics import nmse
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf

pytestmark = pytest.mark.gpu

#: the GPU against transformers / the reference engine (fp16 activations, fp32 accumulation)
GPU_NMSE = 1e-4
#: two heads layouts: the tiny golden one and Qwen3-30B's head geometry on few layers
SMALL = Qwen3Spec(n_layers=2, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab=700,
                  ffn=256, n_experts=16, top_k=4, context=4096)
WIDE = Qwen3Spec(n_layers=2, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128, vocab=3000,
                 ffn=768, n_experts=16, top_k=4, context=4096)


def _open(model, backend="cuda", **kw) -> Engine:
    return Engine.open({"model": model, "backend": backend, "expert_cache": 4, **kw})


def _agree(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    return nmse(got, want), float((got.argmax(-1) == want.argmax(-1)).mean())


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_gpu_logits_match_transformers(name, tmp_path):
    case = GOLDEN["cases"][name]
    path = write_qwen3_gguf(tmp_path / f"{name}.gguf", build_case(case))
    ids = np.load(FIXTURES / f"{name}.ids.npy")
    want = np.load(FIXTURES / f"{name}.logits.npy")
    with _open({"gguf": str(path), "format": case["format"]}, prefill=16) as eng:
        got, _ = eng.prefill(ids, all_logits=True)
    err, same = _agree(got, want)
    assert err <= GPU_NMSE and same >= 0.999, (name, err, same)


@pytest.mark.parametrize("spec", [SMALL, WIDE], ids=["small", "wide"])
@pytest.mark.parametrize("fmt", ["fp16", "iq3_xxs"])
def test_gpu_engine_tracks_the_reference_engine(spec, fmt):
    """1,100 tokens in chunks of 512 (staging for the first token, walks after) against the
    reference engine. A token whose router logits nearly tie may pick another expert on the GPU
    (fp16 router operands against float32) and then differs by far more than rounding (measured:
    1 of 1,100 positions at NMSE 2.6e-2, the next worst 2e-5), so the bound is on the bulk: the
    median position within 1e-5, 99% of them within GPU_NMSE, the same argmax at >= 99%."""
    model = Qwen3Model.synthetic(spec, 11, fmt)
    ids = np.random.default_rng(5).integers(0, spec.vocab, 1100)
    with _open(model, "reference", prefill=512) as ref:
        want0, _ = ref.prefill(ids[:1], all_logits=True)
        want1, _ = ref.prefill(ids[1:], all_logits=True)
    with _open(model, prefill=512) as eng:
        got0, _ = eng.prefill(ids[:1], all_logits=True)
        got1, st = eng.prefill(ids[1:], all_logits=True)
        assert eng.kv_length == 1100 and st.chunks == 3
    got, want = np.concatenate([got0, got1]), np.concatenate([want0, want1])
    per = np.array([nmse(got[t], want[t]) for t in range(len(ids))])
    same = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert np.median(per) <= 1e-5 and np.quantile(per, 0.99) <= GPU_NMSE and same >= 0.99, (
        np.quantile(per, [0.5, 0.99, 1.0]), same)


def test_gpu_same_bytes_every_run_and_both_gather_modes(tmp_path, monkeypatch):
    """The default kernels are deterministic: the residual dump and the logits are the same
    bytes on a repeat and with one gather launch per expert instead of per group."""
    model = Qwen3Model.synthetic(SMALL, 12, "iq3_xxs")
    ids = np.random.default_rng(6).integers(0, SMALL.vocab, 700)
    results = []
    for gather_one in ("0", "1", "0"):
        monkeypatch.setenv("STRATA_PREFILL_GATHER_ONE", gather_one)
        dump = tmp_path / f"r{len(results)}.bin"
        with _open(model, prefill=256, dump_r=str(dump)) as eng:
            logits, _ = eng.prefill(ids, all_logits=True)
        results.append((logits, dump.read_bytes()))
    for logits, dump in results[1:]:
        assert np.array_equal(logits, results[0][0])
        assert dump == results[0][1]
    pos, h = read_dump(tmp_path / "r0.bin", SMALL.hidden)
    assert list(pos) == list(range(0, 700, 64)) and np.isfinite(h).all()


def test_gpu_chunking_and_cache_reuse():
    """A prompt in one chunk, in chunks of 300, and split over calls: logits within a tight
    bound (cuBLAS may sum in another order for another row count)."""
    model = Qwen3Model.synthetic(SMALL, 13, "fp16")
    ids = np.random.default_rng(7).integers(0, SMALL.vocab, 1030)
    with _open(model, prefill=1030) as eng:
        one, _ = eng.prefill(ids, all_logits=True)
    with _open(model, prefill=300) as eng:
        chunked, _ = eng.prefill(ids, all_logits=True)
        eng.reset()
        a, _ = eng.prefill(ids[:517], all_logits=True)
        b, _ = eng.prefill(ids[517:], all_logits=True)
    for other in (chunked, np.concatenate([a, b])):
        err, same = _agree(other, one)
        assert err <= 1e-6 and same >= 0.999, (err, same)


def test_gpu_chunking_is_byte_exact_with_the_own_dense_gemm(monkeypatch):
    """STRATA_DENSE_GEMM=own: every kernel's bytes for a row are independent of the rows that
    came with it (attention per query, the grouped GEMMs, norms, routing per token), so a
    prompt gives the same logits in one chunk, in chunks of 300, and split over calls. The
    split's one-token chunk takes the same GEMMs (decode_dense gemm) and the same grouped
    expert products (decode routed): the defaults' matrix-vector kernels sum in another
    order, within NMSE 1e-4 (tests/test_gemv_dense_gpu.py, tests/test_decode_gpu.py)."""
    monkeypatch.setenv("STRATA_DENSE_GEMM", "own")
    monkeypatch.setenv("STRATA_DECODE_DENSE", "gemm")
    monkeypatch.setenv("STRATA_DECODE", "routed")
    spec = Qwen3Spec(**{**SMALL.__dict__, "vocab": 768})  # the own GEMM takes n % 128 == 0
    model = Qwen3Model.synthetic(spec, 15, "iq3_xxs")
    ids = np.random.default_rng(9).integers(0, spec.vocab, 1030)
    with _open(model, prefill=1030) as eng:
        one, _ = eng.prefill(ids, all_logits=True)
    with _open(model, prefill=300) as eng:
        chunked, _ = eng.prefill(ids, all_logits=True)
        eng.reset()
        parts = [eng.prefill(ids[a:b], all_logits=True)[0]
                 for a, b in [(0, 1), (1, 517), (517, 1030)]]
    assert np.array_equal(chunked, one)
    assert np.array_equal(np.concatenate(parts), one)


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_gpu_check_plan_and_timing_table(monkeypatch, dense):
    """STRATA_CHECK_PLAN=1 accepts every plan (dense weights resident or streamed), the
    streamed run gives the resident run's bytes, and the timing table names the new phases."""
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    model = Qwen3Model.synthetic(SMALL, 14, "iq3_xxs")
    ids = np.random.default_rng(8).integers(0, SMALL.vocab, 600)
    with _open(model, prefill=256) as eng:
        want, _ = eng.prefill(ids, all_logits=True)
    monkeypatch.setenv("STRATA_PREFILL_TIMING", "1")
    with _open(model, prefill=256, dense=dense) as eng:
        assert eng.backend.dense_ring == (2 if dense == "stream" else None)
        a, _ = eng.prefill(ids[:2], all_logits=True)
        b, st = eng.prefill(ids[2:], all_logits=True)
    assert np.array_equal(np.concatenate([a, b]), want)
    assert st.phase_table is not None
    for phase in ("dense qkv", "qk norm+rope", "attention", "dense o", "logits"):
        assert phase in st.phase_table, phase
