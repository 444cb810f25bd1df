"""A layer split on the reference backend (one executor per simulated device, the residual
handed over by each part's HandOff): the same bytes as one device for MoE layers alone over
random small shapes, and for a whole model's prefill over several chunks and its greedy decode;
STRATA_CHECK_PLAN checks every part's plan across the parts; bad `devices` values are refused
by the engine config and the run config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.config.run.run_config import validate
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.plan import HandOff
from strata_rt.weights.model import SMALL_SPEC, Model

WHOLE = Qwen3Spec(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                  ffn=256, n_experts=8, top_k=2, context=512)


def _moe(model, h, **kw):
    with Engine.open(EngineConfig(model=model, backend="reference", check_plan=True,
                                  **kw)) as eng:
        out, stats = eng.prefill(h)
        return out, eng.split_lines, stats


@settings(max_examples=6, deadline=None)
@given(n_layers=st.integers(2, 4), n_experts=st.sampled_from([8, 20]), seed=st.integers(0, 99),
       tokens=st.integers(1, 90), prefill=st.sampled_from([7, 32, 64]),
       cache=st.integers(0, 12), n_devices=st.integers(2, 3))
def test_moe_split_matches_one_device(n_layers, n_experts, seed, tokens, prefill, cache,
                                      n_devices):
    n_devices = min(n_devices, n_layers)
    spec = replace(SMALL_SPEC, n_layers=n_layers, n_experts=n_experts, top_k=2, hidden=256,
                   ffn=256)
    model = Model.synthetic(spec, seed)
    h = np.random.default_rng(seed).standard_normal((tokens, 256), dtype=np.float32)
    one, lines, _ = _moe(model, h, prefill=prefill, expert_cache=cache)
    assert lines == []
    split, lines, stats = _moe(model, h, prefill=prefill, expert_cache=cache,
                               devices=list(range(n_devices)))
    assert split.tobytes() == one.tobytes()
    assert len(lines) == n_devices and stats.chunks == -(-tokens // prefill)


@pytest.fixture(scope="module")
def whole() -> Qwen3Model:
    return Qwen3Model.synthetic(WHOLE, 5, "iq3_xxs")


def _generate(model, devices, **kw):
    """Every logit of a 70-token prompt in chunks of 16, then 4 greedy tokens."""
    ids = np.random.default_rng(3).integers(0, WHOLE.vocab, 70)
    with Engine.open({"model": model, "backend": "reference", "prefill": 16,
                      "check_plan": True, "devices": devices, **kw}) as eng:
        logits, _ = eng.prefill(ids, all_logits=True)
        tokens, last = [], logits[-1]
        for _ in range(4):
            tokens.append(int(last.argmax()))
            last, _ = eng.prefill(np.array(tokens[-1:]))
        plans = getattr(eng.driver, "plans", [eng.driver.last_plan])
        return logits, tokens, last, plans


@pytest.mark.parametrize("devices, kw", [([0, 1], {}), ([2, 0, 1], {"dense": "stream"}),
                                         ([0, 1], {"expert_cache": 5, "decode": "staging"}),
                                         ([1, 0], {"expert_cache": 5,
                                                   "prefill_stream": "routed_walk"})])
def test_whole_model_split_matches_one_device(whole, devices, kw):
    logits, tokens, last, _ = _generate(whole, [0], **kw)
    s_logits, s_tokens, s_last, plans = _generate(whole, devices, **kw)
    assert s_logits.tobytes() == logits.tobytes()
    assert s_tokens == tokens and s_last.tobytes() == last.tobytes()
    # the last decode step: every part after the first opened with its hand-off
    for p, plan in enumerate(plans):
        handoffs = [op for _, op in plan.ops() if isinstance(op, HandOff)]
        assert handoffs == ([] if p == 0 else [HandOff(plan.layers[0].layer, p - 1, p)])


def test_engine_config_refuses_bad_devices(whole):
    for bad, why in (([0, 0], "twice"), ([-2], "not a device index"), ("x", "expected")):
        with pytest.raises(ConfigError, match=why):
            EngineConfig(model=whole, devices=bad).resolve()
    with pytest.raises(ConfigError, match="4 devices for 3 layers"):
        Engine.open({"model": whole, "backend": "reference", "devices": [0, 1, 2, 3]})
    assert EngineConfig(model=whole).resolve().devices == (0,)


def test_run_config_devices(tmp_path: Path):
    doc = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                   "top_k": 2}},
           "format": "iq3_xxs", "backend": "reference", "prompts": [8]}
    assert validate(doc, tmp_path).devices == (0,)
    cfg = validate({**doc, "devices": [1, 0]}, tmp_path)
    assert cfg.devices == (1, 0) and cfg.engine_config().devices == (1, 0)
    for bad, why in (([0, 0], "names a device twice"), ([0, 1, 2], "3 devices for 2 layers"),
                     ("gpu0", "expected device indices"), ([], "empty"), (1.5, "a list")):
        with pytest.raises(ConfigError, match=why):
            validate({**doc, "devices": bad}, tmp_path)
