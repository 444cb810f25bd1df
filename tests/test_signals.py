"""SIGTERM (what timeout, schedulers and containers send) keeps what Ctrl-C keeps: the rows
of finished prompts printed, JSON with `complete: false`, a profile of the finished prompts,
the finished windows of a perplexity and the tokens generated; exit 143. Conversion workers
end with their parent. In-process tests send the real signal to this process while a command
runs (main() handles it as the command line does); one run and the conversion use a fresh
process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from _cli import ROOT
from _generate_cases import TINY_CONFIG

from strata_rt.cli import main, run
from strata_rt.engine import Engine
from strata_rt.report import interrupts

TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16, 24, 8]}


def config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def sigterm_on_call(monkeypatch, owner, name: str, call: int) -> None:
    """owner.name sends SIGTERM to this process on its `call`-th call (from 1), as a
    scheduler would while that call runs."""
    real = getattr(owner, name)
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


def test_sigterm_during_run_keeps_rows_and_json(tmp_path, capsys, monkeypatch) -> None:
    sigterm_on_call(monkeypatch, run, "measure", 3)
    target = tmp_path / "run.json"
    code, out, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(target))
    assert code == 143
    assert "strata run: terminated by SIGTERM after 2 of 3 prompt runs; the results above are " \
           "the finished ones" in err
    rows = [line.split("|")[3].strip() for line in out.splitlines() if line.startswith("|  ")]
    assert rows == ["16", "24"]
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and [r["tokens"] for r in doc["runs"]] == [16, 24]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored after


def test_sigterm_during_bench_and_profile(tmp_path, capsys, monkeypatch) -> None:
    sigterm_on_call(monkeypatch, Engine, "prefill", 2)
    out_path = tmp_path / "p.json"
    code, out, err = cli(capsys, "profile", str(config(tmp_path)), "--out", str(out_path))
    assert code == 143 and "terminated by SIGTERM after 1 of 3 prompts" in err
    from strata_rt.schedule.vram.residency import RoutingProfile

    assert (RoutingProfile.load(out_path).counts.sum(axis=1) == 16 * 2).all()
    monkeypatch.undo()
    sigterm_on_call(monkeypatch, run, "measure", 6)  # in prompt 2's first pair
    target = tmp_path / "ab.json"
    code, out, err = cli(capsys, "bench", str(config(tmp_path)), "--json", str(target))
    assert code == 143 and "terminated by SIGTERM after 1 of 3 prompts" in err
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and [r["tokens"] for r in doc["rows"]] == [16]


def test_sigterm_during_perplexity_keeps_the_windows(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.text import perplexity

    text = tmp_path / "t.txt"
    text.write_text("the engine streams experts through a ring of slots. " * 20)
    sigterm_on_call(monkeypatch, perplexity, "window_nll", 3)
    target = tmp_path / "ppl.json"
    code, out, err = cli(capsys, "perplexity", str(TINY_CONFIG), "--backend", "reference",
                         "--file", str(text), "--ctx", "32", "--json", str(target))
    assert code == 143
    assert "strata perplexity: terminated by SIGTERM after 2 window(s)" in err
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and len(doc["windows"]) == 2
    assert out.count("\n|      ") == 2 and "perplexity: " in out  # the rows, as they finished


def test_sigterm_during_generate_keeps_the_tokens(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.text import generate

    # greedy steps after the first take their token from the session (prefill_argmax)
    sigterm_on_call(monkeypatch, generate.EngineSession, "prefill_argmax", 3)
    target = tmp_path / "gen.json"
    code, out, err = cli(capsys, "generate", str(TINY_CONFIG), "--backend", "reference",
                         "--prompt", "The experts stream", "-n", "20", "--ignore-eos", "--ids",
                         "--json", str(target))
    assert code == 143
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and doc["stop"] == "interrupted"
    assert f"terminated by SIGTERM after {len(doc['ids'])} of 20 tokens" in err
    assert 1 <= len(doc["ids"]) < 20
    assert out.split("\n")[0].split() == [str(t) for t in doc["ids"]]


def test_sigterm_during_a_prefill_leaves_the_dump_marked_partial(tmp_path, capsys,
                                                                 monkeypatch) -> None:
    from strata_rt import engine

    dump = tmp_path / "r.bin"
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(dump))
    sigterm_on_call(monkeypatch, engine, "dump_residual", 2)  # prompt 2's only chunk
    code, _, err = cli(capsys, "run", str(config(tmp_path)))
    assert code == 143 and "after 1 of 3 prompt runs" in err
    assert not dump.exists()  # nothing that looks whole
    positions, _ = engine.read_dump(tmp_path / "r.bin.partial", 256)
    assert positions.tolist() == [0]  # prompt 1's dumped row, kept


def test_a_second_sigterm_lets_the_results_be_written(tmp_path, capsys, monkeypatch) -> None:
    real = run.write_json
    sigterm_on_call(monkeypatch, run, "measure", 2)

    def write_json(path, doc, final=True):
        if final:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler insists, while we save
        real(path, doc, final)

    monkeypatch.setattr(run, "write_json", write_json)
    target = tmp_path / "run.json"
    code, _, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(target))
    assert code == 143 and json.loads(target.read_text())["runs"][0]["tokens"] == 16


def test_ctrl_c_and_sigterm_codes() -> None:
    with interrupts.signals_as_interrupts():
        assert (interrupts.how(), interrupts.exit_code()) == ("interrupted", 130)
        with pytest.raises(interrupts.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        assert (interrupts.how(), interrupts.exit_code()) == ("terminated by SIGTERM", 143)
        assert isinstance(interrupts.Terminated(signal.SIGTERM), KeyboardInterrupt)


def default_sigint() -> None:
    """In the child before it runs: SIGINT back to its default. A shell without job control
    starts background commands (a test run under nohup, a CI step sent to the background)
    with SIGINT ignored, which Python then keeps; a user's Ctrl-C reaches a foreground run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGINT, 130, "interrupted after"),
    (signal.SIGTERM, 143, "terminated by SIGTERM after")])
