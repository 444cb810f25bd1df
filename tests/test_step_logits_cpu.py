"""A whole model's chunk on the CUDA backend, through the recording fake runtime: its Logits op
enqueues the head and the copy of the logits without waiting, ahead of the routing's readback,
so a decode step waits on the host twice (the routing, then the chunk's end, which finds the
stream idle) and no longer three times; the logits the engine returns are the pinned bytes the
copy left, read after that wait. The same path on a GPU: tests/test_decode_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from _fake_runtime import FakeStream

import strata_rt.backends.cuda.dense.kernels as dk
from strata_rt.engine import Engine, EngineConfig
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.plan_keys import DECODE_KEY, GEMV_DECODE_KEY
from strata_rt.weights.model import SMALL_SPEC


class _Cublas:
    version = (0, 0, 0)

    def __init__(self, workspace, workspace_bytes, owner=None):
        pass

    def gemm(self, stream, x, w, out, rows, n_out, k, out_f32, accumulate):
        pass

    def destroy(self):
        pass


def _log_host_waits(monkeypatch: pytest.MonkeyPatch, rt, vocab: int) -> list[tuple]:
    """Every device-to-host copy (its dtype) and every stream wait, in host order; a copy of
    logits (float32, a multiple of vocab) writes 1000 + its index, so the rows are known."""
    events: list[tuple] = []
    copy = rt.memcpy_dtoh

    def dtoh(host, src, stream):
        copy(host, src, stream)
        if host.dtype == np.float32 and host.size % vocab == 0:
            host[:] = 1000 + np.arange(host.size, dtype=np.float32)
            events.append(("logits", stream.name))
        else:
            events.append((host.dtype.name, stream.name))

    monkeypatch.setattr(rt, "memcpy_dtoh", dtoh)
    monkeypatch.setattr(FakeStream, "synchronize",
                        lambda self: events.append(("wait", self.name)))
    return events


def _engine(monkeypatch: pytest.MonkeyPatch, **kw) -> tuple[Engine, Qwen3Spec]:
    """A small whole model on the fake runtime, every expert resident."""
    monkeypatch.setattr(dk, "Cublas", _Cublas)
    spec = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                     n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                     n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
    whole = Qwen3Model.synthetic(spec, 3, "iq3_xxs")
    cfg = EngineConfig(model=whole, backend="cuda", expert_cache=spec.n_experts * spec.n_layers,
                       check_plan=True, timing=False, context=512, **kw)
    return Engine.open(cfg), spec


@pytest.mark.parametrize("decode", ["routed", "gemv"])
def test_a_decode_step_reads_its_logits_after_its_routing_wait(fake, monkeypatch, decode):
    eng, spec = _engine(monkeypatch, prefill=64, decode=decode)
    with eng:
        rt = fake["rt"]
        rt.tokens = 5
        eng.prefill(np.arange(5) % spec.vocab)
        events = _log_host_waits(monkeypatch, rt, spec.vocab)
        for step in range(3):  # the plain launches, the captured replay, a later replay
            rt.tokens = 1
            del events[:]
            logits, _ = eng.prefill(np.array([7 + step]))
            # the one row's logits, as the pinned buffer held them once the chunk was waited for
            np.testing.assert_array_equal(logits, 1000 + np.arange(spec.vocab, dtype=np.float32))
            first = events.index(("logits", "compute"))
            after = [i for i, e in enumerate(events) if e[0] == "wait" and i > first]
            # the head's copy is enqueued before the routing comes back, and then the host
            # waits twice: for the routing, and at the chunk's end (the graph trials of the
            # first two steps wait before the head as well, to time the layers)
            assert first < events.index(("int32", "compute")) < after[0], (step, events)
            assert len(after) == 2, (step, events)
            assert eng.kv_length == 6 + step
        assert eng.driver.graph_trials[eng.driver.decode_key].get("choice") is not None
        # the key is worked out once per decode setting, and follows the setting per step
        other = "routed" if decode == "gemv" else "gemv"
        keys = {decode: eng.driver.decode_key}
        eng.config.decode = other
        keys[other] = eng.driver.decode_key
        assert keys["gemv"] == GEMV_DECODE_KEY and keys["routed"] == DECODE_KEY


def test_all_rows_still_wait_block_by_block(fake, monkeypatch):
    """More rows than one block of the head (all_logits over 70 tokens: LOGIT_ROWS = 64) keep
    run_logits' wait per block; every row comes back."""
    eng, spec = _engine(monkeypatch, prefill=128)
    with eng:
        rt = fake["rt"]
        rt.tokens = 70
        events = _log_host_waits(monkeypatch, rt, spec.vocab)
        logits, _ = eng.prefill(np.arange(70) % spec.vocab, all_logits=True)
        assert logits.shape == (70, spec.vocab)
        blocks = [i for i, e in enumerate(events) if e[0] == "logits"]
        assert len(blocks) == 2 and all(events[i + 1][0] == "wait" for i in blocks)
