"""A layer split on the CUDA backend, on a GPU: two parts of the layers on one GPU
(`devices: [0, 0]` under EngineConfig.repeat_devices, both parts in one context, the hand-off
a device copy) give the bytes of one device: the final hidden states of MoE layers alone and
a whole model's every logit over a prefill of several chunks (the walk, the staging ring and
the routed plan, each forced), then greedy decode steps (plain launches, then replayed graphs
with the hand-off live around them). Where the machine has two GPUs, the same across two
contexts (cuMemcpyPeerAsync, events waited on from the other context).

Run: pytest -m gpu tests/test_cuda_split_gpu.py -ra"""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.engine import Engine
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.runtime import cuda_available
from strata_rt.weights.model import Model, MoESpec

pytestmark = pytest.mark.gpu

WHOLE = Qwen3Spec(n_layers=4, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab=700,
                  ffn=256, n_experts=32, top_k=4, context=1024)
MOE = MoESpec(n_layers=4, hidden=512, ffn=256, n_experts=32, top_k=4)
#: how each prefill chunk streams: the forced walk, the forced routed plan, the staging ring
#: (every chunk below the walk's threshold)
STREAMS = {"walk": {"prefill_stream": "walk", "walk_min_tokens": 1},
           "routed": {"prefill_stream": "routed"},
           "staging": {"prefill_stream": "walk", "walk_min_tokens": 1 << 20}}
FORMATS = ["iq3_xxs", "q4_k"]


def _two_gpus() -> pytest.MarkDecorator:
    ok, why = cuda_available(1)
    return pytest.mark.skipif(not ok, reason=f"the two-GPU split needs a second GPU ({why})")


def _config(model: object, devices: list[int], stream: str, **kw: object) -> dict:
    return {"model": model, "backend": "cuda", "devices": devices,
            "repeat_devices": len(set(devices)) < len(devices), "prefill": 64,
            "check_plan": True, **STREAMS[stream], **kw}


def _moe_run(model: Model, devices: list[int], stream: str, **kw: object) -> np.ndarray:
    h = np.random.default_rng(4).standard_normal((200, MOE.hidden), dtype=np.float32)
    with Engine.open(_config(model, devices, stream, **kw)) as eng:
        out, _ = eng.prefill(h)
        return np.array(out, copy=True)


def _whole_run(model: Qwen3Model, devices: list[int], stream: str,
               **kw: object) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """Every logit of a 150-token prompt in chunks of 64, then 4 greedy steps."""
    ids = np.random.default_rng(3).integers(0, WHOLE.vocab, 150)
    with Engine.open(_config(model, devices, stream, context=512, **kw)) as eng:
        logits, _ = eng.prefill(ids, all_logits=True)
        tokens, steps, last = [], [], logits[-1]
        for _ in range(4):
            tokens.append(int(last.argmax()))
            last, _ = eng.prefill(np.array(tokens[-1:]))
            steps.append(np.array(last, copy=True))
        return np.array(logits, copy=True), tokens, steps


@pytest.fixture(scope="module", params=FORMATS)
def whole(request: pytest.FixtureRequest) -> Qwen3Model:
    return Qwen3Model.synthetic(WHOLE, 7, request.param)


@pytest.fixture(scope="module", params=FORMATS)
def moe(request: pytest.FixtureRequest) -> Model:
    return Model.synthetic(MOE, 8, request.param)


@pytest.mark.parametrize("stream", list(STREAMS))
def test_moe_split_on_one_gpu_matches_one_device(moe: Model, stream: str) -> None:
    one = _moe_run(moe, [0], stream)
    split = _moe_run(moe, [0, 0], stream)
    assert split.tobytes() == one.tobytes()


@pytest.mark.parametrize("stream", list(STREAMS))
def test_whole_split_on_one_gpu_matches_one_device(whole: Qwen3Model, stream: str) -> None:
    logits, tokens, steps = _whole_run(whole, [0], stream)
    s_logits, s_tokens, s_steps = _whole_run(whole, [0, 0], stream)
    assert s_logits.tobytes() == logits.tobytes()
    assert s_tokens == tokens
    for step, (a, b) in enumerate(zip(s_steps, steps)):
        assert a.tobytes() == b.tobytes(), step


def test_whole_split_streamed_dense_and_residents(whole: Qwen3Model) -> None:
    """Dense weights streamed per part, experts resident in each part (read in place on
    short chunks, the same bytes as gathered), three parts."""
    kw = {"dense": "stream", "expert_cache": 0}
    logits, tokens, steps = _whole_run(whole, [0], "walk", **kw)
    s_logits, s_tokens, s_steps = _whole_run(whole, [0, 0, 0], "walk", **kw)
    assert s_logits.tobytes() == logits.tobytes() and s_tokens == tokens
    assert all(a.tobytes() == b.tobytes() for a, b in zip(s_steps, steps))
    res = _whole_run(whole, [0, 0], "routed", expert_cache=24)
    assert res[0].tobytes() == _whole_run(whole, [0], "routed", expert_cache=48)[0].tobytes()


@_two_gpus()
@pytest.mark.parametrize("stream", ["walk", "routed"])
def test_split_over_two_gpus_matches_one_device(whole: Qwen3Model, moe: Model,
                                                stream: str) -> None:
    assert _moe_run(moe, [0, 1], stream).tobytes() == _moe_run(moe, [0], stream).tobytes()
    logits, tokens, steps = _whole_run(whole, [0], stream)
    s_logits, s_tokens, s_steps = _whole_run(whole, [0, 1], stream)
    assert s_logits.tobytes() == logits.tobytes() and s_tokens == tokens
    assert all(a.tobytes() == b.tobytes() for a, b in zip(s_steps, steps))
