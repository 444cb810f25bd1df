"""The `strata` commands that open an engine, on the reference backend: run, bench and profile
(their summaries, JSON files and exit codes, the demo config end to end), the progress display,
verbosity and logging (library modules log instead of printing)."""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import yaml
from _cli import ROOT, strata

from strata_rt.cli import build_parser, main
from strata_rt.formats.registry import registry


def test_usage_errors_exit_2() -> None:
    done = strata("run")
    assert done.returncode == 2 and "config" in done.stderr
    done = strata("bench", "configs/demo.yaml", "--ab", "STRATA_NOPE")
    assert done.returncode == 2 and "STRATA_PREFILL_GATHER_ONE" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_ab_offers_only_switches_read_per_prompt(capsys) -> None:
    with pytest.raises(SystemExit) as info:  # read once at open: A and B would be the same
        main(["bench", "configs/demo.yaml", "--ab", "STRATA_CUDA_GRAPH"])
    assert info.value.code == 2
    assert "invalid choice: 'STRATA_CUDA_GRAPH'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "STRATA_PREFILL_GATHER_ONE" in help_text and "per prompt" in help_text


def test_bad_config_exit_2_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {synthetic: {n_layers: 0}}\nformat: nope\nprompts: [1]\n")
    done = strata("run", str(path), "--backend", "reference")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for key in ("model.synthetic.n_layers", "model.synthetic.hidden", "format"):
        assert f"  - {key}: " in done.stderr, done.stderr
    assert "vram" not in done.stderr  # no VRAM policy: the backends' default


