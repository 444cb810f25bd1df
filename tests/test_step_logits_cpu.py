"""A whole model's chunk on the CUDA backend, through the recording fake runtime: its Logits op
enqueues the head and the copy of the logits without waiting, ahead of the routing's readback,
whose counts are read at the chunk's end, so a decode step waits on the host once (for the
logits, the routing and the output together); the logits the engine returns are the pinned
bytes the copy left, read after that wait. The same path on a GPU: tests/test_decode_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from _fake_runtime import FakeKernel, FakeModule, FakeStream, NullCublas

import strata_rt.backends.cuda.dense.kernels as dk
import strata_rt.backends.cuda.executor as cuda_executor
from strata_rt.backends.nonfinite import NonFiniteError
from strata_rt.engine import Engine, EngineConfig
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.plan_keys import DECODE_KEY, GEMV_DECODE_KEY
from strata_rt.text.generate import generate
from strata_rt.text.sampling import SamplingParams
from strata_rt.weights.model import SMALL_SPEC


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
    monkeypatch.setattr(dk, "Cublas", NullCublas)
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
            # the head's copy is enqueued before the routing's, and then the host waits once,
            # at the chunk's end (the graph trials of the first two steps wait before the
            # head as well, to time the layers)
            assert first < events.index(("int32", "compute")) < after[0], (step, events)
            assert len(after) == 1, (step, events)
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


def _device_keys(monkeypatch: pytest.MonkeyPatch, rt, token: int, flag: int = 0,
                 events: list | None = None) -> None:
    """The argmax result's copy (uint64 [2]) leaves the key of `token` (the value key of 1.0
    above the id's complement) and `flag`, as logits_argmax would; logged in `events`."""
    copy = rt.memcpy_dtoh

    def dtoh(host, src, stream):
        copy(host, src, stream)
        if host.dtype == np.uint64 and host.size == 2:
            host[0] = (0xBF800000 << 32) | (0xFFFFFFFF - token)
            host[1] = flag
            if events is not None:
                events.append(("argmax", stream.name))

    monkeypatch.setattr(rt, "memcpy_dtoh", dtoh)


@pytest.mark.parametrize("decode", ["routed", "gemv"])
def test_a_greedy_step_brings_back_its_token_alone(fake, monkeypatch, decode):
    """prefill_argmax: the head's row stays on the device (no copy of vocab floats), the
    argmax kernel's 16 bytes come back with the chunk's one wait, the id is what they name."""
    opened: list[str] = []
    monkeypatch.setattr(FakeModule, "kernel", lambda self, name, types, overlap=False: (
        opened.append(name), FakeKernel(self.rt, name, types))[1])
    eng, spec = _engine(monkeypatch, prefill=64, decode=decode, decode_argmax="device")
    assert "logits_argmax" in opened  # loaded at open: the first step does not wait for it
    with eng:
        rt = fake["rt"]
        # its 16 bytes are a region of the engine's arena, which the memory plan counts
        assert len(rt.arenas) == 1 and rt.arenas[0].regions["argmax_result"][1] >= 16
        results: list[int] = []
        rt.tokens = 5
        eng.prefill(np.arange(5) % spec.vocab)
        for step in range(3):
            rt.tokens = 1
            monkeypatch.undo()  # one wrapper of memcpy_dtoh at a time
            monkeypatch.setattr(dk, "Cublas", NullCublas)
            events = _log_host_waits(monkeypatch, rt, spec.vocab)
            _device_keys(monkeypatch, rt, 321 + step, events=events)
            copy = rt.memcpy_dtoh  # and where the result's copy reads
            monkeypatch.setattr(rt, "memcpy_dtoh", lambda host, src, stream, copy=copy: (
                results.append(src) if host.dtype == np.uint64 and host.size == 2 else None,
                copy(host, src, stream))[1])
            before = len(rt.launches)
            token, stats = eng.prefill_argmax(np.array([7 + step]))
            assert token == 321 + step and stats.tokens == 1
            assert ("logits", "compute") not in events, events
            at = events.index(("argmax", "compute"))
            assert events.count(("argmax", "compute")) == 1
            assert at < events.index(("int32", "compute"))  # before the routing's readback
            waits = [i for i, e in enumerate(events) if e[0] == "wait" and i > at]
            assert len(waits) == 1, (step, events)
            assert "logits_argmax" in rt.launches[before:]
            assert eng.kv_length == 6 + step
        assert results and set(results) == {rt.arenas[0].ptr("argmax_result")}
        assert len(rt.arenas) == 1
        # a row with NaN or Inf is refused, named by its position, as prefill's logits are
        _device_keys(monkeypatch, rt, 5, flag=1)
        with pytest.raises(NonFiniteError, match="position 8"):
            eng.prefill_argmax(np.array([9]))


