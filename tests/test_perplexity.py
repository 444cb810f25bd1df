"""Perplexity (strata_rt.text.perplexity) and `strata perplexity`: transformers' values from the
fixtures within 1e-4 relative, windows independent of one another, the float64 log-softmax,
pieces of a window giving the window's value, progress per window, and the bad inputs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from _generate_cases import CASES, GOLDEN, SMALL, TINY_CONFIG

from strata_rt.cli import main
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError, StrataError
from strata_rt.models.qwen3 import Qwen3Model, write_qwen3_gguf
from strata_rt.report.progress import Progress
from strata_rt.text.generate import EngineSession, ReferenceSession
from strata_rt.text.perplexity import ScoreError, perplexity, token_nll, windows_of

REL = 1e-4


@pytest.fixture(scope="module")
def small() -> Qwen3Model:
    return Qwen3Model.synthetic(SMALL, 4, "fp16")



def check_against_golden(result, want: dict) -> None:
    assert len(result.windows) == len(want["windows"])
    for got, w in zip(result.windows, want["windows"]):
        assert (got.start, got.tokens) == (w["start"], w["tokens"])
        assert got.nll / got.predicted == pytest.approx(w["mean_nll"], rel=REL)
    assert result.perplexity == pytest.approx(want["perplexity"], rel=REL)


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_reference_perplexity_matches_transformers(name, golden_models) -> None:
    case = GOLDEN["cases"][name]
    session = ReferenceSession(golden_models[name])
    for want in case["perplexity"]:
        check_against_golden(perplexity(session, case["perplexity_sequence"], want["ctx"]), want)


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_engine_perplexity_matches_transformers(name, golden_models, tmp_path) -> None:
    """The engine (reference backend, chunks of 16 inside each window) through a GGUF."""
    case = GOLDEN["cases"][name]
    path = write_qwen3_gguf(tmp_path / f"{name}.gguf", golden_models[name])
    with Engine.open({"model": {"gguf": str(path), "format": CASES[name]["format"]},
                      "backend": "reference", "prefill": 16}) as engine:
        session = EngineSession(engine)
        for want in case["perplexity"]:
            check_against_golden(perplexity(session, case["perplexity_sequence"],
                                            want["ctx"]), want)


def test_token_nll_is_the_float64_log_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 50)) * 30).astype(np.float32)
    targets = rng.integers(0, 50, 5)
    x = logits.astype(np.float64)
    want = [math.log(sum(math.exp(v - row.max()) for v in row)) + row.max() - row[t]
            for row, t in zip(x, targets)]
    assert np.allclose(token_nll(logits, targets), want, rtol=1e-13, atol=0)
    bad = logits.copy()
    bad[2, 7] = np.inf
    with pytest.raises(StrataError, match="NaN or Inf"):
        token_nll(bad, targets)


def test_windows() -> None:
    assert windows_of(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows_of(9, 4) == [(0, 4), (4, 8)]  # a last window of one token predicts nothing
    assert windows_of(8, 8) == [(0, 8)]
    assert windows_of(3, 64) == [(0, 3)]


def test_each_window_starts_from_an_empty_cache(small) -> None:
    """The second window's value is that of its tokens scored alone; pieces of a window
    (max_logit_bytes) give its value; the session is left empty."""
    ids = np.random.default_rng(1).integers(0, SMALL.vocab, 50)
    session = ReferenceSession(small)
    whole = perplexity(session, ids, 20)
    alone = perplexity(session, ids[20:40], 20)
    assert whole.windows[1].nll == alone.windows[0].nll
    pieces = perplexity(session, ids, 20, max_logit_bytes=7 * 4 * SMALL.vocab)
    for a, b in zip(whole.windows, pieces.windows):
        assert a.nll == pytest.approx(b.nll, rel=1e-12)
    assert session.kv_length == 0
    assert [w.tokens for w in whole.windows] == [20, 20, 10]
    assert whole.predicted == 19 + 19 + 9
    assert whole.perplexity == pytest.approx(math.exp(whole.nll / whole.predicted))
    d = whole.as_dict()
    assert d["complete"] and len(d["windows"]) == 3 and d["windows"][2]["predicted"] == 9


def test_progress_labels_each_window(small) -> None:
    seen: list[str] = []

    class Recording(Progress):
        def start(self, label: str) -> None:
            seen.append(label)
            super().start(label)

    perplexity(ReferenceSession(small), np.arange(30) % SMALL.vocab, 12,
               Recording(stream=io.StringIO()))
    assert seen == ["window 1/3 (12 tokens)", "window 2/3 (12 tokens)",
                    "window 3/3 (6 tokens)"]


def test_ctrl_c_keeps_the_finished_windows(small) -> None:
    session = ReferenceSession(small)
    real = session.prefill
    calls = {"n": 0}

    def prefill(ids, all_logits=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(ids, all_logits)

    session.prefill = prefill
    r = perplexity(session, np.arange(40) % SMALL.vocab, 10)
    assert r.interrupted and len(r.windows) == 2 and not r.as_dict()["complete"]


def _extreme(prefill):
    """A session's prefill whose logits are finite but extreme (+-3e38: weights damaged)."""
    def wrapped(ids, all_logits=False):
        logits, stats = prefill(ids, all_logits)
        return np.where(np.arange(logits.shape[-1]) % 2, 3e38, -3e38).astype(np.float32) \
            * np.ones_like(logits), stats
    return wrapped


