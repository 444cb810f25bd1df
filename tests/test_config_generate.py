"""`generate: {tokens: N}` in a run config and what `strata run` does with it (reference
backend): the key's checks, the greedy ids after each timed prompt against `greedy` from an
empty cache, the JSON record, and `strata bench --order`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import strata_rt.cli.run as cli_run
from strata_rt.cli import main
from strata_rt.config.run.run_config import load_config, validate
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.text.generate import EngineSession, greedy

TINY_WHOLE = {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8, "top_k": 2,
              "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "vocab": 512, "context": 256,
              "seed": 3}


def _doc(**extra) -> dict:
    doc = {"model": {"synthetic": dict(TINY_WHOLE)}, "format": "iq3_xxs",
           "backend": "reference", "expert_cache": 8, "prompts": [9, 40]}
    doc.update(extra)
    return doc


def _problems(doc: dict, tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        validate(doc, tmp_path)
    return str(info.value)


def test_generate_tokens_read_and_defaulted(tmp_path):
    assert validate(_doc(), tmp_path).generate_tokens == 0
    assert validate(_doc(generate={"tokens": 5}), tmp_path).generate_tokens == 5
    assert validate(_doc(generate={"tokens": 0}), tmp_path).generate_tokens == 0
    # the longest prompt (40) + 216 new tokens fill the 256 positions exactly
    assert validate(_doc(generate={"tokens": 216}), tmp_path).generate_tokens == 216


@pytest.mark.parametrize("value, message", [
    ({"tokens": -1}, "generate.tokens: got -1; must be >= 0"),
    ({"tokens": 2.5}, "generate.tokens: got 2.5; expected an integer >= 0"),
    ({"tokens": True}, "generate.tokens: got true; expected an integer >= 0"),
    ({"tokens": "24"}, "generate.tokens: got '24'; expected an integer >= 0"),
    ({}, "generate.tokens: (missing); required: an integer >= 0"),
    (24, "generate: got 24; expected a mapping"),
    ({"tokens": 4, "token": 4}, "generate.token: unknown key; did you mean `tokens`?"),
    ({"tokens": 217}, "the longest prompt (40 tokens) + 217 new ones need 257 KV-cache "
                      "positions; the context holds 256 (ask for at most 216"),
])
def test_bad_generate_values_are_named(tmp_path, value, message):
    assert message in _problems(_doc(generate=value), tmp_path)


def test_generate_counts_against_the_top_level_context(tmp_path):
    text = _problems(_doc(generate={"tokens": 30}, context=64), tmp_path)
    assert "need 70 KV-cache positions; the context holds 64 (ask for at most 24" in text
    assert validate(_doc(generate={"tokens": 24}, context=64), tmp_path).generate_tokens == 24


def test_generate_needs_a_whole_model(tmp_path):
    syn = {k: TINY_WHOLE[k] for k in ("n_layers", "hidden", "ffn", "n_experts", "top_k")}
    doc = {**_doc(generate={"tokens": 4}), "model": {"synthetic": syn}}
    assert "generate: got {'tokens': 4}; only for a whole model" in _problems(doc, tmp_path)


def test_prompt_override_checks_generate_against_the_context(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_doc(generate={"tokens": 20})))
    cfg = load_config(path)
    assert cfg.with_prompt_lengths([236]).generate_tokens == 20
    with pytest.raises(ConfigError, match=r"--prompts with generate.tokens: got 20; the "
                                          r"longest prompt \(237 tokens\)"):
        cfg.with_prompt_lengths([5, 237])


def _config(tmp_path: Path, **extra) -> Path:
    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump(_doc(**extra)))
    return path


def test_run_generates_after_each_prompt_as_greedy_does(tmp_path, capsys):
    """The ids `strata run` prints and records equal `greedy` from an empty cache on a fresh
    engine: the timed prefill's logits and cache are what the decode continues from."""
    path = _config(tmp_path, generate={"tokens": 7}, repeats=2)
    target = tmp_path / "run.json"
    assert main(["run", str(path), "--json", str(target)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(target.read_text())
    assert doc["generate_tokens"] == 7 and doc["complete"]
    cfg = load_config(path)
    with Engine.open(cfg.engine_config()) as engine:
        tokenizer = engine.tokenizer()
        want = {p.index: greedy(EngineSession(engine), p.engine_input(engine, cfg.seed), 7,
                                tokenizer.eos_token_id).ids for p in cfg.prompts}
    assert [(r["prompt"], r["repeat"]) for r in doc["runs"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for r in doc["runs"]:
        ids = r["generated_ids"]
        assert ids == want[r["prompt"]] and 1 <= len(ids) <= 7
        assert r["generate"]["stop"] == ("eos" if len(ids) < 7 else "length")
        assert r["generated_text"] == tokenizer.decode(ids)
        assert len(r["generate"]["step_wall_s"]) == len(ids) - 1
        line = f"prompt {r['prompt'] + 1}, repeat {r['repeat'] + 1}: {len(ids)} greedy tokens"
        assert line in out and " ".join(map(str, ids)) in out
    assert want[0] != want[1]  # distinct prompts: the comparison could fail
    assert "the greedy tokens after it are not timed in" in out


def test_run_without_generate_records_no_ids(tmp_path, capsys):
    target = tmp_path / "run.json"
    assert main(["run", str(_config(tmp_path)), "--json", str(target)]) == 0
    assert "greedy tokens" not in capsys.readouterr().out
    runs = json.loads(target.read_text())["runs"]
    assert runs and all("generated_ids" not in r for r in runs)


def test_run_zero_tokens_prefills_only(tmp_path, capsys):
    target = tmp_path / "run.json"
    assert main(["run", str(_config(tmp_path, generate={"tokens": 0})), "--json",
                 str(target)]) == 0
    assert "greedy tokens" not in capsys.readouterr().out
    assert all("generated_ids" not in r for r in json.loads(target.read_text())["runs"])


def test_run_prints_ids_only_without_a_tokenizer(tmp_path, capsys, monkeypatch, caplog):
    from strata_rt.text.tokenizer import TokenizerError

    def no_tokenizer(self):
        raise TokenizerError("no tokenizer for this test")

    monkeypatch.setattr(Engine, "tokenizer", no_tokenizer)
    target = tmp_path / "run.json"
    assert main(["run", str(_config(tmp_path, generate={"tokens": 3})), "--json",
                 str(target)]) == 0
    out = capsys.readouterr().out
    runs = json.loads(target.read_text())["runs"]
    assert all(len(r["generated_ids"]) == 3 and r["generated_text"] is None for r in runs)
    assert "text '" not in out and "greedy tokens (stop: length" in out
    assert "printed as ids only" in caplog.text


@pytest.mark.parametrize("order, first", [("ab", "0"), ("ba", "1")])
def test_bench_order_runs_the_named_arm_first(tmp_path, capsys, monkeypatch, order, first):
    flips: list[str] = []
    real = cli_run.set_switch

    def recording(engine, name, value):
        flips.append(value)
        real(engine, name, value)

    monkeypatch.setattr(cli_run, "set_switch", recording)
    target = tmp_path / "ab.json"
    assert main(["bench", str(_config(tmp_path)), "--pairs", "2", "--order", order,
                 "--prompts", "12,20", "--json", str(target)]) == 0
    second = "1" if first == "0" else "0"
    # the warm-up of both arms, then per prompt two pairs in the same order
    assert flips == [first, second] * (1 + 2 * 2)
    doc = json.loads(target.read_text())
    assert doc["order"] == order and [r["tokens"] for r in doc["rows"]] == [12, 20]
    assert all(len(r["a_s"]) == len(r["b_s"]) == 2 for r in doc["rows"])
    assert f"order {'A, B' if order == 'ab' else 'B, A'} per pair" in capsys.readouterr().out


def test_bench_rejects_an_unknown_order(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "configs/tiny-qwen3moe.yaml", "--order", "abba"])
    assert "invalid choice: 'abba'" in capsys.readouterr().err


def test_generated_ids_follow_from_the_prefill_logits(tmp_path):
    """The first generated id is the argmax of the timed prefill's logits (not of a second
    prefill): run the pieces by hand."""
    cfg = load_config(_config(tmp_path, generate={"tokens": 2}))
    with Engine.open(cfg.engine_config()) as engine:
        ids = cfg.prompts[1].engine_input(engine, cfg.seed)
        engine.reset()
        logits, _ = engine.prefill(ids)
        record = cli_run.generate_after(engine, logits, 2, None, _Quiet(), "p")
        assert record["generated_ids"][0] == int(np.argmax(logits))
        assert engine.kv_length == len(ids) + 1  # the last token is chosen, not prefilled


class _Quiet:
    enabled = True