def test_a_greedy_step_under_host_argmax_brings_back_the_row(fake, monkeypatch):
    """decode_argmax "host": the row comes back and numpy takes its argmax; no argmax kernel
    runs."""
    opened: list[str] = []
    monkeypatch.setattr(FakeModule, "kernel", lambda self, name, types, overlap=False: (
        opened.append(name), FakeKernel(self.rt, name, types))[1])
    eng, spec = _engine(monkeypatch, prefill=64, decode_argmax="host")
    assert "logits_argmax" not in opened
    with eng:
        rt = fake["rt"]
        rt.tokens = 5
        eng.prefill(np.arange(5) % spec.vocab)
        events = _log_host_waits(monkeypatch, rt, spec.vocab)
        rt.tokens = 1
        token, _ = eng.prefill_argmax(np.array([7]))
        # the logged copy writes 1000 + index: the last id holds the largest logit
        assert token == spec.vocab - 1 and ("logits", "compute") in events
        assert "logits_argmax" not in rt.launches


def test_prefill_argmax_on_the_numpy_backend_is_the_argmax_of_prefill():
    """Without a device argmax the row comes back and the engine takes its argmax."""
    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=8, top_k=2, context=64)
    whole = Qwen3Model.synthetic(spec, 5, "iq3_xxs")
    with Engine.open(EngineConfig(model=whole, backend="reference", context=64)) as eng:
        logits, _ = eng.prefill(np.array([3, 1, 4]))
        eng.reset()
        token, _ = eng.prefill_argmax(np.array([3, 1, 4]))
        assert token == int(np.argmax(logits)) and eng.kv_length == 3


class _GreedySession:
    """A LogitsSession whose greedy steps come from prefill_argmax (recorded)."""

    def __init__(self):
        self.kv_length, self.context, self.vocab = 0, 64, 10
        self.calls: list[str] = []

    def prefill(self, token_ids, all_logits=False):
        self.calls.append("prefill")
        self.kv_length += len(token_ids)
        return np.eye(self.vocab, dtype=np.float32)[(self.kv_length * 3) % self.vocab], None

    def prefill_argmax(self, token_ids):
        self.calls.append("argmax")
        self.kv_length += len(token_ids)
        return (self.kv_length * 3) % self.vocab, None

    def reset(self):
        self.kv_length = 0


def test_greedy_steps_take_the_token_alone_and_sampled_ones_the_logits():
    s = _GreedySession()
    out = generate(s, [1, 2], 4, eos_id=None)
    assert out.ids == [6, 9, 2, 5] and s.calls == ["prefill"] + ["argmax"] * 3
    s.calls.clear()
    generate(s, [1, 2], 3, eos_id=None, sampling=SamplingParams(temperature=0.7, seed=1))
    assert s.calls == ["prefill"] * 3


@pytest.mark.parametrize("decode", ["routed", "gemv"])
def test_a_decode_steps_routing_is_counted_after_its_one_wait(fake, monkeypatch, decode):
    """The routing's counts reach the Stats after the chunk's one wait: every layer's rows sum
    to top_k, and the experts streamed are the routed ones that are not resident."""
    monkeypatch.setattr(dk, "Cublas", NullCublas)
    # no driver here to map the host store (the executor looks it up for both paths)
    monkeypatch.setattr(cuda_executor, "host_device_pointer", lambda host: 1 << 40)
    spec = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                     n_kv_heads=2, head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                     n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
    whole = Qwen3Model.synthetic(spec, 3, "iq3_xxs")
    cfg = EngineConfig(model=whole, backend="cuda", expert_cache=spec.n_experts, prefill=64,
                       check_plan=True, timing=False, context=512, decode=decode)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        rt.tokens = 5
        eng.prefill(np.arange(5) % spec.vocab)
        resident = eng.driver.residency.mask()
        for step in range(3):
            rt.tokens = 1
            _, stats = eng.prefill(np.array([7 + step]), record_routing=True)
            counts = stats.routing_counts
            assert counts is not None and (counts.sum(axis=1) == spec.top_k).all(), step
            streamed = int(((counts > 0) & ~resident).sum())
            assert stats.experts_streamed == streamed, step
            _, quiet = eng.prefill(np.array([3]))  # counted without being asked for
            assert quiet.routing_counts is None and quiet.experts_streamed >= 0


def test_a_sampled_step_draws_in_the_engines_arena(fake, monkeypatch):
    """The device sampler's penalised ids and drawn id are regions of the engine's arena
    (sample_seen, sample_out: the memory plan counts them), not an arena of its own."""
    eng, spec = _engine(monkeypatch, prefill=64)
    with eng:
        rt = fake["rt"]
        rt.tokens = 5
        eng.prefill(np.arange(5) % spec.vocab)
        arena = rt.arenas[0]
        assert arena.regions["sample_seen"][1] >= 4 * eng.context_tokens
        sources: list[int] = []
        copy = rt.memcpy_dtoh


        def dtoh(host, src, stream):  # the drawn id (the fake reads other int32 as bounds)
            if host.dtype == np.int32 and host.size == 1:
                sources.append(src)
                host[0] = 17
            else:
                copy(host, src, stream)

        monkeypatch.setattr(rt, "memcpy_dtoh", dtoh)
        params = SamplingParams(temperature=0.8, repetition_penalty=1.1, seed=3)
        assert eng.backend.sample_last(params, [1, 2, 2], 0) == 17
        assert sources == [arena.ptr("sample_out")] and len(rt.arenas) == 1
