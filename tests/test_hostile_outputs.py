"""Outputs never destroy anything: a device, FIFO or socket is never moved, renamed or
replaced (refused before the run, exit 2); an output that is a file the run reads (the
config, the model, a prompt, text or profile file, the plugin list) or another output is
refused before the run and left as it was; a symlink is written through; a full disk keeps
the rows printed and the JSON written before (exit 1, naming the file)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from strata_rt.cli import common, main, run
from strata_rt.config.files.paths import (
    output_collisions,
    output_file_problem,
    results_file_problem,
    write_text_atomic,
)
from strata_rt.config.settings.engine_config import EngineConfig
from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.weights.model import MoESpec

TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16, 24]}


def config(tmp_path: Path, name: str = "run.yaml", **changes) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under folder: kind, and bytes of the regular files (symlinks as links)."""
    found = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            found[str(p)] = ("link", os.readlink(p))
        elif p.is_fifo():
            found[str(p)] = ("fifo",)
        elif p.is_char_device():
            found[str(p)] = ("chr", os.stat(p).st_rdev)
        elif p.is_file():
            found[str(p)] = ("file", p.read_bytes())
        else:
            found[str(p)] = ("dir",)
    return found


def special_file(tmp_path: Path, name: str = "node") -> Path:
    """A copy of /dev/full's node where the user may make one (root), else a FIFO: what the
    atomic write used to rename away to `<name>.partial`."""
    path = tmp_path / name
    try:
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 7))
    except (PermissionError, AttributeError):
        os.mkfifo(path)
    return path


# ---------------------------------------------------------------- devices, FIFOs, links
@pytest.mark.parametrize("where", ["--json", "output.json", "output.dump_r",
                                   "STRATA_PREFILL_DUMP_R", "STRATA_PREFILL_TRACE",
                                   "profile --out"])
def test_a_device_or_fifo_is_never_an_output(tmp_path, capsys, monkeypatch, where) -> None:
    node = special_file(tmp_path)
    args = ["run", str(config(tmp_path))]
    if where == "--json":
        args += ["--json", str(node)]
    elif where == "profile --out":
        args = ["profile", str(config(tmp_path)), "--out", str(node)]
    elif where.startswith("output."):
        args = ["run", str(config(tmp_path, output={where[7:]: str(node)}))]
    else:
        monkeypatch.setenv(where, str(node))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, *args)
    assert (code, out) == (2, ""), err
    assert "results are written to regular files only" in err
    assert snapshot(tmp_path) == before  # the node is where it was, nothing beside it


def test_the_engine_refuses_a_device_dump_and_its_partial_name(tmp_path) -> None:
    node = special_file(tmp_path)
    spec = MoESpec(2, 256, 256, 8, 2, format="iq3_xxs")
    for dump in (node, tmp_path / "d.bin"):
        if dump != node:
            (tmp_path / "d.bin.partial").mkdir()  # where the dump would move while written
        before = snapshot(tmp_path)
        with pytest.raises(ConfigError, match="dump_r"):
            Engine.open(EngineConfig(model={"spec": spec}, backend="reference", expert_cache=4,
                                     dump_r=str(dump)))
        assert snapshot(tmp_path) == before


def test_atomic_write_never_replaces_what_is_not_a_file(tmp_path) -> None:
    node = special_file(tmp_path)
    with pytest.raises(OSError, match="not replaced by a results file"):
        write_text_atomic(node, "x")
    assert output_file_problem(node).startswith("is a ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node"]


def test_a_symlink_is_written_through(tmp_path, capsys) -> None:
    target = tmp_path / "results" / "run.json"
    target.parent.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(target)  # dangling: the run creates what it points to
    code, _, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(link))
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["complete"] is True
    write_text_atomic(link, "second\n")  # an existing target is rewritten, the link kept
    assert link.is_symlink() and target.read_text() == "second\n"


def test_a_symlink_loop_is_refused_as_an_output(tmp_path, capsys) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    code, out, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(tmp_path / "a"))
    assert code == 2 and "--json: got" in err and "is a symlink loop" in err


# --------------------------------------------------------------- outputs that are inputs
def test_json_over_the_config_is_refused(tmp_path, capsys) -> None:
    cfg = config(tmp_path)
    (tmp_path / "hard.yaml").hardlink_to(cfg)
    (tmp_path / "soft.yaml").symlink_to(cfg)
    before = snapshot(tmp_path)
    for given in (cfg, tmp_path / "hard.yaml", tmp_path / "soft.yaml"):
        code, out, err = cli(capsys, "run", str(cfg), "--json", str(given))
        assert (code, out) == (2, ""), err
        assert f"--json: got '{given}'; is the config file ({cfg})" in err
        assert "writing there would destroy it" in err
    assert snapshot(tmp_path) == before


