"""Sampled decoding (text/generate.py with SamplingParams) on the numpy reference: each id is
the numpy sampler's draw from that step's logits with the prompt and the tokens so far as the
penalty's ids; greedy parameters are the argmax path; seeds repeat; a session's device draw is
used when it has one. `strata generate`'s sampling flags and the config's `generate:` keys:
read, overriding one another, their bad values named without a traceback; `strata run`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from _generate_cases import SMALL, TINY_CONFIG

from strata_rt.cli import main
from strata_rt.config.run.run_config import validate
from strata_rt.errors import ConfigError
from strata_rt.models.qwen3 import Qwen3Model
from strata_rt.text.generate import (
    Chooser,
    ReferenceSession,
    generate,
    generate_after,
    greedy,
)
from strata_rt.text.sampling import SamplingParams, sample

PARAMS = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3, seed=7)


@pytest.fixture(scope="module")
def small() -> Qwen3Model:
    return Qwen3Model.synthetic(SMALL, 3, "fp16")


class Recording(ReferenceSession):
    """A reference session that keeps every logits row it returned."""

    def __init__(self, model):
        super().__init__(model)
        self.rows: list[np.ndarray] = []

    def prefill(self, token_ids, all_logits=False):
        logits, stats = super().prefill(token_ids, all_logits)
        self.rows.append(np.array(logits))
        return logits, stats


def test_each_id_is_the_draw_from_its_steps_logits(small) -> None:
    prompt = np.random.default_rng(1).integers(0, SMALL.vocab, 9)
    session = Recording(small)
    result = generate(session, prompt, 12, None, sampling=PARAMS)
    assert len(result.ids) == 12 and result.sampling == PARAMS
    seen = [int(t) for t in prompt]
    for step, (logits, token) in enumerate(zip(session.rows, result.ids)):
        assert token == sample(logits, PARAMS, seen, step)
        seen.append(token)
    assert generate(ReferenceSession(small), prompt, 12, None, sampling=PARAMS).ids == \
        result.ids
    other = generate(ReferenceSession(small), prompt, 12, None,
                     sampling=SamplingParams(**{**PARAMS.__dict__, "seed": 8}))
    assert other.ids != result.ids
    assert result.as_dict()["sampling"] == {"temperature": 0.9, "top_k": 50, "top_p": 0.95,
                                            "min_p": 0.0, "repeat_penalty": 1.3, "seed": 7}


def test_greedy_parameters_take_the_argmax_path(small, monkeypatch) -> None:
    prompt = np.random.default_rng(2).integers(0, SMALL.vocab, 7)
    want = greedy(ReferenceSession(small), prompt, 8, None)
    monkeypatch.setattr("strata_rt.text.generate.sample", None)  # never called
    got = generate(ReferenceSession(small), prompt, 8, None, sampling=SamplingParams(seed=3))
    assert got.ids == want.ids and got.sampling is None
    assert got.as_dict()["sampling"] is None


def test_temperature_zero_with_a_penalty_is_the_penalised_argmax(small) -> None:
    prompt = np.random.default_rng(4).integers(0, SMALL.vocab, 7)
    params = SamplingParams(repetition_penalty=5.0)
    result = generate(Recording(small), prompt, 10, None, sampling=params)
    assert result.sampling is not None and result.sampling.seed is not None
    greedy_ids = greedy(ReferenceSession(small), prompt, 10, None).ids
    assert result.ids != greedy_ids  # a penalty of 5 changes the choice on this model


def test_a_fresh_seed_is_recorded_and_repeats(small) -> None:
    prompt = np.random.default_rng(5).integers(0, SMALL.vocab, 6)
    first = generate(ReferenceSession(small), prompt, 8, None,
                     sampling=SamplingParams(temperature=1.0))
    assert first.sampling is not None and first.sampling.seed is not None
    again = generate(ReferenceSession(small), prompt, 8, None, sampling=first.sampling)
    assert again.ids == first.ids


def test_generate_after_penalises_the_callers_prompt(small) -> None:
    prompt = np.random.default_rng(6).integers(0, SMALL.vocab, 9)
    want = generate(ReferenceSession(small), prompt, 6, None, sampling=PARAMS)
    session = ReferenceSession(small)
    logits, _ = session.prefill(prompt)
    got = generate_after(session, logits, 6, None, sampling=PARAMS, prompt_ids=prompt)
    assert got.ids == want.ids


class DeviceSession:
    """Answers sample_on_device with fixed ids, or None (no device): what the Chooser sees of
    the CUDA backend."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def sample_on_device(self, params, seen, step):
        self.calls.append((list(seen), step))
        return self.answer


