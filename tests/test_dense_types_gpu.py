"""The dense part in its GGUF types on the GPU (strata_rt/backends/cuda/dense/decode.py,
strata_rt/backends/cuda/whole.py): the fp16 Wqkv, Wo and head slices decoded on the device are,
byte for byte, the fp16 matrices the host uploaded before the weights kept their types; and a
whole model whose projections run as GEMMs (decode_dense gemm: every matrix decoded to fp16,
then one GEMM) gives the same logits and greedy tokens, byte for byte, as the same model with
those fp16 matrices stored as F16 (which the GEMMs read in place): resident and streamed, both
dense GEMMs, the head in one slice and in many. A decode step under decode_dense gemv (the
default) reads each matrix in its own type with that type's matrix-vector kernel, whose sums
run in the type's own order, so its logits are not the F16 twin's bytes; there the streamed
run is held to the resident run of the same model, byte for byte. The streamed layers' host
store is checked under both store_memory settings.

Run: python -m pytest -q -m gpu tests/test_dense_types_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from _dense_models import MATRICES, TYPES, as_fp16_model, dense_model, fp16_images, uniform

from strata_rt.backends.cuda.dense import decode as dense_decode
from strata_rt.backends.cuda.dense.decode import DenseDecode, head_slices
from strata_rt.backends.cuda.dense.slots import dense_slot_bytes
from strata_rt.engine import Engine
from strata_rt.models.qwen3 import Qwen3Spec
from strata_rt.models.qwen3.whole_memory import DenseLayout, DenseTypes

pytestmark = pytest.mark.gpu
POISON = 0xA5
SPEC = Qwen3Spec(n_layers=2, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab=768,
                 ffn=256, n_experts=16, top_k=4, context=2048)
#: a Q4_K_M file's layer kinds, and one of mixed plain types (F16 q/k/v read in place)
MIXED = [{**dict.fromkeys(MATRICES, "Q4_K"), "attn_v": "Q6_K"},
         {"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "Q8_0"}]


def _read(rt, stream, ptr: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    rt.memcpy_dtoh(out, ptr, stream)
    stream.synchronize()
    return out


@pytest.mark.parametrize("t", [*TYPES, "mixed"])
def test_decoded_scratch_is_the_host_fp16_image(rt, t, monkeypatch):
    model = dense_model(SPEC, 5, MIXED, "Q6_K") if t == "mixed" else uniform(SPEC, 5, t)
    lay = DenseLayout.of(SPEC, DenseTypes.of_model(model))
    H, V = SPEC.hidden, SPEC.vocab
    scratch_bytes = max(lay.scratch_bytes(SPEC), 256)
    head = np.ascontiguousarray(model.output_weight.data).view(np.uint8).reshape(-1)
    stream = rt.stream("test")
    bufs = [rt.alloc(n) for n in (lay.resident_bytes, head.size, scratch_bytes + 4096)]
    slots, head_dev, scratch = (b.ptr for b in bufs)
    try:
        for layer, slot in enumerate(lay.slots):
            rt.memcpy_htod(slots + lay.resident_offset(layer),
                           dense_slot_bytes(model, layer, slot), stream)
        rt.memcpy_htod(head_dev, head, stream)
        rt.memset_d8(scratch, POISON, scratch_bytes + 4096, stream)
        dec = DenseDecode(rt, SPEC, lay, scratch)
        for layer, slot in enumerate(lay.slots):
            want_qkv, want_o = fp16_images(model.dense.layers[layer])
            base = slots + lay.resident_offset(layer)
            at = dec.wqkv(stream, base, slot)
            assert (at == base) == slot.qkv_direct
            assert _read(rt, stream, at, want_qkv.nbytes).tobytes() == want_qkv.tobytes()
            at = dec.wo(stream, base, slot)
            assert (at == base + slot.o) == slot.o_direct
            assert _read(rt, stream, at, want_o.nbytes).tobytes() == want_o.tobytes()
        want_head = model.output_weight.f32().astype(np.float16)
        monkeypatch.setattr(dense_decode, "HEAD_SLICE_ROWS", 320)  # slices of 320, 320, 128
        slices = head_slices(V, lay.head_direct)
        assert len(slices) == (1 if lay.head_direct else 3)
        for v0, rows in slices:
            at = dec.head_slice(stream, head_dev, lay.head_type, v0, rows)
            got = _read(rt, stream, at, rows * H * 2)
            assert got.tobytes() == want_head[v0: v0 + rows].tobytes(), (v0, rows)
        tail = _read(rt, stream, scratch + scratch_bytes, 4096)
        assert (tail == POISON).all(), "decoded past the scratch"
    finally:
        for b in bufs:
            b.free()


def _run(model, **cfg) -> tuple[np.ndarray, list[int], np.ndarray]:
    """All-position logits of a 700-token prompt in chunks of 256, then 6 greedy tokens (the
    captured decode step) with their logits."""
    ids = np.random.default_rng(21).integers(0, SPEC.vocab, 700)
    with Engine.open({"model": model, "backend": "cuda", "expert_cache": 8, "prefill": 256,
                      **cfg}) as eng:
        prompt, _ = eng.prefill(ids, all_logits=True)
        tokens, steps = [], []
        last = prompt[-1]
        for _ in range(6):
            tokens.append(int(np.argmax(last)))
            last, _ = eng.prefill(np.array([tokens[-1]]))
            steps.append(np.array(last, np.float32).reshape(-1))
    return prompt, tokens, np.stack(steps)


def _same(a: tuple, b: tuple) -> None:
    assert a[0].tobytes() == b[0].tobytes(), "prompt logits differ"
    assert a[1] == b[1], "greedy tokens differ"
    assert a[2].tobytes() == b[2].tobytes(), "decode-step logits differ"


@pytest.mark.parametrize("t", ["Q8_0", "Q4_K", "Q6_K", "BF16", "mixed"])
@pytest.mark.parametrize("gemm", ["cublas", "own"])
def test_engine_bytes_equal_the_fp16_weights(t, gemm, monkeypatch):
    monkeypatch.setenv("STRATA_DENSE_GEMM", gemm)
    monkeypatch.setenv("STRATA_DECODE_DENSE", "gemm")
    model = dense_model(SPEC, 6, MIXED, "Q6_K") if t == "mixed" else uniform(SPEC, 6, t)
    want = _run(as_fp16_model(model))
    got = _run(model)
    assert np.isfinite(got[0]).all()
    _same(got, want)


def test_streamed_dense_and_a_head_in_many_slices(monkeypatch):
    """Streamed slots copy each layer's own bytes into the ring; a head of several slices (the
    own GEMM sums each output in one order whatever the slice) gives the one-GEMM bytes."""
    monkeypatch.setenv("STRATA_DENSE_GEMM", "own")
    monkeypatch.setenv("STRATA_DECODE_DENSE", "gemm")
    model = dense_model(SPEC, 7, MIXED, "Q4_K")
    want = _run(as_fp16_model(model))
    _same(_run(model, dense="stream"), want)
    monkeypatch.setattr(dense_decode, "HEAD_SLICE_ROWS", 256)
    _same(_run(model), want)


def test_gemv_decode_steps_streamed_equal_resident(monkeypatch):
    """Under decode_dense gemv each decode step reads the ring slot's matrices in their types
    with the kernels the resident slots use: the streamed run is the resident run, byte for
    byte (its fp16 twin differs in the last bits, as each type sums in its own order)."""
    monkeypatch.setenv("STRATA_DENSE_GEMM", "own")
    monkeypatch.setenv("STRATA_DECODE_DENSE", "gemv")
    model = dense_model(SPEC, 7, MIXED, "Q4_K")
    _same(_run(model, dense="stream"), _run(model))
    twin = as_fp16_model(model)
    _same(_run(twin, dense="stream"), _run(twin))


@pytest.mark.parametrize("store_memory", ["alloc", "register"])
def test_streamed_dense_bytes_whatever_store_memory(store_memory, monkeypatch):
    """The streamed layers' host store page-locked either way (store_memory: one
    cuMemHostAlloc, or filled then registered): each layer's copies bring the bytes of the
    resident run, so the logits and tokens are the resident run's, byte for byte."""
    monkeypatch.setenv("STRATA_DENSE_GEMM", "own")
    model = dense_model(SPEC, 8, MIXED, "Q4_K")
    want = _run(model, store_memory=store_memory)
    _same(_run(model, dense="stream", store_memory=store_memory), want)