def test_outputs_that_are_the_model_or_a_prompt_file(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model

    gguf = write_moe_gguf(tmp_path / "m.gguf", Model.synthetic(MoESpec(2, 256, 256, 8, 2), 3,
                                                               "iq3_xxs"))
    toks = tmp_path / "t.txt"
    toks.write_text("1 2 3 4\n")
    cfg = config(tmp_path, model={"gguf": str(gguf)}, prompts=[{"file": str(toks)}])
    before = snapshot(tmp_path)
    for given, what in ((gguf, "the model's GGUF file"), (toks, "the file of prompts[0]")):
        code, out, err = cli(capsys, "run", str(cfg), "--json", str(given))
        assert (code, out) == (2, "") and f"is {what} ({given})" in err, err
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(gguf))
    code, out, err = cli(capsys, "run", str(cfg))
    assert code == 2 and "STRATA_PREFILL_DUMP_R (environment): got" in err, err
    with pytest.raises(ConfigError, match="dump_r: got .*is the model's GGUF file"):
        EngineConfig(model={"gguf": str(gguf), "format": "iq3_xxs"}).resolve()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["--json", "output.json"])
def test_results_replace_only_an_earlier_results_file(tmp_path, capsys, monkeypatch,
                                                        where) -> None:
    """An existing file the run does not read (another model, a token file) is not lost to
    a mistyped output path: only an empty file or a JSON document is rewritten."""
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    cfg = config(tmp_path, **({"output": {"json": "other.gguf"}} if where == "output.json"
                             else {}))
    before = snapshot(tmp_path)
    args = ["--json", str(other)] if where == "--json" else []
    code, out, err = cli(capsys, "run", str(cfg), *args)
    assert (code, out) == (2, ""), err
    assert "exists and is not a JSON document (it starts with b'GGUF" in err, err
    assert snapshot(tmp_path) == before
    earlier = tmp_path / "earlier.json"
    earlier.write_text('  {"old": 1}\n')
    assert results_file_problem(earlier) is None and results_file_problem(other) is not None
    assert results_file_problem(tmp_path / "new.json") is None
    monkeypatch.setenv("STRATA_PREFILL_TRACE", str(other))
    with pytest.raises(ConfigError, match="trace: got .*exists and is not a JSON document"):
        EngineConfig(model={"gguf": "m.gguf", "format": "iq3_xxs"}).resolve()
    monkeypatch.delenv("STRATA_PREFILL_TRACE")
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(other))  # no dump: refused once the
    EngineConfig(model={"gguf": "m.gguf", "format": "iq3_xxs"}).resolve()  # width is known
    with pytest.raises(ConfigError, match="STRATA_PREFILL_DUMP_R .environment.: got .*other"
                       ".gguf'; exists and is not a residual dump of a model of hidden size 256"):
        Engine.open(EngineConfig(model={"spec": MoESpec(2, 256, 256, 8, 2, format="iq3_xxs")},
                                 backend="reference", expert_cache=4))
    assert other.read_bytes() == b"GGUF\x03\x00\x00\x00" + bytes(64)


@pytest.mark.parametrize("where", ["dump_r", "STRATA_PREFILL_DUMP_R", ".partial"])
def test_the_library_never_empties_a_file_that_is_no_dump(tmp_path, monkeypatch,
                                                         where) -> None:
    """Engine.open with a dump_r naming a file that is no residual dump (or whose .partial
    name is one) refuses it before the file is touched, as `strata_rt run` does; a missing or
    empty file or an earlier dump of a model as wide is replaced."""
    notes = tmp_path / ("r.bin.partial" if where == ".partial" else "notes.txt")
    notes.write_text("keep me\n")
    dump = tmp_path / ("r.bin" if where == ".partial" else "notes.txt")
    if where == "STRATA_PREFILL_DUMP_R":
        monkeypatch.setenv(where, str(dump))
    spec = MoESpec(2, 256, 256, 8, 2, format="iq3_xxs")

    def open_engine(hidden: int = 256) -> Engine:
        return Engine.open(EngineConfig(
            model={"spec": MoESpec(2, hidden, 256, 8, 2, format="iq3_xxs")},
            backend="reference", expert_cache=4,
            **({} if where == "STRATA_PREFILL_DUMP_R" else {"dump_r": str(dump)})))

    label = {"dump_r": "dump_r", "STRATA_PREFILL_DUMP_R": "STRATA_PREFILL_DUMP_R (environment)",
             ".partial": "dump_r (its .partial file)"}[where]
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as e:
        open_engine()
    assert str(e.value).count(label) == 1 and f"{label}: got '{notes}'; exists and is not a " \
        "residual dump of a model of hidden size 256 (it starts with b'keep me\\n')" in str(e.value)
    assert snapshot(tmp_path) == before
    notes.unlink()
    for keep in (None, b"", bytes(8 + 4 * 256)):  # missing, empty, or an earlier dump
        if keep is not None:
            dump.write_bytes(keep)
        open_engine().close()
        assert dump.read_bytes() == b""
    dump.write_bytes(bytes(8 + 4 * spec.hidden))  # a dump of a model of another width
    with pytest.raises(ConfigError, match="not a residual dump of a model of hidden size 512"):
        open_engine(512)


