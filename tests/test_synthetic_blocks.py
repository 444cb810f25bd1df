"""Large synthetic dense tensors are drawn in row blocks on the host threads: the values
depend on the seed, the tensor and the block, never on the threads; small tensors keep the
one sequential stream (the tiny models' goldens hold them to it)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.host import host_copy
from strata_rt.models.qwen3 import weights
from strata_rt.models.qwen3.spec import Qwen3Spec
from strata_rt.models.qwen3.weights import Qwen3Model, normal_blocks

SPEC = Qwen3Spec(n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                 ffn=128, n_experts=4, top_k=2)


@pytest.mark.parametrize("threads", [1, 3])
def test_blocks_do_not_depend_on_the_threads(monkeypatch, threads):
    monkeypatch.setattr(weights, "DRAWN_IN_BLOCKS", 4 * 64)  # blocks of 1 row of 64
    want = np.concatenate([np.random.default_rng([7, 1, b]).standard_normal((1, 64), np.float32)
                           * np.float32(0.5) for b in range(10)])
    monkeypatch.setattr(host_copy, "_workers", lambda: threads)
    monkeypatch.setattr(host_copy, "PARALLEL_MIN_BYTES", 0)
    got = normal_blocks((10, 64), 0.5, (7, 1), np.float32)
    assert got.tobytes() == want.tobytes()
    half = normal_blocks((10, 64), 0.5, (7, 1), np.float16)
    assert half.tobytes() == want.astype(np.float16).tobytes()


@pytest.mark.parametrize("dense_type", ["F16", "F32", "Q8_0"])
def test_a_model_with_large_tensors_draws_them_in_blocks(monkeypatch, dense_type):
    small = Qwen3Model.synthetic(SPEC, 3, dense_type=dense_type)
    monkeypatch.setattr(weights, "DRAWN_IN_BLOCKS", 128 * 128)  # q, o, embedding, head
    big = Qwen3Model.synthetic(SPEC, 3, dense_type=dense_type)
    again = Qwen3Model.synthetic(SPEC, 3, dense_type=dense_type)
    d, s, a = big.dense, small.dense, again.dense
    # seeded: the same model twice
    for name in ("token_embd", "output"):
        assert getattr(d, name).data.tobytes() == getattr(a, name).data.tobytes()
    q = d.layers[0].attn_q
    assert q.type.name == dense_type and q.shape == s.layers[0].attn_q.shape
    assert q.data.tobytes() != s.layers[0].attn_q.data.tobytes()
    # the first large tensor drawn (the embedding) is block-drawn N(0, hidden^-1/2)
    e = d.token_embd.f32()
    assert abs(float(e.std()) - SPEC.hidden ** -0.25) < 0.02 and abs(float(e.mean())) < 0.01
    if dense_type != "Q8_0":
        want = normal_blocks(d.token_embd.shape, SPEC.hidden ** -0.25, (3, 0x51E3, 0),
                             np.float16 if dense_type == "F16" else np.float32)
        assert d.token_embd.data.tobytes() == want.tobytes()
