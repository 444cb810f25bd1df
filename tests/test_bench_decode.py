"""bench/bench_decode.py on any machine: the tiny config on the reference backend, with a
stand-in llama-bench for the llama.cpp column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _fake_llama import fake_llama

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bench_decode.py"
TINY = ROOT / "configs" / "tiny-qwen3moe.yaml"


def _cli(args: list[str], cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=300, check=False)


def _run(tmp_path: Path, out: str, env: dict[str, str] | None = None
         ) -> tuple[subprocess.CompletedProcess, dict]:
    exe = fake_llama(tmp_path)
    done = _cli(["--config", str(TINY), "--backend", "reference", "--steps", "2", "--warmups",
                 "0", "--prompt", "8", "--paths", "staging", "--llama-bench", str(exe),
                 "--peer-dir", str(tmp_path / "files"), "--out", str(tmp_path / out)],
                tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    (js,) = (tmp_path / out).glob("decode-tiny-qwen3moe-*.json")
    return done, json.loads(js.read_text())


def test_help_teaches_the_peer_and_profiler_flags(tmp_path):
    done = _cli(["--help"], tmp_path)
    assert done.returncode == 0
    for flag in ("--llama-bench", "--peer-dir", "--llama-timeout", "--profile", "--paths"):
        assert flag in done.stdout


def test_the_table_carries_llama_cpps_column_for_the_same_model(tmp_path):
    done, doc = _run(tmp_path, "ok")
    peer = doc["llama"]
    assert peer["file"] == "tiny-qwen3moe-iq3.gguf" and not peer["reused"]
    assert (tmp_path / "files" / peer["file"]).stat().st_size == peer["file_bytes"]
    # quarter: the experts of 3/4 of the 2 layers in host memory; all: none
    assert "-ncmoe 1 -p 0 -n 2" in peer["regimes"]["quarter"]["command"]
    assert "-ncmoe 0 -p 0 -n 2" in peer["regimes"]["all"]["command"]
    assert all(str(tmp_path) not in g["command"] for g in peer["regimes"].values())
    for rec in doc["regimes"]:  # every greedy step's counters, not just the prompt's
        assert len(rec["step_bytes"]) == rec["steps"] == 2
        assert rec["host_syncs_per_step"] is not None
    head, _, *rows = doc["table"].splitlines()
    assert head.split("|")[-3:-1] == [" llama.cpp tok/s ", " ours/llama.cpp "]
    for rec, line in zip(doc["regimes"], rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-2] == "100.0"  # the stand-in's decode rate
        assert cells[-1] == f"{rec['decode_tokens_per_s'] / 100.0:.2f}x"
    assert "from an empty context" in doc["notes"][-2] + doc["notes"][-1]
    again, doc2 = _run(tmp_path, "again")
    assert doc2["llama"]["reused"]  # the file is written once


def test_a_failing_llama_bench_is_a_cell_not_a_traceback(tmp_path):
    done, doc = _run(tmp_path, "bad", {"FAKE_LLAMA_MODE": "fail"})
    assert "Traceback" not in done.stdout + done.stderr
    assert doc["llama"]["regimes"]["all"]["error"] == "exit code 3"
    for line in doc["table"].splitlines()[2:]:
        assert [c.strip() for c in line.strip("|").split("|")][-2:] == ["failed", "-"]


def test_the_budget_regime_keeps_the_configs_residency_and_counts_streamed_dense(tmp_path):
    """`budget` opens the engine as the config sets it (its expert_cache), has no llama.cpp
    counterpart, and where a dense ring streams the dense layers their bytes join the
    step's streamed bytes (the PCIe bound)."""
    cfg = tmp_path / "tiny-dense-stream.yaml"
    cfg.write_text(TINY.read_text() + "dense: stream\n")
    exe = fake_llama(tmp_path)
    done = _cli(["--config", str(cfg), "--backend", "reference", "--steps", "2", "--warmups",
                 "0", "--prompt", "8", "--paths", "staging", "--regimes", "budget,all",
                 "--llama-bench", str(exe), "--peer-dir", str(tmp_path / "files"),
                 "--out", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (js,) = (tmp_path / "out").glob("decode-tiny-dense-stream-*.json")
    doc = json.loads(js.read_text())
    assert list(doc["llama"]["regimes"]) == ["all"]  # no llama-bench run for the budget
    budget, every = doc["regimes"]
    assert budget["regime"] == "budget staging" and budget["resident"] == 8  # expert_cache
    assert every["resident"] == 16
    for rec in (budget, every):
        dense = rec["read_bytes_per_step"]["dense"]
        assert dense > 0 and rec["dense_streamed_per_step"] == dense
        assert rec["bytes_per_step"] >= dense
    cells = [c.strip() for c in doc["table"].splitlines()[2].strip("|").split("|")]
    assert cells[-2:] == ["-", "-"]
