"""A config of just `model: {gguf: FILE}` runs every command: the format is the loaded one of
the file's expert type, prompts default to DEFAULT_PROMPTS (generate and perplexity take text
from the command line), no VRAM policy means the backends' default. A file whose expert tensors
mix types, or of a type no format stores, is a config problem listing why, until `format:`
names one to convert to. On the CPU (reference backend), with tiny GGUFs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from strata_rt.cli import main
from strata_rt.config.run.run_config import load_config
from strata_rt.config.run.schema import DEFAULT_PROMPTS
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.formats.registry import registry
from strata_rt.models.qwen3 import TINY_SPEC, Qwen3Model, write_qwen3_gguf
from strata_rt.text.tokenizer_vocab import synthetic_vocab
from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
from strata_rt.weights.model import Model, MoESpec

MOE = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=4, top_k=2)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """A tiny whole model in fp16 (its experts F16) with a tokenizer."""
    model = Qwen3Model.synthetic(TINY_SPEC, 1, "fp16")
    return write_qwen3_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", model,
                            tokenizer=synthetic_vocab(TINY_SPEC.vocab))


def config(tmp_path: Path, gguf: Path, **more) -> Path:
    path = tmp_path / "only.yaml"
    path.write_text(yaml.safe_dump({"model": {"gguf": str(gguf)}, **more}))
    return path


def test_the_config_takes_format_prompts_and_policy_by_default(whole, tmp_path):
    cfg = load_config(config(tmp_path, whole))
    assert cfg.spec.format == "fp16" and cfg.backend == "auto"
    assert [p.tokens for p in cfg.prompts] == list(DEFAULT_PROMPTS)
    assert (cfg.expert_cache, cfg.vram_reserve_mib, cfg.vram_budget_mib) == (None, None, None)
    # no format named: the engine runs every layer as the file stores it
    assert cfg.engine_config().model == {"gguf": str(whole), "format": None}


def test_an_iq3_xxs_file_runs_as_iq3_xxs(tmp_path):
    gguf = write_moe_gguf(tmp_path / "moe.gguf", Model.synthetic(MOE, 2, "iq3_xxs"))
    assert load_config(config(tmp_path, gguf)).spec.format == "iq3_xxs"
    with Engine.open({"model": {"gguf": str(gguf)}, "backend": "reference"}) as e:
        assert e.model.fmt.name == "iq3_xxs"


def _problems(tmp_path: Path, gguf: Path) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(config(tmp_path, gguf))
    return e.value.problems


def test_a_layer_whose_down_differs_runs_as_stored(tmp_path):
    """IQ3_XXS gate and up, F16 down (as llama.cpp's mixes widen ffn_down): each layer runs the
    pair's format, the file's bytes copied as they are."""
    model = Model.synthetic(MOE, 3, "iq3_xxs")
    down = {f"blk.{i}.ffn_down_exps.weight":
            (np.stack([model.dequantized(i, e)[2] for e in range(4)]).astype(np.float16), None)
            for i in range(2)}
    gguf = write_moe_gguf(tmp_path / "mixed.gguf", model, tensors=down)
    assert load_config(config(tmp_path, gguf)).spec.format == "iq3_xxs+f16"
    with Engine.open({"model": {"gguf": str(gguf)}, "backend": "reference"}) as eng:
        assert [f.name for f in eng.model.formats.formats] == ["iq3_xxs+f16"] * 2
        for layer in range(2):
            g, u, d = eng.model.dequantized(layer, 1)
            g0, u0, d0 = model.dequantized(layer, 1)
            assert np.array_equal(g, g0) and np.array_equal(u, u0)
            assert np.array_equal(d, d0.astype(np.float16).astype(np.float32))
    assert main(["run", str(config(tmp_path, gguf)), "--backend", "reference",
                 "--prompts", "8"]) == 0
    # naming a format converts them all
    cfg = load_config(config(tmp_path, gguf, format="fp16"))
    assert cfg.spec.format == "fp16"


def test_gate_and_up_of_differing_types_are_named(tmp_path):
    model = Model.synthetic(MOE, 3, "iq3_xxs")
    up = {f"blk.{i}.ffn_up_exps.weight":
          (np.stack([model.dequantized(i, e)[1] for e in range(4)]).astype(np.float16), None)
          for i in range(2)}
    gguf = write_moe_gguf(tmp_path / "mixed.gguf", model, tensors=up)
    (problem,) = _problems(tmp_path, gguf)
    assert problem.startswith(
        "format: (missing); the GGUF decides it when absent, but its experts cannot run as "
        "stored: layer 0: ffn_gate_exps is IQ3_XXS and ffn_up_exps F16 (the gate/up products "
        "need one type); layer 1: ffn_gate_exps is IQ3_XXS")
    assert problem.endswith("Name a format with `format:` to convert every expert tensor to it")
    assert main(["run", str(config(tmp_path, gguf)), "--backend", "reference"]) == 2


def test_a_type_no_format_stores_is_named(tmp_path, monkeypatch):
    gguf = write_moe_gguf(tmp_path / "f32.gguf", Model.synthetic(MOE, 4, "q2_blob"))
    assert load_config(config(tmp_path, gguf)).spec.format == "f32"  # F32 experts: f32
    monkeypatch.delitem(registry().formats, "f32")  # now no loaded format stores F32
    (problem,) = _problems(tmp_path, gguf)
    assert problem.startswith("format: (missing); the GGUF decides it when absent, but its "
                              "experts cannot run as stored: layer 0: F32, which no loaded "
                              "format stores")
    assert "fp16 (F16)" in problem and "iq3_xxs (IQ3_XXS)" in problem
    with pytest.raises(ConfigError) as e:
        Engine.open({"model": {"gguf": str(gguf)}, "backend": "reference"})
    assert "cannot decide it: its experts cannot run as stored: layer 0: F32" in str(e.value)


def test_two_vram_policies_are_still_one_too_many(whole, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(config(tmp_path, whole, expert_cache=2, vram_reserve_mib=100))
    assert "give at most one VRAM policy" in str(e.value)


@pytest.mark.parametrize("command", ["run", "bench", "profile", "generate", "perplexity"])
def test_every_command_runs_the_bare_config(whole, tmp_path, capsys, command):
    cfg = str(config(tmp_path, whole))
    text = tmp_path / "text.txt"
    text.write_text("The experts stream while the others compute. " * 8)
    extra = {"run": ["--prompts", "8"], "bench": ["--prompts", "8", "--pairs", "1", "--json",
                                                  str(tmp_path / "b.json")],
             "profile": ["--prompts", "8", "--out", str(tmp_path / "p.json")],
             "generate": ["--prompt", "The experts", "-n", "3"],
             "perplexity": ["--file", str(text), "--ctx", "16"]}[command]
    code = main([command, cfg, "--backend", "reference", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err


def test_run_with_the_default_prompt(whole, tmp_path, capsys):
    assert main(["run", str(config(tmp_path, whole)), "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert f"| {DEFAULT_PROMPTS[0]} " in out or f"{DEFAULT_PROMPTS[0]}" in out


def test_the_default_prompt_leaves_room_for_generate(tmp_path):
    """A whole model of 256 positions asked for 56 greedy tokens: the default prompt is the
    200 positions left, not an error about a prompt the config never gave."""
    from strata_rt.models.qwen3 import Qwen3Spec

    spec = Qwen3Spec(n_layers=1, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=4, top_k=2, context=256)
    gguf = write_qwen3_gguf(tmp_path / "short.gguf", Qwen3Model.synthetic(spec, 1, "fp16"))
    cfg = load_config(config(tmp_path, gguf, generate={"tokens": 56}))
    assert [p.tokens for p in cfg.prompts] == [200] and cfg.generate_tokens == 56
    assert [p.tokens for p in load_config(config(tmp_path, gguf)).prompts] == [256]