@pytest.mark.parametrize("case", ["output.json is the config", "dump_r is json",
                                  "json is the dump's partial file",
                                  "profile --out is the profile", "bench json is a prompt"])
def test_more_collisions(tmp_path, capsys, case) -> None:
    toks = tmp_path / "t.txt"
    toks.write_text("1 2 3\n")
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"kind": "strata_rt routing profile", "n_layers": 2,
                                   "n_experts": 8, "counts": [[1] * 8, [2] * 8]}))
    if case == "output.json is the config":
        args = ["run", str(config(tmp_path, output={"json": "run.yaml"}))]
        words = "output.json: got"
    elif case == "dump_r is json":
        args = ["run", str(config(tmp_path, output={"json": "r.bin", "dump_r": "r.bin"}))]
        words = "is the path output.json also writes"
    elif case == "json is the dump's partial file":
        args = ["run", str(config(tmp_path, output={"dump_r": "r.bin"})), "--json",
                str(tmp_path / "r.bin.partial")]
        words = "output.dump_r (its .partial file): got"
    elif case == "profile --out is the profile":
        args = ["profile", str(config(tmp_path, profile=str(profile))), "--out", str(profile)]
        words = "--out: got"
    else:
        args = ["bench", str(config(tmp_path, prompts=[{"file": str(toks)}])), "--json",
                str(toks)]
        words = "is the file of prompts[0]"
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, *args)
    assert (code, out) == (2, "") and words in err, err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command, option", [("generate", "--prompt-file"),
                                             ("perplexity", "--file")])
def test_json_over_the_text_it_reads(tmp_path, capsys, command, option) -> None:
    from _generate_cases import TINY_CONFIG

    text = tmp_path / "t.txt"
    text.write_text("some text to read\n")
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, command, str(TINY_CONFIG), "--backend", "reference", option,
                         str(text), "--json", str(text))
    assert (code, out) == (2, ""), err
    assert f"--json: got '{text}'; is the {option} ({text})" in err
    assert snapshot(tmp_path) == before


def test_collisions_compare_files_not_spellings(tmp_path) -> None:
    a = tmp_path / "a.json"
    assert output_collisions({"--json": a}, {"the config": tmp_path / "run.yaml"}) == []
    assert output_collisions({"--json": tmp_path / "x" / ".." / "a.json",
                              "output.dump_r": a}, {}) != []


# ---------------------------------------------------------------- rows out, a full disk
def test_each_row_is_printed_as_its_prompt_finishes(tmp_path, capsys, monkeypatch) -> None:
    real = run.measure
    printed: list[str] = []

    def measure(engine, hidden, progress, label):
        printed.append(capsys.readouterr().out)
        return real(engine, hidden, progress, label)

    monkeypatch.setattr(run, "measure", measure)
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[16, 24, 8])))
    assert code == 0, err
    rows = [sum(line.startswith("|  ") for line in "".join(printed[:i + 1]).splitlines())
            for i in range(3)]
    assert rows == [0, 1, 2]  # before prompt 3 ran, prompts 1 and 2 were on the screen
    assert sum(line.startswith("|  ") for line in out.splitlines()) == 1


def test_bench_rows_are_printed_as_prompts_finish(tmp_path, capsys, monkeypatch) -> None:
    real = run.measure
    printed: list[str] = []

    def measure(engine, hidden, progress, label):
        printed.append(capsys.readouterr().out)
        return real(engine, hidden, progress, label)

    monkeypatch.setattr(run, "measure", measure)
    code, _, err = cli(capsys, "bench", str(config(tmp_path)), "--json",
                       str(tmp_path / "ab.json"))
    assert code == 0, err
    so_far = "".join(printed[:7])  # 2 warm-ups, 2 pairs of prompt 1, then prompt 2 starts
    assert [line.split("|")[1].strip() for line in so_far.splitlines()
            if line.startswith("| ")] == ["prompt tokens", "16"]


