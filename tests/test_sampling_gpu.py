"""The sampling kernel (kernels/model/sampling.cu) against the numpy sampler it reproduces: the
same id, exactly, on fresh random logits (ties, -inf, -0, saturating values) for many seeds,
steps and parameter sets, the id written into a poisoned output and the logits left as they
were; the kernel's error codes; the device sampler of a whole model's decode against numpy on
the logits the engine returned at each step; the greedy step's device argmax against numpy's
argmax (ties, -0 against +0, rows of every length) and its NaN/infinity flag, and greedy
decoding through it against the host argmax of each step's logits."""

from __future__ import annotations

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.sampling_kernels import (
    ALL_MASKED,
    BAD_LOGITS,
    DeviceArgmax,
    DeviceSampler,
    SamplingKernels,
)
from strata_rt.errors import StrataError
from strata_rt.text.sampling import SamplingParams, distinct_ids, sample

pytestmark = pytest.mark.gpu

QWEN_VOCAB = 151_936

PARAMS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 40},
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
    {"temperature": 1.2, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 2048, "top_p": 0.99, "min_p": 0.001},
    {"temperature": 1.0, "repetition_penalty": 1.3},
    {"temperature": 0.0, "repetition_penalty": 1.5},
    {"temperature": 3e-4},
    {"temperature": 50.0, "top_k": 7},
    {"temperature": 1.0, "top_k": 1},
]


def random_logits(rng: np.random.Generator, vocab: int, kind: str) -> np.ndarray:
    """float32 logits: continuous, coarse (many ties), or with -inf, -0.0 and huge values."""
    if kind == "normal":
        row = rng.standard_normal(vocab) * rng.uniform(0.5, 8)
    elif kind == "ties":
        row = rng.integers(-6, 6, vocab).astype(np.float64) * 0.5
    else:
        row = rng.standard_normal(vocab) * 4
        row[rng.random(vocab) < 0.3] = -np.inf
        row[rng.random(vocab) < 0.01] = -0.0
        row[rng.integers(0, vocab, 3)] = rng.choice([3e38, -3e38, 1e-40], 3)
    return row.astype(np.float32)


class KernelRun:
    """Uploads one row of logits and draws from it on the device as often as asked."""

    def __init__(self, rt, logits: np.ndarray, seen: np.ndarray):
        self.rt, self.s = rt, rt.stream("sampling-test")
        self.kern = SamplingKernels(rt)
        self.logits, self.vocab = logits, logits.size
        self.seen = distinct_ids(seen, logits.size)
        self.d_logits = upload(rt, self.s, logits)
        self.d_seen = upload(rt, self.s, self.seen if self.seen.size else np.zeros(1, np.int32))

    def draw(self, params: SamplingParams, step: int) -> int:
        out = poisoned(self.rt, self.s, 4)
        try:
            self.kern.sample(self.s, self.d_logits.ptr, self.vocab, self.d_seen.ptr,
                             int(self.seen.size), params, step, out.ptr)
            return int(download(self.rt, self.s, out, np.int32, (1,))[0])
        finally:
            out.free()

    def check_unchanged(self) -> None:
        back = download(self.rt, self.s, self.d_logits, np.float32, (self.vocab,),
                        check_tail=False)
        assert np.array_equal(back.view(np.uint32), self.logits.view(np.uint32))

    def free(self) -> None:
        self.d_logits.free()
        self.d_seen.free()


@pytest.mark.parametrize("vocab, kind", [(QWEN_VOCAB, "normal"), (QWEN_VOCAB, "ties"),
                                         (QWEN_VOCAB, "masked"), (5000, "ties"),
                                         (2049, "masked"), (2048, "normal"), (37, "ties"),
                                         (1, "normal")])
def test_kernel_draws_what_numpy_draws(rt, rng, vocab, kind) -> None:
    logits = random_logits(rng, vocab, kind)
    seen = rng.integers(0, vocab, int(rng.integers(1, 300)))
    if kind == "masked":  # a seen -inf stays -inf
        logits[seen[:5]] = -np.inf
    if np.isneginf(logits).all():
        logits[0] = 0.0
    run = KernelRun(rt, logits, seen)
    try:
        for kw in PARAMS:
            for _ in range(12):
                seed = int(rng.integers(0, 2**64, dtype=np.uint64))
                step = int(rng.integers(0, 5000))
                params = SamplingParams(seed=seed, **kw)
                want = sample(logits, params, seen, step)
                got = run.draw(params, step)
                assert got == want, (kw, seed, step)
        run.check_unchanged()
    finally:
        run.free()


def test_kernel_over_many_seeds_on_one_row(rt, rng) -> None:
    """500 seeds of one flat row: the ids spread, and every one equals numpy's."""
    logits = (rng.standard_normal(QWEN_VOCAB) * 0.5).astype(np.float32)
    run = KernelRun(rt, logits, np.zeros(0, np.int64))
    try:
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=int(s))
                  for s in rng.integers(0, 2**63, 500)]
        got = [run.draw(p, 0) for p in params]
        assert got == [sample(logits, p, [], 0) for p in params]
        assert len(set(got)) > 400
    finally:
        run.free()


@pytest.mark.parametrize("bad, code", [(np.nan, BAD_LOGITS), (np.inf, BAD_LOGITS)])
def test_kernel_flags_bad_logits(rt, rng, bad, code) -> None:
    logits = random_logits(rng, 3000, "normal")
    logits[int(rng.integers(0, 3000))] = bad
    run = KernelRun(rt, logits, np.zeros(0, np.int64))
    try:
        assert run.draw(SamplingParams(temperature=1.0, seed=1), 0) == code
    finally:
        run.free()
    masked = KernelRun(rt, np.full(3000, -np.inf, np.float32), np.zeros(0, np.int64))
    try:
        assert masked.draw(SamplingParams(temperature=1.0, seed=1), 0) == ALL_MASKED
    finally:
        masked.free()


