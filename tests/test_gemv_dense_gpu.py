"""A decode step's dense projections and head as matrix-vector launches that read each weight in
its own type (GgmlGemv.dense; kernels/ggml/gemv.cuh's gemv_dense), on the GPU: every mode
against a float64 product of the gguf package's values rounded to fp16 on fresh random blocks,
outputs poisoned first (nothing past the rows written); then whole models decoding with
decode_dense "gemv" against "gemm": the prompt's logits the same bytes (a prefill chunk takes
the GEMMs either way), the same greedy tokens, every step's logits within NMSE 1e-4.

Run: python -m pytest -q -m gpu tests/test_gemv_dense_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from _dense_models import dense_model
from _device_buffers import download, poisoned, upload
from _ggml_blocks import moderate_blocks

from strata_rt.engine import Engine
from strata_rt.formats.ggml_types import ggml_type
from strata_rt.formats.numerics import nmse
from strata_rt.gemm.ggml_decoders import DecoderSpec
from strata_rt.gemm.ggml_gather import images_reference
from strata_rt.gemm.ggml_gemv import GgmlGemv
from strata_rt.models.qwen3 import Qwen3Spec

pytestmark = pytest.mark.gpu
#: types of the dense weights of downloaded files, and the float ones
TYPES = ("F16", "BF16", "F32", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_XXS")
#: rows not a multiple of a tile's 16, K in whole blocks of every type
ROWS, K = 83, 512
#: float32 outputs against the float64 product: NMSE
F32_NMSE = 1e-10
#: whole-model decode, gemv against gemm
LOGITS_NMSE = 1e-4
SPEC = Qwen3Spec(n_layers=3, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab=700,
                 n_experts=32, top_k=4, ffn=256)


@pytest.mark.parametrize("name", TYPES)
def test_dense_gemv_matches_the_float64_product(rt, rng, name) -> None:
    d = DecoderSpec.of(ggml_type(name))
    raw = moderate_blocks(rng, d, ROWS * K // d.block_values).reshape(-1)
    w16 = images_reference(d.name, raw, ROWS, K).astype(np.float64)
    x = (rng.standard_normal(K) / np.sqrt(K)).astype(np.float16)
    want = w16 @ x.astype(np.float64)
    base = rng.standard_normal(ROWS).astype(np.float32)
    g = GgmlGemv(rt)
    s = rt.stream("dense gemv test")
    bufs = [upload(rt, s, raw), upload(rt, s, x)]
    d_w, d_x = bufs[0].ptr, bufs[1].ptr
    got = {}
    try:
        for mode, dtype in (("f16", np.float16), ("f32", np.float32)):
            out = poisoned(rt, s, ROWS * np.dtype(dtype).itemsize)
            bufs.append(out)
            g.dense(s, name, d_w, d_x, out.ptr, ROWS, K, mode)
            got[mode] = download(rt, s, out, dtype, (ROWS,))
        acc = upload(rt, s, base)
        bufs.append(acc)
        g.dense(s, name, d_w, d_x, acc.ptr, ROWS, K, "add_f32")
        got["add_f32"] = download(rt, s, acc, np.float32, (ROWS,), check_tail=False)
    finally:
        for b in bufs:
            b.free()
    assert nmse(got["f32"], want) <= F32_NMSE, name
    f16 = got["f16"].astype(np.float64)
    assert np.all(np.abs(f16 - want) <= np.spacing(np.abs(want).astype(np.float16))
                  .astype(np.float64) + 1e-6 * np.abs(want).max()), name
    assert np.array_equal(got["add_f32"], base + got["f32"]), name  # one float32 rounding


def _greedy(model, dense: str, monkeypatch, steps: int = 8):
    monkeypatch.setenv("STRATA_DECODE_DENSE", dense)
    ids = np.random.default_rng(8).integers(0, SPEC.vocab, 45)
    with Engine.open({"model": model, "backend": "cuda", "prefill": 256}) as eng:
        logits, _ = eng.prefill(ids)
        out = [logits]
        for _ in range(steps):
            logits, _ = eng.prefill(np.array([int(logits.argmax())]))
            out.append(logits)
        trial = eng.driver.graph_trials.get(eng.driver.decode_key, {})
    return out, trial


@pytest.mark.parametrize("types,head", [
    ({"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "F16"}, "F16"),
    ({"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q6_K", "attn_output": "Q8_0"}, "Q6_K"),
])
def test_gemv_dense_decode_follows_the_gemms(monkeypatch, types, head) -> None:
    model = dense_model(SPEC, 31, [types], head, fmt="iq3_xxs")
    gemv, trial = _greedy(model, "gemv", monkeypatch)
    assert "plain" in trial and "graph" in trial and "error" not in trial, trial
    gemm, _ = _greedy(model, "gemm", monkeypatch)
    assert np.array_equal(gemv[0], gemm[0])
    assert [int(x.argmax()) for x in gemv] == [int(x.argmax()) for x in gemm]
    errs = [nmse(a, b) for a, b in zip(gemv[1:], gemm[1:])]
    print(f"{head}: logits NMSE gemv vs gemm per step {[f'{e:.2g}' for e in errs]}")
    assert max(errs) <= LOGITS_NMSE, errs
    assert max(errs) > 0  # the steps did take the matrix-vector kernels


@pytest.mark.parametrize("rows, k, shift", [(83, 2048, 0), (37, 4096, 0), (5, 2056, 0),
                                            (64, 24, 0), (83, 2048, 2)])
def test_f16_rows_kernel_every_mode(rt, rng, rows, k, shift) -> None:
    """F16 weights on 16 bytes take the warp-per-row kernel (shift 0: row lengths with and
    without a whole unrolled run of loads), two bytes off them the tiled one (shift 2): both
    within F32_NMSE of the float64 product, every mode, outputs poisoned first."""
    w16 = (rng.standard_normal((rows, k)) / 4).astype(np.float16)
    x = (rng.standard_normal(k) / np.sqrt(k)).astype(np.float16)
    want = w16.astype(np.float64) @ x.astype(np.float64)
    base = rng.standard_normal(rows).astype(np.float32)
    g = GgmlGemv(rt)
    s = rt.stream("f16 rows test")
    raw = np.zeros(w16.nbytes + 16, np.uint8)
    raw[shift: shift + w16.nbytes] = w16.view(np.uint8).reshape(-1)
    bufs = [upload(rt, s, raw), upload(rt, s, x)]
    d_w, d_x = bufs[0].ptr + shift, bufs[1].ptr
    try:
        for mode, dtype in (("f16", np.float16), ("f32", np.float32)):
            out = poisoned(rt, s, rows * np.dtype(dtype).itemsize)
            bufs.append(out)
            g.dense(s, "F16", d_w, d_x, out.ptr, rows, k, mode)
            got = download(rt, s, out, dtype, (rows,)).astype(np.float64)
            if mode == "f32":
                assert nmse(got, want) < F32_NMSE, (mode, nmse(got, want))
            else:
                np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float64),
                                           rtol=2e-3, atol=1e-4)
        acc = upload(rt, s, base)
        bufs.append(acc)
        g.dense(s, "F16", d_w, d_x, acc.ptr, rows, k, "add_f32")
        added = download(rt, s, acc, np.float32, (rows,), check_tail=False).astype(np.float64)
        assert nmse(added, base + want) < F32_NMSE
        # the same launch twice gives the same bytes (a fixed order of the sums)
        out1, out2 = poisoned(rt, s, rows * 4), poisoned(rt, s, rows * 4)
        bufs += [out1, out2]
        for o in (out1, out2):
            g.dense(s, "F16", d_w, d_x, o.ptr, rows, k, "f32")
        assert np.array_equal(download(rt, s, out1, np.uint32, (rows,)),
                              download(rt, s, out2, np.uint32, (rows,)))
    finally:
        for b in bufs:
            b.free()