def test_a_perplexity_beyond_a_float_is_an_error_naming_the_window(small) -> None:
    """A mean NLL past 709 nats a token made e^x overflow: math's range error escaped as a
    traceback (strata perplexity on a GGUF with a damaged output norm)."""
    session = ReferenceSession(small)
    session.prefill = _extreme(session.prefill)
    with pytest.raises(ScoreError, match=r"window 1 \(tokens 0\.\.9\): a mean NLL of [0-9.e+]+ "
                       r"nats a token, whose perplexity \(e\^[0-9.e+]+\) is beyond a float's "
                       r"range: the logits are extreme"):
        perplexity(session, np.arange(20) % SMALL.vocab, 10)


@pytest.mark.parametrize("ids, ctx, message", [
    (list(range(10)), 1, "ctx is 1; a window needs at least 2 tokens"),
    (list(range(10)), 65, "ctx is 65; .* at most the model's context of 64"),
    ([3], 8, "the text has 1 token"),
    ([], 8, "the text has 0 token"),
])
def test_bad_requests(small, ids, ctx, message) -> None:
    with pytest.raises(ConfigError, match=message):
        perplexity(ReferenceSession(small), ids, ctx)


# ----------------------------------------------------------------------------- the command
def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


SYNTHETIC = {"n_layers": 2, "hidden": 128, "ffn": 128, "n_experts": 8, "top_k": 2,
             "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "vocab": 400, "context": 64,
             "seed": 4}


def config(tmp_path: Path, model: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": model, "format": "fp16", "backend": "reference",
                                    "expert_cache": 4, "prompts": [8]}))
    return path


