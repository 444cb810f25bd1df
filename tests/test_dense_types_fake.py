"""The dense part in its GGUF types on the CUDA backend, without a GPU: through the recording
fake runtime (tests/_fake_runtime.py), every Attention decodes exactly the matrices not stored
as F16 (q, k, v rows into one Wqkv scratch, then Wo) on the compute stream before the GEMM that
reads them, an F16 matrix is read in place, streamed layers copy their own bytes, and the head
is decoded slice by slice before each slice's GEMM. The bytes: tests/test_dense_types_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from _dense_models import MATRICES, dense_model

from strata_rt.backends.cuda.dense import decode as dense_decode
from strata_rt.engine import Engine, EngineConfig
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.models.qwen3 import Qwen3Spec
from strata_rt.models.qwen3.whole_memory import DenseLayout, DenseTypes
from strata_rt.weights.model import SMALL_SPEC

SPEC = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                 n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                 n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
#: q4_k layers with a Q6_K v, and a layer whose q, k, v are F16 (read in place) and o Q8_0
KINDS = [{**dict.fromkeys(MATRICES, "Q4_K"), "attn_v": "Q6_K"},
         {"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "Q8_0"}]


class _Gemms:
    """Stands in for cuBLAS on the fake runtime: logs each GEMM into the launch log."""

    version = (0, 0, 0)
    rt = None

    def __init__(self, workspace, workspace_bytes, owner=None):
        pass

    def gemm(self, stream, x, w, out, rows, n_out, k, out_f32, accumulate):
        assert self.rt is not None
        self.rt.launched_on.append(("gemm", stream.name, (x, w, out, rows, n_out, k)))

    def destroy(self):
        pass


def _open(fake, monkeypatch, model, **kw) -> Engine:
    import strata_rt.backends.cuda.dense.kernels as dk

    monkeypatch.setattr(dk, "Cublas", _Gemms)
    eng = Engine.open(EngineConfig(model=model, backend="cuda", expert_cache=SPEC.n_experts,
                                   timing=False, context=2048, prefill=512, **kw))
    _Gemms.rt = fake["rt"]
    return eng


def _ours(rt) -> list[tuple[str, str, tuple]]:
    return [c for c in rt.launched_on if c[0] == "gemm" or c[0].startswith("ggml_gather_")]


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_attention_decodes_what_is_not_f16_before_its_gemm(fake, monkeypatch, dense,
                                                           fixed_walk_rule):
    model = dense_model(SPEC, 3, KINDS, "Q6_K", fmt="iq3_xxs")
    lay = DenseLayout.of(SPEC, DenseTypes.of_model(model))
    with _open(fake, monkeypatch, model, dense=dense) as eng:
        rt = fake["rt"]
        base, scratch = rt.region("dense"), rt.region("dense_scratch")
        copies0 = rt.copies
        rt.tokens = 300
        rt.launched_on.clear()
        eng.prefill(np.arange(300) % SPEC.vocab)
        calls = _ours(rt)
        H, q, kv = SPEC.hidden, SPEC.q_dim, SPEC.kv_dim
        assert all(c[1] == "compute" for c in calls)
        for layer, slot in enumerate(lay.slots):
            at = (lay.resident_offset(layer) if dense == "resident"
                  else (layer % 2) * lay.slot_bytes)
            b = base + at
            if layer % 2 == 0:
                want = [("ggml_gather_Q4_K", b + slot.q, scratch, q * H),
                        ("ggml_gather_Q4_K", b + slot.k, scratch + q * H * 2, kv * H),
                        ("ggml_gather_Q6_K", b + slot.v, scratch + (q + kv) * H * 2, kv * H),
                        ("gemm", scratch, q + 2 * kv),
                        ("ggml_gather_Q4_K", b + slot.o, scratch, H * q), ("gemm", scratch, H)]
            else:  # q, k, v F16: the GEMM reads the slot
                want = [("gemm", b + slot.q, q + 2 * kv),
                        ("ggml_gather_Q8_0", b + slot.o, scratch, H * q), ("gemm", scratch, H)]
            got = []
            for _ in want:
                name, _, args = calls.pop(0)
                if name == "gemm":
                    got.append(("gemm", args[1], args[4]))
                else:  # 16 sources, dst, image bytes, values, first_pos, bounds, first_expert
                    assert args[1:MMQ_GROUP] == (0,) * (MMQ_GROUP - 1)
                    got.append((name, args[0], args[MMQ_GROUP], args[MMQ_GROUP + 2]))
            assert got == want, layer
        # the head: one slice of the vocabulary, decoded before its GEMM
        assert [(c[0], c[2][0] if c[0] != "gemm" else c[2][1]) for c in calls] == [
            ("ggml_gather_Q6_K", rt.region("head")), ("gemm", scratch)]
        if dense == "stream":  # the chunk copies each layer's own bytes into the ring
            assert rt.copies - copies0 >= SPEC.n_layers


def test_head_in_slices_decoded_before_each_gemm(fake, monkeypatch, fixed_walk_rule):
    """All-position logits: per row slice of LOGIT_ROWS, each head slice is decoded into the
    scratch and multiplied into its own block of the head's output; one slice holding the
    vocabulary is decoded once per call."""
    model = dense_model(SPEC, 4, KINDS, "Q8_0", fmt="iq3_xxs")
    monkeypatch.setattr(dense_decode, "HEAD_SLICE_ROWS", 384)  # 384 + 384 + 232 rows
    with _open(fake, monkeypatch, model) as eng:
        rt = fake["rt"]
        head, scratch, out = (rt.region(n) for n in ("head", "dense_scratch", "head_out"))
        row = SPEC.hidden // 32 * 34
        rt.tokens = 100
        rt.launched_on.clear()
        logits, _ = eng.prefill(np.arange(100) % SPEC.vocab, all_logits=True)
        assert logits.shape == (100, SPEC.vocab)
        calls = [c for c in _ours(rt) if c[0] != "gemm" or c[2][4] not in (
            SPEC.q_dim + 2 * SPEC.kv_dim, SPEC.hidden)]
        calls = [c for c in calls if c[0] in ("gemm", "ggml_gather_Q8_0")]
        calls = [c for c in calls if c[0] == "gemm" or c[2][0] >= head]
        want = []
        for n in (64, 36):
            for v0, rows in ((0, 384), (384, 384), (768, 232)):
                want += [("gather", head + v0 * row, rows * SPEC.hidden),
                         ("gemm", scratch, out + v0 * n * 4, n, rows)]
        got = [("gather", a[0], a[MMQ_GROUP + 2]) if name != "gemm" else
               ("gemm", a[1], a[2], a[3], a[4]) for name, _, a in calls]
        assert got == want
