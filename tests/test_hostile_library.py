"""Hostile inputs from a library caller (Engine.open's settings and model dict, prefill's
arrays) and command-line flags given empty: each a ConfigError naming what was given and
what is allowed (exit 2 on the command line), never a TypeError or ValueError from deep
inside, a numpy warning, or a flag taken as absent."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import yaml
from test_hostile_inputs import refused, write

from strata_rt.config.settings.engine_config import EngineConfig
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.models.qwen3 import Qwen3Spec
from strata_rt.weights.model import MoESpec

MOE = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=4, top_k=2)
WHOLE = Qwen3Spec(n_layers=1, hidden=256, n_heads=2, n_kv_heads=1, head_dim=32, vocab=300,
                  ffn=256, n_experts=4, top_k=2, context=32)
#: a whole model of 32 positions, as a run config
WHOLE_TEXT = yaml.safe_dump({
    "model": {"synthetic": {"n_layers": 1, "hidden": 256, "ffn": 256, "n_experts": 4,
                            "top_k": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32,
                            "vocab": 512, "context": 32, "seed": 1}},
    "format": "iq3_xxs", "backend": "reference", "expert_cache": 2, "prompts": [5]})


@pytest.mark.parametrize("settings", ["run.yaml", None, [("model", MOE)],
                                      {"model": MOE, 1: "reference"}, {"model": MOE, None: 1}])
def test_engine_open_takes_settings_keyed_by_name(settings) -> None:
    """Not a mapping, or a key that is not a name: was a TypeError from `**`."""
    with pytest.raises(ConfigError, match="Engine.open: got .*; allowed: an EngineConfig, or "
                       "a dict of its settings"):
        Engine.open(settings)


@pytest.mark.parametrize("key, value", [("_profile", 1), ("_mmq_kernel_from", 5),
                                        ("_dump_r_from", None)])
def test_a_private_field_is_no_setting(key, value) -> None:
    """EngineConfig's private fields (what the engine fills in itself) were taken as settings
    keys: `_profile: 1` ended in an AttributeError while the engine opened."""
    settings = {"model": MOE, "backend": "reference", "expert_cache": 1,
                "mmq_kernel": "nope", "dump_r": "/nonexistent/dump", key: value}
    known = {"_profile": "profile", "_mmq_kernel_from": "mmq_kernel", "_dump_r_from": "dump_r"}
    with pytest.raises(ConfigError, match=f"{key}: unknown key; did you mean `{known[key]}`") as e:
        Engine.open(settings)
    assert "known keys: " in str(e.value) and ", _" not in str(e.value)
    with pytest.raises(ConfigError, match=f"{key}: unknown key"):
        EngineConfig(model=MOE, **{key: value})


def test_copy_chains_takes_a_count_as_a_number() -> None:
    """copy_chains=3 was refused as "got 3; allowed: 1, 2, 3, 4"."""
    assert EngineConfig(model=MOE, copy_chains=3).resolve().copy_chains == "3"
    for bad in (True, 0, 5, 2.0):
        with pytest.raises(ConfigError, match=f"copy_chains: got {bad!r}; allowed: 1, 2, 3, 4"):
            EngineConfig(model=MOE, copy_chains=bad).resolve()


def test_an_mmq_kernel_setting_is_named_as_the_setting(monkeypatch) -> None:
    """Given in the settings, a variant the format lacks was blamed on STRATA_MMQ_KERNEL."""
    settings = {"model": MOE, "backend": "reference", "mmq_kernel": "nope"}
    with pytest.raises(ConfigError, match="(?s)engine config: .*mmq_kernel='nope': format "
                       "iq3_xxs offers f16_gemm") as e:
        Engine.open(settings)
    assert "STRATA_MMQ_KERNEL" not in str(e.value)
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "nope")
    with pytest.raises(ConfigError, match="(?s)environment: .*STRATA_MMQ_KERNEL='nope'"):
        Engine.open({"model": MOE, "backend": "reference"})


@pytest.mark.parametrize("field, value", [
    ("cuda_graph", "no"), ("cuda_graph", 0), ("repeat_devices", "yes"), ("mmq_kernel", 5),
    ("progress", 5),
])
def test_settings_of_the_wrong_kind(field, value) -> None:
    """cuda_graph="no" ran with graphs (a truthy string); progress=5 failed mid-prompt."""
    with pytest.raises(ConfigError, match=f"{field}: got {value!r}; allowed"):
        EngineConfig(model=MOE, backend="reference", **{field: value}).resolve()


@pytest.mark.parametrize("model, words", [
    ({"gguf": 5}, "model.gguf: got 5; allowed: the path of a GGUF file"),
    ({"gguf": ""}, "model.gguf: got ''; allowed: the path of a GGUF file"),
    ({"gguf": "m.gguf", "format": 5}, "model.format: got 5; allowed: a format's name"),
    ({"qwen3": WHOLE, "seed": "x"}, "model.seed: got 'x'; allowed: an integer >= 0"),
    ({"qwen3": WHOLE, "seed": 1.5}, "model.seed: got 1.5; allowed: an integer >= 0"),
    ({"qwen3": WHOLE, "seed": -1}, "model.seed: got -1; allowed: an integer >= 0"),
    ({"qwen3": WHOLE, "pool_layers": "x"}, "model.pool_layers: got 'x'; allowed"),
    ({"qwen3": WHOLE, "tied": "yes"}, "model.tied: got 'yes'; allowed: true or false"),
    ({"qwen3": WHOLE, "sed": 1}, "model.sed: unknown key of a qwen3 model; did you mean "
                                 "`seed`?"),
    ({"qwen3": WHOLE, "gguf": "m.gguf"}, "model: a dict with keys gguf, qwen3; give exactly "
                                         "one of gguf, qwen3 or spec"),
    ({"spec": 5}, "model.spec: got 5; allowed: a MoESpec"),
    ({"spec": MOE, "format": "fp16"}, "model.format: unknown key of a spec model"),
])
def test_a_model_dict_is_checked_key_by_key(model, words) -> None:
    """Each was a TypeError, ValueError or AttributeError, or ran another model than the one
    meant (a seed of 1.5 ran seed 1; gguf beside qwen3 ran the synthetic model)."""
    with pytest.raises(ConfigError, match="1 problem") as e:
        Engine.open({"model": model, "backend": "reference"})
    assert words in str(e.value)


@pytest.mark.parametrize("hidden, words", [
    (np.full((3, 256), "a"), "holds <U1 values"),
    (np.ones((3, 256), complex), "holds complex128 values"),
    (np.ones((3, 256), bool), "holds bool values"),
    (np.full((3, 256), None, object), "holds object values"),
    ([[1.0] * 256, [1.0]], "prefill input is no array"),
])
def test_hidden_states_of_no_real_type(hidden, words) -> None:
    """Text and ragged lists raised ValueError; complex values lost their imaginary part
    with a ComplexWarning; None became NaN and was refused as a NaN input."""
    with Engine.open({"model": MOE, "backend": "reference"}) as eng, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match=f"{words}.*expected \\[tokens, 256\\] hidden "
                           "states of a float or integer type"):
            eng.prefill(hidden)
        out, _ = eng.prefill(np.ones((3, 256), np.int16))  # integers are numbers
    assert out.dtype == np.float32 and out.shape == (3, 256)


@pytest.mark.parametrize("args, words", [
    (["run", "RUN", "--prompts", ""], "--prompts: got ''; expected comma-separated"),
    (["run", "RUN", "--devices", ""], "--devices: got ''; expected device indices"),
    (["generate", "RUN", "--prompt", "hi", "--devices", ""], "--devices: got ''"),
    (["generate", "RUN", "--prompt-file", ""], "--prompt-file: the path is empty; expected "
                                               "a UTF-8 text file"),
    (["perplexity", "RUN", "--file", ""], "--file: the path is empty"),
    (["inspect", ""], "FILE: the path is empty; give a GGUF file"),
])
def test_a_flag_given_empty(tmp_path, capsys, args, words) -> None:
    """--prompts "" and --devices "" were taken as absent (the config's prompts and devices
    ran); an empty file path was read as the current folder ("is a folder", ".")."""
    cfg = str(write(tmp_path, WHOLE_TEXT))
    refused(capsys, [cfg if a == "RUN" else a for a in args], words)


def test_prompts_past_the_context_are_refused_before_the_run(tmp_path, capsys) -> None:
    """--prompts longer than the KV cache was refused only once the engine had opened, by
    prefill, blaming `prefill` and telling a command-line user to reset() the engine."""
    cfg = str(write(tmp_path, WHOLE_TEXT))
    err = refused(capsys, ["run", cfg, "--prompts", "5,33"], "--prompts: got a prompt of 33 "
                  "tokens; the KV cache holds 32 positions: give at most 32")
    assert "reset()" not in err