def test_demo_runs_on_the_reference_backend(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("STRATA_WALK_MIN_TOKENS", raising=False)  # as a user runs it
    out = tmp_path / "demo.json"
    done = strata("run", "configs/demo.yaml", "--backend", "reference", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "backend reference" in done.stdout and "resident experts: 32 of 128" in done.stdout
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [r["tokens"] for r in runs] == [4, 200, 1100]
    assert all(r["stats"]["tokens"] == r["tokens"] and r["stats"]["experts_streamed"] > 0
               for r in runs)
    # 4 tokens ride the staging ring (routed experts only), the others walk (all 96 streamed)
    streamed = [r["stats"]["experts_streamed"] for r in runs]
    assert streamed[0] < streamed[1] == streamed[2] == 96
    assert doc["hardware"] and doc["resident_experts"] == 32


def _tiny_config(tmp_path: Path, **extra) -> Path:
    doc = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                   "top_k": 2, "seed": 5}},
           "format": "iq3_xxs", "backend": "reference", "expert_cache": 4,
           "prompts": [16, 24], **extra}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_run_summary_and_json(tmp_path: Path, capsys) -> None:
    cfg = _tiny_config(tmp_path, output={"dir": "out", "json": "run.json"}, repeats=2)
    assert main(["run", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "resident experts: 4 of 16" in out and "tokens/s" in out
    runs = json.loads((tmp_path / "out" / "run.json").read_text())["runs"]
    assert [(r["tokens"], r["repeat"]) for r in runs] == [(16, 0), (24, 0), (16, 1), (24, 1)]
    assert all(r["stats"]["experts_streamed"] > 0 for r in runs)


def test_bench_ab_table_and_json(tmp_path: Path, capsys) -> None:
    target = tmp_path / "ab.json"
    assert main(["bench", str(_tiny_config(tmp_path)), "--pairs", "2", "--prompts", "20",
                 "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "| prompt tokens | A ms (each run) | B ms (each run) | change %" in out
    doc = json.loads(target.read_text())
    assert doc["switch"] == "STRATA_PREFILL_GATHER_ONE" and doc["hardware"]
    row = doc["rows"][0]
    assert row["tokens"] == 20 and len(row["a_s"]) == len(row["b_s"]) == 2
    # the arms flip the open engine's config field, which the driver reads on every chunk:
    # A and B launched different gathers, and the environment was never touched
    assert doc["arms_differ"] is True
    assert "STRATA_PREFILL_GATHER_ONE" not in os.environ


def test_output_path_that_is_a_directory(tmp_path: Path, capsys) -> None:
    cfg = str(_tiny_config(tmp_path))
    for args, option in ((["run", cfg, "--json", str(tmp_path)], "--json"),
                         (["profile", cfg, "--out", str(tmp_path)], "--out")):
        assert main(args) == 2  # refused before the engine opens
        err = capsys.readouterr().err
        assert f"  - {option}: got '{tmp_path}'; is a directory; give a file path" in err


def test_bad_mmq_kernel_is_refused_on_any_backend(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "f17")
    assert main(["run", str(_tiny_config(tmp_path))]) == 2  # reference backend, iq3_xxs
    err = capsys.readouterr().err
    variants = ", ".join(registry()["iq3_xxs"].mmq_variants())
    assert f"STRATA_MMQ_KERNEL (environment): got 'f17'; format iq3_xxs offers {variants}" in err


def test_profile_prints_where_it_wrote(tmp_path: Path, capsys, monkeypatch) -> None:
    cfg = _tiny_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["profile", str(cfg), "--out", "profiles/p.json"]) == 0
    where = (tmp_path / "profiles" / "p.json").resolve()
    assert f"`profile: {where}`" in capsys.readouterr().out


def test_profile_round_trip(tmp_path: Path, capsys) -> None:
    from strata_rt.schedule.vram.residency import RoutingProfile

    cfg = _tiny_config(tmp_path)
    prof = tmp_path / "p.json"
    assert main(["profile", str(cfg), "--out", str(prof)]) == 0
    counts = RoutingProfile.load(prof).counts
    assert counts.shape == (2, 8) and (counts.sum(axis=1) == (16 + 24) * 2).all()
    capsys.readouterr()
    assert main(["run", str(_tiny_config(tmp_path, profile="p.json"))]) == 0
    RoutingProfile(counts[:1]).save(tmp_path / "one_layer.json")
    assert main(["run", str(_tiny_config(tmp_path, profile="one_layer.json"))]) == 2
    err = capsys.readouterr().err
    assert "profile: got 'one_layer.json'" in err and "1 layers x 8 experts" in err


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_per_chunk_and_layer(tty: bool) -> None:
    from strata_rt.report.progress import Progress

    stream = _Stream(tty)
    p = Progress(stream, delay_s=0.0, interval_s=0.0)
    p.start("prompt 1/1")
    for chunk in range(2):
        for layer in range(3):
            p(chunk, 2, layer, 3)
    p.end()
    if tty:  # one redrawn line per layer, cleared at the end
        assert stream.text.count("\r\x1b[K") == 7 and "chunk 2/2 layer 3/3" in stream.text
        assert stream.text.endswith("\r\x1b[K")
    else:  # a log gets one line per finished chunk
        assert stream.text.splitlines()[0].startswith("prompt 1/1: chunk 1/2 done")
        assert len(stream.text.splitlines()) == 2 and "\r" not in stream.text
    quiet = _Stream(True)
    q = Progress(quiet, delay_s=60.0)
    q.start("short")
    q(0, 1, 0, 3)
    q.end()
    assert quiet.text == ""  # short prompts print nothing


# ------------------------------------------------------------------------------ logging
def test_verbosity_options(tmp_path: Path, capsys) -> None:
    cfg, target = str(_tiny_config(tmp_path)), str(tmp_path / "r.json")
    assert main(["run", cfg, "--json", target]) == 0
    err = capsys.readouterr().err
    assert f"strata: wrote {target}\n" in err and "updated" not in err
    assert main(["-q", "run", cfg, "--json", target]) == 0
    assert "wrote" not in capsys.readouterr().err
    assert main(["-v", "run", cfg, "--json", target]) == 0
    err = capsys.readouterr().err
    assert f"strata: [strata_rt.cli.common] debug: updated {target}" in err  # after prompt 1
    assert f"strata: [strata_rt.cli.common] wrote {target}" in err
    assert main(["-q", "--verbose", "run", cfg]) == 0  # -v and -q add up: notices again
    logger = logging.getLogger("strata_rt")
    assert logger.level == logging.NOTSET and not logger.handlers  # main() left no trace


def test_quiet_turns_progress_off() -> None:
    from strata_rt.cli.common import progress_for

    parser = build_parser()
    assert progress_for(parser.parse_args(["run", "x.yaml"])).enabled
    assert not progress_for(parser.parse_args(["-q", "run", "x.yaml"])).enabled


def test_a_log_record_clears_the_progress_line(monkeypatch) -> None:
    from strata_rt.report import log
    from strata_rt.report.progress import Progress

    stream = _Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    with log.configured(0):
        bar = Progress(stream, delay_s=0.0, interval_s=0.0)
        bar.start("prompt 1/1")
        bar(0, 1, 0, 2)
        logging.getLogger("strata_rt.test").warning("slow %s", "disk")
        bar(0, 1, 1, 2)  # the bar comes back on the next layer
    assert stream.text.split("\r\x1b[K")[1:] == [
        "prompt 1/1: chunk 1/1 layer 1/2 [##########          ]    0.0 s",
        "strata: warning: slow disk\n",
        "prompt 1/1: chunk 1/1 layer 2/2 [####################]    0.0 s"]


#: modules that write to stderr themselves: progress displays and the CLI's log handler (the
#: CLI, which owns the terminal, is not scanned)
PRINTS_ALLOWED = {"progress.py", "eta.py", "log.py"}
def _stderr_writes(tree: ast.AST) -> list[int]:
    """Lines of print(...) calls, warnings.warn(...) calls and any use of sys.stderr: code,
    not text that happens to contain those words."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "print":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id, node.attr) in (("sys", "stderr"), ("warnings", "warn"))):
            lines.append(node.lineno)
    return sorted(lines)


def test_library_modules_log_instead_of_printing() -> None:
    """Library modules log through logging.getLogger(__name__); only progress displays and
    the CLI write to stderr, so an embedding program controls every message."""
    offenders = []
    for path in sorted((ROOT / "strata_rt").rglob("*.py")):
        rel = path.relative_to(ROOT / "strata_rt")
        if rel.parts[0] in ("cli", "quants", "kernels") or rel.name in PRINTS_ALLOWED:
            continue
        text = path.read_text()
        lines = text.splitlines()
        offenders += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in _stderr_writes(ast.parse(text))]
    assert offenders == [], "\n".join(offenders)


def test_the_print_finder_sees_code_not_text() -> None:
    code = 'x = "print(1)"\nprint(2)\nimport sys\nsys.stderr.write("")\nwarnings.warn("w")\n'
    assert _stderr_writes(ast.parse(code)) == [2, 4, 5]