def test_a_signal_in_a_fresh_process(tmp_path, sig, code, said) -> None:
    """A real Ctrl-C or SIGTERM once the JSON shows a finished prompt: the finished prompts'
    rows are printed and kept in the JSON, marked incomplete."""
    target = tmp_path / "run.json"
    cfg = config(tmp_path, prompts=[16] * 400)
    proc = subprocess.Popen([sys.executable, "-m", "strata_rt.cli", "run", str(cfg), "--json",
                             str(target)], cwd=ROOT, preexec_fn=default_sigint,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not target.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in err, err
    doc = json.loads(target.read_text())
    done = len(doc["runs"])
    assert doc["complete"] is False and 1 <= done < 400
    assert f"{said} {done} of 400 prompt runs" in err
    assert out.count("\n|     ") == done  # one table row per finished prompt


CONVERT = textwrap.dedent("""
    import sys
    import numpy as np
    from strata_rt.report import interrupts
    from strata_rt.weights.model import Model

    if __name__ == "__main__":
        with interrupts.signals_as_interrupts():
            try:
                m = Model.from_gguf(sys.argv[1], "iq3_xxs", workers=2)
                m.write_layers(np.empty((2, m.spec.n_experts, m.layout.blob_bytes), np.uint8))
                print("finished")
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(interrupts.exit_code())
""")


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_conversion_workers_end_with_their_parent(tmp_path, signum, code) -> None:
    """SIGTERM or Ctrl-C while two workers convert: the parent exits at once (not after the
    experts in flight), and the workers are gone within 2 s of the signal."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_gguf_model import _mixed_file

    path = _mixed_file(tmp_path, n_experts=8, hidden=512, ffn=512)
    script = tmp_path / "convert_it.py"
    script.write_text(CONVERT)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], cwd=ROOT,
                            preexec_fn=default_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    errors: list[str] = []
    threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True).start()

    def workers() -> list[int]:
        found = []
        for c in children(proc.pid):
            try:
                if "--multiprocessing-fork" in Path(f"/proc/{c}/cmdline").read_text():
                    found.append(c)
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 120
    while len(workers()) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids = workers()
    assert len(pids) == 2, errors
    time.sleep(1.0)  # converting by now
    sent = time.monotonic()
    proc.send_signal(signum)
    out = proc.stdout.read()
    proc.wait(timeout=30)
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() - sent < 10:
        time.sleep(0.02)
    gone_after = time.monotonic() - sent
    assert proc.returncode == code and out.strip() == "interrupted", errors
    assert not any(Path(f"/proc/{p}").exists() for p in pids)
    assert gone_after < 2.0