def test_device_sampler_returns_numpy_ids_and_names_errors(rt, rng) -> None:
    s = rt.stream("sampler")
    sampler = DeviceSampler(rt, QWEN_VOCAB, 4096)
    try:
        seen: list[int] = list(rng.integers(0, QWEN_VOCAB, 100))
        params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.2, seed=77)
        for step in range(20):
            logits = random_logits(rng, QWEN_VOCAB, "normal")
            d = upload(rt, s, logits)
            try:
                got = sampler.sample(s, d.ptr, params, seen, step)
            finally:
                d.free()
            assert got == sample(logits, params, seen, step)
            seen.append(got)
        d = upload(rt, s, np.full(QWEN_VOCAB, np.nan, np.float32))
        try:
            with pytest.raises(StrataError, match="NaN or \\+inf"):
                sampler.sample(s, d.ptr, params, seen, 0)
        finally:
            d.free()
    finally:
        sampler.close()


def test_engine_samples_on_the_device_as_numpy_does_on_its_logits() -> None:
    """A whole model on the CUDA backend decoding with sampling: each step's id (drawn on the
    device) equals numpy's draw from the logits that step's prefill returned."""
    from strata_rt.engine import Engine
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
    from strata_rt.text.generate import EngineSession, generate

    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=3000,
                     ffn=256, n_experts=8, top_k=2, context=256)
    model = Qwen3Model.synthetic(spec, 5, "fp16")
    params = SamplingParams(temperature=1.1, top_p=0.95, repetition_penalty=1.2, seed=2024)
    prompt = np.random.default_rng(3).integers(0, spec.vocab, 12)
    with Engine.open({"model": model, "backend": "cuda", "expert_cache": 16}) as engine:
        session = EngineSession(engine)
        rows: list[np.ndarray] = []
        prefill = session.prefill

        def recording(ids, all_logits=False):
            logits, stats = prefill(ids, all_logits)
            rows.append(np.array(logits))
            return logits, stats

        session.prefill = recording  # type: ignore[method-assign]
        result = generate(session, prompt, 16, None, sampling=params)
    assert len(result.ids) == 16 and result.sampling == params
    seen = [int(t) for t in prompt]
    for step, (logits, token) in enumerate(zip(rows, result.ids)):
        assert token == sample(logits, params, seen, step), step
        seen.append(token)


def _device_argmax(rt, s, am: DeviceArgmax, row: np.ndarray) -> int | None:
    d = upload(rt, s, row)
    try:
        am.enqueue(s, d.ptr, row.size)
        s.synchronize()
        token = am.token()
        back = download(rt, s, d, np.float32, (row.size,), check_tail=False)
        assert np.array_equal(back.view(np.uint32), row.view(np.uint32))  # read, not written
        return token
    finally:
        d.free()


@pytest.mark.parametrize("vocab", [1, 37, 255, 256, 2049, QWEN_VOCAB, 1_000_003])
def test_device_argmax_is_numpys(rt, rng, vocab) -> None:
    s = rt.stream("argmax")
    am = DeviceArgmax(rt)
    try:
        for kind in ("normal", "ties", "coarse", "huge"):
            for _ in range(4):
                if kind == "coarse":  # few distinct values: ties everywhere
                    row = rng.integers(-3, 3, vocab).astype(np.float32)
                elif kind == "huge":
                    row = random_logits(rng, vocab, "normal")
                    row[rng.integers(0, vocab, 2)] = rng.choice([3e38, -3e38], 2)
                else:
                    row = random_logits(rng, vocab, kind)
                assert _device_argmax(rt, s, am, row) == int(np.argmax(row)), (kind, vocab)
        # -0 equals +0: the first of them wins, whichever sign it has
        zeros = np.zeros(vocab, np.float32)
        zeros[vocab // 2:] = -0.0
        zeros[0] = -0.0 if vocab > 1 else 0.0
        assert _device_argmax(rt, s, am, zeros) == 0
        below = np.full(vocab, -5.0, np.float32)
        below[-1] = 0.0
        if vocab > 2:
            below[vocab // 2] = -0.0
        assert _device_argmax(rt, s, am, below) == (vocab // 2 if vocab > 2 else vocab - 1)
        for bad in (np.nan, np.inf, -np.inf):
            row = random_logits(rng, vocab, "normal")
            row[int(rng.integers(0, vocab))] = bad
            assert _device_argmax(rt, s, am, row) is None, bad
        row = random_logits(rng, vocab, "normal")  # the flag does not stick
        assert _device_argmax(rt, s, am, row) == int(np.argmax(row))
    finally:
        am.close()


def test_greedy_decode_takes_the_host_argmax_of_each_steps_logits() -> None:
    """Greedy decoding on the CUDA backend (each step's token taken on the device) against
    the same engine stepping by prefill and numpy's argmax of the returned logits."""
    from strata_rt.engine import Engine
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
    from strata_rt.text.generate import EngineSession, generate

    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=3000,
                     ffn=256, n_experts=8, top_k=2, context=256)
    model = Qwen3Model.synthetic(spec, 9, "fp16")
    prompt = np.random.default_rng(4).integers(0, spec.vocab, 12)
    with Engine.open({"model": model, "backend": "cuda", "expert_cache": 16,
                      "decode_argmax": "device"}) as engine:
        result = generate(EngineSession(engine), prompt, 20, None)
        engine.reset()
        logits, _ = engine.prefill(prompt)
        want = [int(np.argmax(logits))]
        while len(want) < 20:
            logits, _ = engine.prefill(np.array([want[-1]]))
            want.append(int(np.argmax(logits)))
    assert result.ids == want