def test_a_full_disk_keeps_what_is_out(tmp_path, capsys, monkeypatch) -> None:
    target = tmp_path / "run.json"
    real = common.write_text_atomic
    writes = [0]

    def write(path, text):
        writes[0] += 1
        if writes[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(common, "write_text_atomic", write)
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[16, 24, 8])), "--json",
                         str(target))
    assert code == 1
    assert err.strip().splitlines()[-1] == (f"strata: {target}: No space left on device; the "
                                            "file keeps the results written before")
    rows = [line for line in out.splitlines() if line.startswith("|  ")]
    assert [r.split("|")[3].strip() for r in rows] == ["16", "24"]
    doc = json.loads(target.read_text())
    assert doc["complete"] is False and [r["tokens"] for r in doc["runs"]] == [16]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.yaml"]


def test_a_profile_is_written_whole(tmp_path, monkeypatch) -> None:
    from strata_rt.config.files import paths
    from strata_rt.schedule.vram.residency import RoutingProfile

    out = tmp_path / "p.json"
    RoutingProfile(np.ones((2, 8), np.int64)).save(out)
    before = out.read_bytes()

    def fail(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paths.os, "replace", fail)
    with pytest.raises(OSError):
        RoutingProfile(np.zeros((2, 8), np.int64)).save(out)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["p.json"]


def test_output_folders_name_what_they_are(tmp_path, capsys, monkeypatch) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    code, out, err = cli(capsys, "run", str(config(tmp_path, output={"dir": str(pipe)})))
    assert (code, out) == (2, "") and "output.dir: got" in err
    assert "is a FIFO (named pipe), not a folder" in err
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "a"))
    code, out, err = cli(capsys, "plugins")
    assert code == 2 and "STRATA_KERNEL_CACHE" in err and "is a symlink loop" in err


def test_a_dump_through_a_symlink_writes_its_target(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.engine import read_dump

    target = tmp_path / "dumps" / "r.bin"
    target.parent.mkdir()
    target.write_bytes(bytes(8 + 4 * 256))  # an earlier dump: one record of position 0
    link = tmp_path / "r.bin"
    link.symlink_to(target)
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(link))
    code, _, err = cli(capsys, "run", str(config(tmp_path)))
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    positions, _ = read_dump(target, 256)
    assert positions.tolist() == [0, 0]  # position 0 of each of the two prompts
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.bin"]


@pytest.mark.parametrize("where", ["output.dump_r", "STRATA_PREFILL_DUMP_R", ".partial"])
def test_a_dump_never_empties_a_file_that_is_no_dump(tmp_path, capsys, monkeypatch,
                                                    where) -> None:
    """The engine empties the dump's file when it opens: a text file named by mistake (or
    one at <dump>.partial, which the dump is moved to) was lost; it is refused, and an empty
    file or an earlier dump is replaced as before."""
    (tmp_path / "notes.txt").write_text("keep me\n")
    name = "r.bin" if where == ".partial" else "notes.txt"
    if where == ".partial":
        (tmp_path / "notes.txt").rename(tmp_path / "r.bin.partial")
    if where == "STRATA_PREFILL_DUMP_R":
        monkeypatch.setenv(where, str(tmp_path / name))
    cfg = config(tmp_path, **({} if where == "STRATA_PREFILL_DUMP_R"
                              else {"output": {"dump_r": name}}))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", str(cfg))
    assert (code, out) == (2, ""), err
    assert "exists and is not a residual dump of a model of hidden size 256 (it starts with " \
           "b'keep me\\n'); the dump replaces only an earlier one" in err, err
    assert snapshot(tmp_path) == before
    for keep in (b"", bytes(8 + 4 * 256)):  # empty, or an earlier dump: replaced
        (tmp_path / name).write_bytes(keep)
        (tmp_path / "r.bin.partial").unlink(missing_ok=True)
        code, _, err = cli(capsys, "run", str(cfg))
        assert code == 0, err


def test_an_output_under_a_fifo_names_it(tmp_path, capsys) -> None:
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    code, out, err = cli(capsys, "run", str(config(tmp_path)), "--json", str(pipe / "r.json"))
    assert (code, out) == (2, "")
    assert f"{pipe} is a FIFO (named pipe), so no folder can be created under it" in err