def test_the_chooser_draws_on_the_device_when_the_session_can() -> None:
    logits = np.arange(10, dtype=np.float32)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.1, seed=1)
    device = DeviceSession(3)
    choose = Chooser(device, params, [4, 5])  # type: ignore[arg-type]
    assert [choose(logits, 0), choose(logits, 1)] == [3, 3]
    assert device.calls == [([4, 5], 0), ([4, 5, 3], 1)]
    host = Chooser(DeviceSession(None), params, [4, 5])  # type: ignore[arg-type]
    assert host(logits, 0) == sample(logits, params, [4, 5], 0)


# ----------------------------------------------------------------------------- the command
def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_generate_samples_with_the_flags(capsys, tmp_path) -> None:
    target = tmp_path / "gen.json"
    args = ["generate", str(TINY_CONFIG), "--backend", "reference", "--prompt", "The experts",
            "-n", "6", "--ids", "--ignore-eos", "--temperature", "0.9", "--top-p", "0.9",
            "--repeat-penalty", "1.2", "--seed", "4", "--json", str(target)]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    doc = json.loads(target.read_text())
    assert doc["sampling"] == {"temperature": 0.9, "top_k": 0, "top_p": 0.9, "min_p": 0.0,
                               "repeat_penalty": 1.2, "seed": 4}
    assert out.splitlines()[0].split() == [str(t) for t in doc["ids"]]
    assert "sampling: temperature 0.9, top-p 0.9, repeat penalty 1.2, seed 4" in out
    assert cli(capsys, *args)[1].splitlines()[0] == out.splitlines()[0]  # seeded: repeats


def test_flags_override_the_config_keys(capsys, tmp_path) -> None:
    doc = yaml.safe_load(TINY_CONFIG.read_text())
    doc["generate"] = {"tokens": 3, "temperature": 0.5, "top_k": 9, "seed": 3}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(doc))
    target = tmp_path / "gen.json"
    code, _, err = cli(capsys, "generate", str(path), "--backend", "reference", "--prompt",
                       "hi", "-n", "2", "--seed", "9", "--json", str(target))
    assert code == 0, err
    assert json.loads(target.read_text())["sampling"] == {
        "temperature": 0.5, "top_k": 9, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
        "seed": 9}
    code, _, err = cli(capsys, "generate", str(path), "--backend", "reference", "--prompt",
                       "hi", "-n", "2", "--temperature", "0", "--json", str(target))
    assert code == 0 and json.loads(target.read_text())["sampling"] is None  # greedy again


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "--top-p: got 0.0; expected a number > 0 and <= 1"),
    (["--temperature", "-1"], "--temperature: got -1.0; expected a number >= 0"),
    (["--temperature", "nan"], "--temperature: got nan"),
    (["--top-k", "5000"], "--top-k: got 5000; expected an integer 0..2048"),
    (["--min-p", "1"], "--min-p: got 1.0; expected a number >= 0 and < 1"),
    (["--repeat-penalty", "0"], "--repeat-penalty: got 0.0; expected a number > 0"),
    (["--seed", "-1"], "--seed: got -1; expected an integer 0..2**64-1"),
    # past float32's range the kernel's value was inf or 0: numpy's RuntimeWarning reached
    # the user (overflow in the cast, a division by zero) and the run went on
    (["--temperature", "1e308"], "--temperature: got 1e+308; expected a number >= 0 (0: "
     "greedy, the most likely token) that a float32 holds: 0 or 1.4e-45 .. 3.4e+38"),
    (["--temperature", "1e-320"], "--temperature: got 1e-320; expected a number >= 0"),
    (["--repeat-penalty", "3.5e38"], "--repeat-penalty: got 3.5e+38; expected a number > 0 "
     "(1: off; above 1 discourages repeats) that a float32 holds: 1.4e-45 .. 3.4e+38"),
])
def test_bad_sampling_flags_are_named(capsys, flags, message) -> None:
    code, out, err = cli(capsys, "generate", str(TINY_CONFIG), "--backend", "reference",
                         "--prompt", "x", "-n", "2", *flags)
    assert code == 2 and out == "", err
    assert err.startswith("strata generate: ") and message in err


