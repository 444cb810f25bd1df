"""Results are never lost to a bad path or a Ctrl-C: output paths are checked before the run
(a folder given for a file, a path under a file, no permission: one message each, exit 2),
the JSON is rewritten after each prompt, and an interrupted run prints and keeps the prompts it
finished (exit 130)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml

from strata_rt.cli import main, run
from strata_rt.config.files.paths import output_dir_problem, output_file_problem, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16, 24]}


def config(tmp_path: Path, **changes) -> Path:
    doc = {**yaml.safe_load(yaml.safe_dump(TINY)), **changes}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder where no file can be created: permission bits for a normal user; root writes
    past those, but sysfs refuses new files to everyone."""
    if os.geteuid() != 0:
        folder = tmp_path / "locked"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    try:
        tempfile.mkstemp(dir="/sys")
    except OSError:
        return Path("/sys")
    pytest.skip("running as root where /sys takes new files: no unwritable folder to test")


# ------------------------------------------------------------------------------ path checks
def test_path_problems(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    assert output_file_problem(tmp_path / "new" / "deeper" / "r.json") is None
    assert output_file_problem(tmp_path / "afile") is None  # rewritten
    assert output_file_problem(Path(os.devnull)).startswith(
        "is a character device; results are written to regular files only")
    assert output_file_problem(tmp_path).startswith("is a directory")
    assert output_file_problem(tmp_path / "afile" / "sub" / "r.json") == (
        f"{tmp_path / 'afile'} is a file, so no folder can be created under it")
    assert output_dir_problem(tmp_path / "afile") == "is a file, not a folder"
    assert output_dir_problem(tmp_path / "afile" / "out").startswith(f"{tmp_path / 'afile'} is")
    locked = unwritable_folder(tmp_path)
    assert output_file_problem(locked / "r.json") == f"no permission to write in {locked}"
    assert output_dir_problem(locked / "out") == f"no permission to write in {locked}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] + (
        ["locked"] if locked.parent == tmp_path else [])  # the probes left nothing behind


def test_atomic_write_keeps_mode_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    write_text_atomic(target, "one")
    target.chmod(0o640)
    write_text_atomic(target, "two")
    assert target.read_text() == "two" and target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(OSError, match="is a character device; not replaced"):
        write_text_atomic(Path(os.devnull), "ignored")  # never renamed over
    assert Path(os.devnull).is_char_device()


@pytest.mark.parametrize("case", ["folder", "under a file", "no permission"])
@pytest.mark.parametrize("where", ["run --json", "profile --out", "bench --json",
                                   "output.json", "output.dir", "output.dump_r"])
def test_bad_output_paths_fail_before_the_run(tmp_path: Path, capsys, case: str,
                                              where: str) -> None:
    (tmp_path / "afile").write_text("x")
    target = {"folder": tmp_path, "under a file": tmp_path / "afile" / "r.json",
              "no permission": unwritable_folder(tmp_path) / "r.json"}[case]
    if where == "output.dir" and case == "folder":
        target = tmp_path / "afile"  # the mistake for a folder: a file
    words = {"folder": "is a directory; give a file path",
             "under a file": f"{tmp_path / 'afile'} is a file, so no folder can be created",
             "no permission": f"no permission to write in {target.parent}"}[case]
    if where == "output.dir":
        words = "is a file, not a folder" if case == "folder" else words
    cfg = str(config(tmp_path))
    if where.startswith("output."):
        key = where.split(".")[1]
        cfg = str(config(tmp_path, output={key: str(target)}))
        args = ["run", cfg]
        shown = f"  - {where}: got '{target}'; {words}"
    else:
        command, option = where.split()
        args = [command, cfg, option, str(target)]
        shown = f"  - {option}: got '{target}'; {words}"
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""  # nothing ran
    assert shown in err, err


# ------------------------------------------------------------------------------ lose nothing
def interrupt_at(monkeypatch, call: int, seen: list) -> None:
    """Ctrl-C during the `call`-th prefill of strata run/bench (counting from 1); `seen`
    receives what the JSON file held at that moment."""
    real = run.measure
    count = [0]

    def measure(engine, hidden, progress, label):
        count[0] += 1
        if count[0] == call:
            seen.append(call)
            raise KeyboardInterrupt
        return real(engine, hidden, progress, label)

    monkeypatch.setattr(run, "measure", measure)


def test_run_writes_json_after_each_prompt_and_keeps_rows_on_ctrl_c(tmp_path: Path, capsys,
                                                                    monkeypatch) -> None:
    target = tmp_path / "out" / "run.json"
    on_disk = []
    real_measure = run.measure

    def measure(engine, hidden, progress, label):
        if target.exists():
            on_disk.append(len(json.loads(target.read_text())["runs"]))
        if len(on_disk) == 2:
            raise KeyboardInterrupt
        return real_measure(engine, hidden, progress, label)

    monkeypatch.setattr(run, "measure", measure)
    cfg = config(tmp_path, prompts=[16, 24, 8, 12])
    code, out, err = cli(capsys, "run", str(cfg), "--json", str(target))
    assert code == 130
    assert on_disk == [1, 2]  # before prompts 2 and 3 the file held the finished ones
    rows = [line for line in out.splitlines() if line.startswith("|  ")]
    assert [r.split("|")[3].strip() for r in rows] == ["16", "24"]
    assert "strata run: interrupted after 2 of 4 prompt runs" in err
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and [r["tokens"] for r in doc["runs"]] == [16, 24]
    assert doc["backend"] == "reference" and doc["hardware"]


def test_run_json_is_marked_complete(tmp_path: Path, capsys) -> None:
    target = tmp_path / "run.json"
    assert cli(capsys, "run", str(config(tmp_path)), "--json", str(target))[0] == 0
    doc = json.loads(target.read_text())
    assert doc["complete"] is True and len(doc["runs"]) == 2


def test_bench_keeps_finished_prompts_on_ctrl_c(tmp_path: Path, capsys, monkeypatch) -> None:
    seen: list = []
    interrupt_at(monkeypatch, 6, seen)  # 2 pairs of prompt 1, then B of prompt 2's first pair
    target = tmp_path / "ab.json"
    code, out, err = cli(capsys, "bench", str(config(tmp_path)), "--json", str(target))
    assert code == 130 and seen == [6]
    assert "interrupted after 1 of 2 prompts" in err
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and [r["tokens"] for r in doc["rows"]] == [16]
    assert len(doc["rows"][0]["a_s"]) == 2
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows == ["prompt tokens", "16"]


def test_profile_keeps_finished_prompts_on_ctrl_c(tmp_path: Path, capsys, monkeypatch) -> None:
    from strata_rt.engine import Engine
    from strata_rt.schedule.vram.residency import RoutingProfile

    real = Engine.prefill
    calls = [0]

    def prefill(self, hidden, record_routing=False):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(self, hidden, record_routing)

    monkeypatch.setattr(Engine, "prefill", prefill)
    out_path = tmp_path / "p.json"
    code, out, err = cli(capsys, "profile", str(config(tmp_path)), "--out", str(out_path))
    assert code == 130 and "interrupted after 1 of 2 prompts" in err
    assert "routing counts of 16 tokens" in out
    counts = RoutingProfile.load(out_path).counts
    assert (counts.sum(axis=1) == 16 * 2).all()  # top-2 choices of the 16 finished tokens


def test_ctrl_c_before_any_prompt(tmp_path: Path, capsys, monkeypatch) -> None:
    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "open_engine", interrupted)
    target = tmp_path / "run.json"
    code, out, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(target))
    assert (code, out, err) == (130, "", "strata run: interrupted\n")
    assert not target.exists()