def test_perplexity_command_matches_the_library(capsys, tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("The engine reads a prompt, turns it into tokens and runs every layer. "
                    "模型读取提示。 <|im_start|> is text here.\n" * 3)
    out_json = tmp_path / "ppl.json"
    code, out, err = cli(capsys, "perplexity", str(TINY_CONFIG), "--backend", "reference",
                         "--file", str(text), "--ctx", "32", "--json", str(out_json))
    assert code == 0, err
    doc = json.loads(out_json.read_text())
    from strata_rt.config.run.run_config import load_config
    from strata_rt.text.tokenizer import Tokenizer

    ids = Tokenizer.synthetic(512).encode(text.read_text(), parse_special=False)
    cfg = load_config(TINY_CONFIG).with_backend("reference")
    with Engine.open(cfg.engine_config()) as engine:
        want = perplexity(EngineSession(engine), ids, 32)
    assert doc["tokens"] == len(ids) and doc["ctx"] == 32
    assert doc["perplexity"] == want.perplexity
    assert [w["nll"] for w in doc["windows"]] == [w.nll for w in want.windows]
    assert f"perplexity: {want.perplexity:,.4f} over {want.predicted:,} predicted tokens" in out
    assert out.startswith("| window | first token | tokens |")


def test_perplexity_default_ctx_is_capped_at_the_context(capsys, tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("the the the of of and and to to in in is is it it " * 12)
    code, out, err = cli(capsys, "perplexity", str(config(tmp_path, {"synthetic": SYNTHETIC})),
                         "--file", str(text))
    assert code == 0, err
    assert "window(s) of up to 64 tokens" in out


def test_perplexity_gguf_without_tokenizer(capsys, small, tmp_path) -> None:
    path = write_qwen3_gguf(tmp_path / "bare.gguf", small)
    text = tmp_path / "t.txt"
    text.write_text("some text")
    code, out, err = cli(capsys, "perplexity", str(config(tmp_path, {"gguf": str(path)})),
                         "--file", str(text))
    assert code == 2 and out == ""
    assert "the file has no tokenizer" in err


def test_perplexity_beyond_a_float_names_the_model(capsys, small, tmp_path,
                                                  monkeypatch) -> None:
    from strata_rt.text.tokenizer_vocab import synthetic_vocab

    path = write_qwen3_gguf(tmp_path / "w.gguf", small,
                            keys=synthetic_vocab(SMALL.vocab).gguf_keys())
    real = EngineSession.prefill
    monkeypatch.setattr(EngineSession, "prefill", lambda self, ids, all_logits=False: _extreme(
        lambda i, a: real(self, i, a))(ids, all_logits))
    (tmp_path / "t.txt").write_text("the cache grows and the experts stream " * 4)
    code, out, err = cli(capsys, "-q", "perplexity", str(config(tmp_path, {"gguf": str(path)})),
                         "--file", str(tmp_path / "t.txt"), "--ctx", "8")
    assert code == 1 and out == "", err
    assert err.startswith(f"strata perplexity: {path}: window 1 (tokens 0..7): a mean NLL")


@pytest.mark.parametrize("args, message", [
    (["--ctx", "1"], "--ctx: got 1; a window needs at least 2 tokens"),
    (["--ctx", "65"], "--ctx: got 65; the model's context holds 64 tokens"),
    (["--file", "missing.txt"], "--file: missing.txt: no such file"),
    (["--file", "empty.txt"], "--file: empty.txt is empty"),
    (["--file", "one.txt"], "the text has 1 token(s); perplexity needs at least 2"),
    (["--file", "."], "--file: . is a folder"),
])
def test_perplexity_bad_inputs(capsys, tmp_path, monkeypatch, args, message) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("a")
    (tmp_path / "t.txt").write_text("a few words of text to score")
    if "--file" not in args:
        args = [*args, "--file", "t.txt"]
    code, out, err = cli(capsys, "perplexity", str(config(tmp_path, {"synthetic": SYNTHETIC})),
                         *args)
    assert code == 2 and out == "", err
    assert message in err and err.startswith("strata perplexity: ")


def test_perplexity_help_has_examples(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["perplexity", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "strata perplexity configs/tiny-qwen3moe.yaml" in out
    assert "--ctx" in out and "--file" in out and "--json" in out


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_cuda_perplexity_matches_transformers(name, golden_models, tmp_path) -> None:
    """On the GPU (half the experts resident): within 1e-3 relative of transformers."""
    case = GOLDEN["cases"][name]
    path = write_qwen3_gguf(tmp_path / f"{name}.gguf", golden_models[name])
    spec = golden_models[name].spec
    with Engine.open({"model": {"gguf": str(path), "format": CASES[name]["format"]},
                      "backend": "cuda",
                      "expert_cache": spec.n_layers * spec.n_experts // 2}) as engine:
        session = EngineSession(engine)
        for want in case["perplexity"]:
            got = perplexity(session, case["perplexity_sequence"], want["ctx"])
            assert got.perplexity == pytest.approx(want["perplexity"], rel=1e-3)
            for w, hw in zip(got.windows, want["windows"]):
                assert w.nll / w.predicted == pytest.approx(hw["mean_nll"], rel=1e-3)