def test_an_unparsable_flag_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", str(TINY_CONFIG), "--prompt", "x", "--top-k", "many"])
    assert info.value.code == 2 and "--top-k" in capsys.readouterr().err


def test_help_lists_the_sampling_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty",
                 "--seed"):
        assert flag in out
    assert "greedy" in out


# ----------------------------------------------------------------------------- the config
TINY_WHOLE = {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8, "top_k": 2,
              "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "vocab": 512, "context": 256,
              "seed": 3}


def _doc(**extra) -> dict:
    return {"model": {"synthetic": dict(TINY_WHOLE)}, "format": "iq3_xxs",
            "backend": "reference", "expert_cache": 8, "prompts": [9], **extra}


def test_config_sampling_keys(tmp_path) -> None:
    assert validate(_doc(), tmp_path).sampling is None
    assert validate(_doc(generate={"tokens": 3, "temperature": 0}), tmp_path).sampling is None
    cfg = validate(_doc(generate={"temperature": 0.8, "top_k": 40, "top_p": 0.9,
                                  "min_p": 0.05, "repeat_penalty": 1.1, "seed": 12}), tmp_path)
    assert cfg.generate_tokens == 0  # tokens are optional beside sampling keys
    assert cfg.sampling == SamplingParams(0.8, 40, 0.9, 0.05, 1.1, 12)


@pytest.mark.parametrize("gen, message", [
    ({"temperature": -2}, "generate.temperature: got -2; expected a number >= 0"),
    ({"top_k": "all"}, "generate.top_k: got 'all'; expected an integer 0..2048"),
    ({"top_p": 1.5}, "generate.top_p: got 1.5; expected a number > 0 and <= 1"),
    ({"min_p": True}, "generate.min_p: got true"),
    ({"repeat_penalty": -1}, "generate.repeat_penalty: got -1; expected a number > 0"),
    ({"seed": 1.5}, "generate.seed: got 1.5; expected an integer 0..2**64-1"),
    ({"temperature": 1e308}, "generate.temperature: got 1e+308; expected a number >= 0"),
    ({"repeat_penalty": 1e-320}, "generate.repeat_penalty: got 1e-320; expected a number > 0"),
    ({"temperatur": 1}, "generate.temperatur: unknown key; did you mean `temperature`?"),
])
def test_bad_config_sampling_keys_are_named(tmp_path, gen, message) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_doc(generate={"tokens": 2, **gen}), tmp_path)
    assert message in str(info.value)


def test_run_samples_after_each_prompt(tmp_path, capsys, small) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_doc(generate={"tokens": 5, "temperature": 1.0,
                                                  "seed": 5})))
    target = tmp_path / "run.json"
    assert main(["run", str(path), "--json", str(target)]) == 0
    out = capsys.readouterr().out
    record = json.loads(target.read_text())["runs"][0]
    assert record["generate"]["sampling"]["seed"] == 5
    assert "sampled (seed 5) tokens" in out
    from strata_rt.engine import Engine
    from strata_rt.text.generate import EngineSession

    cfg = validate(yaml.safe_load(path.read_text()), tmp_path)
    with Engine.open(cfg.engine_config()) as engine:
        ids = cfg.prompts[0].engine_input(engine, cfg.seed)
        eos = engine.tokenizer().eos_token_id
        want = generate(EngineSession(engine), ids, 5, eos, sampling=cfg.sampling).ids
    assert record["generated_ids"] == want
