"""Hostile inputs on the config and command-line side: each ends in one message naming the
input, exit 2 (1 for the plugin list, as every plugin problem), no traceback, no hang and
bounded memory. Files that are FIFOs, devices, folders, symlink loops, binary or not UTF-8;
digits that are not ASCII; sizes no machine holds; profiles with counts that are not whole
numbers. Hostile YAML (deep, an alias bomb, duplicate keys, `1_000`): test_hostile_yaml.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from _cli import ROOT, strata

from strata_rt.cli import main
from strata_rt.cli.common import parse_prompts
from strata_rt.config.files import input_files
from strata_rt.config.run.prompts import check_token_ids, integer_ids, read_token_file
from strata_rt.config.settings.engine_config import EngineConfig
from strata_rt.errors import ConfigError
from strata_rt.schedule.vram.residency import RoutingProfile
from strata_rt.weights.model import SMALL_SPEC

TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16]}
TINY_TEXT = yaml.safe_dump(TINY)


@pytest.fixture(autouse=True)
def no_hang():
    """A test that blocks (a FIFO opened for reading, a device read to the end) fails after
    60 s instead of hanging the suite."""
    def expired(*_):
        raise TimeoutError("blocked for 60 s")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(capsys, args: list[str], words: str, code: int = 2) -> str:
    """Runs the command; asserts the exit code, that nothing ran (stdout empty) and that the
    one message holds `words`."""
    got, out, err = cli(capsys, *args)
    assert (got, out) == (code, ""), err
    assert words in err, err
    return err


# ----------------------------------------------------------------------- what a file is
def fifo(tmp_path: Path, name: str = "pipe") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    return tmp_path / "loop1"


@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a FIFO (named pipe); expected a regular file"),
    ("device", "is a character device; expected a regular file"),
    ("folder", "is a directory; expected a regular file"),
    ("loop", "is a symlink loop"),
    ("dangling", "is a symlink to a missing file"),
    ("not utf-8", "is not UTF-8 text (byte 15: invalid start byte)"),
    ("binary", "is a binary file (a NUL byte at offset 3)"),
    ("too large", "is 2,003 bytes; a YAML run config is at most 1,000 bytes"),
])
def test_a_config_that_is_not_a_readable_text_file(tmp_path, capsys, monkeypatch, kind,
                                                   words) -> None:
    monkeypatch.setattr(input_files, "CONFIG_LIMIT", 1_000)
    from strata_rt.config.run import run_config as config

    monkeypatch.setattr(config, "CONFIG_LIMIT", 1_000)
    path = {"fifo": lambda: fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "folder": lambda: tmp_path, "loop": lambda: symlink_loop(tmp_path),
            "dangling": lambda: (tmp_path / "gone").symlink_to(tmp_path / "nothing")
            or tmp_path / "gone",
            "not utf-8": lambda: write(tmp_path, "backend: refere\xff"),
            "binary": lambda: write(tmp_path, "abc\0def"),
            "too large": lambda: write(tmp_path, "# " + "x" * 2_000 + "\n")}[kind]()
    if kind == "not utf-8":
        path.write_bytes(b"backend: refere\xffnce\n")
    refused(capsys, ["run", str(path)], f"cannot read the config file: {words}")
    if kind == "fifo":
        assert path.is_fifo()


@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a FIFO (named pipe); expected a regular file"),
    ("device", "is a character device; expected a regular file"),
    ("loop", "is a symlink loop"),
])
@pytest.mark.parametrize("key", ["model.gguf", "prompts[0].file", "profile"])
def test_config_paths_name_what_they_are(tmp_path, capsys, kind, words, key) -> None:
    """A FIFO or a device was called 'no such file' (or, read, blocked the run)."""
    path = {"fifo": lambda: fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "loop": lambda: symlink_loop(tmp_path)}[kind]()
    doc = dict(TINY)
    if key == "model.gguf":
        doc["model"] = {"gguf": str(path)}
    elif key == "profile":
        doc["profile"] = str(path)
    else:
        doc["prompts"] = [{"file": str(path)}]
    err = refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))],
                  f"{key}: got '{path}'; {words}")
    assert "no such file" not in err


@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a FIFO (named pipe); expected a regular file"),
    ("loop", "is a symlink loop"),
    ("not utf-8", "is not UTF-8 text (byte 9: invalid start byte)"),
    ("binary", "is a binary file (a NUL byte at offset 0)"),
])
def test_the_plugin_list_names_what_it_is(tmp_path, capsys, kind, words) -> None:
    path = {"fifo": lambda: fifo(tmp_path), "loop": lambda: symlink_loop(tmp_path),
            "not utf-8": lambda: tmp_path / "p.yaml", "binary": lambda: tmp_path / "p.yaml"
            }[kind]()
    if kind == "not utf-8":
        path.write_bytes(b"plugins: \xff\n")
    if kind == "binary":
        path.write_bytes(b"\0plugins: []\n")
    try:
        refused(capsys, ["--plugins", str(path), "plugins"], words, code=1)
    finally:
        os.environ.pop("STRATA_PLUGINS", None)
        from strata_rt.formats.registry import registry

        registry(reload=True)


def test_an_empty_plugins_option(capsys) -> None:
    refused(capsys, ["--plugins", "", "plugins"], "--plugins: got ''; expected the path")


def test_the_plugin_list_refuses_duplicate_keys(tmp_path) -> None:
    from strata_rt.errors import PluginError
    from strata_rt.formats.registry import read_plugins_yaml

    path = write(tmp_path, "plugins: []\nplugins: [{module: x}]\n", "plugins.yaml")
    with pytest.raises(PluginError, match="duplicate key 'plugins'"):
        read_plugins_yaml(path)


@pytest.mark.parametrize("option", ["--prompt-file", "--file"])
@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a FIFO (named pipe); expected a regular file"),
    ("device", "is a character device; expected a regular file"),
    ("binary", "is a binary file (a NUL byte at offset 2)"),
])
def test_text_files_on_the_command_line(tmp_path, capsys, option, kind, words) -> None:
    path = {"fifo": lambda: fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "binary": lambda: tmp_path / "t.txt"}[kind]()
    if kind == "binary":
        path.write_bytes(b"hi\0there")
    command = "generate" if option == "--prompt-file" else "perplexity"
    refused(capsys, [command, str(write(tmp_path, TINY_TEXT)), option, str(path)],
            f"{option}: {path} {words}")


# ------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("word", ["1_000", "１２", "١٢", "12.0", "0x10", "1e3"])
def test_token_files_take_ascii_digits_only(tmp_path, word) -> None:
    path = write(tmp_path, f"1 2 {word} 4\n", "t.txt")
    with pytest.raises(ConfigError, match=f"{word!r} \\(token 2\\) is not one"):
        read_token_file(path)
    assert list(read_token_file(write(tmp_path, "1, +2\n-0 4", "ok.txt"))) == [1, 2, 0, 4]


def test_token_file_words_are_quoted_short(tmp_path) -> None:
    path = write(tmp_path, "7 " + "٣" * 10_000 + "\n", "t.txt")
    with pytest.raises(ConfigError) as e:
        read_token_file(path)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize("word, digits", [("9" * 5_000, "5,000"), ("-" + "1" * 101, "101"),
                                          ("00" + "7" * 4_400, "4,400")])
def test_a_token_of_thousands_of_digits(tmp_path, word, digits) -> None:
    """Past 4,300 digits Python's own limit (naming sys.set_int_max_str_digits) was the
    message; a word longer than any int64 is named by its place and length."""
    path = write(tmp_path, f"1 {word} 2\n", "t.txt")
    with pytest.raises(ConfigError) as e:
        read_token_file(path)
    assert f"t.txt: token 1 is a whole number of {digits} digits (" in str(e.value)
    assert "a token id has at most 19 (int64)" in str(e.value) and len(str(e.value)) < 300
    assert read_token_file(write(tmp_path, "0000000000000000000000000042\n", "u.txt")) == [42]


def test_numbers_behind_thousands_of_zeros_read_as_their_value(tmp_path, monkeypatch) -> None:
    """Python's digit limit counts leading zeros: a short number behind 5,000 of them escaped
    the length checks (which count significant digits) and then int() as a traceback, from a
    token file, --prompts and an integer switch alike."""
    zeros = "0" * 5_000
    assert read_token_file(write(tmp_path, f"1 {zeros}7 -{zeros}0 2\n", "t.txt")).tolist() == [
        1, 7, 0, 2]
    assert parse_prompts(f"{zeros}7,12") == [7, 12]
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", zeros + "12")
    assert EngineConfig(model=SMALL_SPEC).resolve().walk_min_tokens == 12  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [["1", "2"], [1, "a"], [[1], [2, 3]], [1.5], [True],
                                 [2 ** 70], "12"])
def test_token_ids_that_are_not_integers(ids) -> None:
    with pytest.raises(ConfigError, match="integer"):
        check_token_ids(ids, 100)
    if ids != [2 ** 70]:
        with pytest.raises(ConfigError, match="token ids must be integers"):
            integer_ids(ids, "generate")


@pytest.mark.parametrize("text", ["1_000", "١٦", "16,１６"])
def test_prompt_lengths_take_ascii_digits(tmp_path, capsys, text) -> None:
    refused(capsys, ["run", str(write(tmp_path, TINY_TEXT)), "--prompts", text],
            f"--prompts: got {text!r}; expected comma-separated token counts")


def test_a_prompt_length_of_thousands_of_digits(tmp_path, capsys) -> None:
    """Past 4,300 digits Python's own limit escaped --prompts as a traceback."""
    refused(capsys, ["run", str(write(tmp_path, TINY_TEXT)), "--prompts", "1," + "9" * 5_000],
            "--prompts: a token count of 5,000 digits; no prompt is that long")


@pytest.mark.parametrize("args, words", [
    (["bench", "{cfg}", "--pairs", "１"], "expected a whole number written with the digits"),
    (["generate", "{cfg}", "--prompt", "x", "-n", "٢"], "expected a whole number written"),
    (["perplexity", "{cfg}", "--file", "x", "--ctx", "1_6"], "expected a whole number"),
    (["generate", "{cfg}", "--prompt", "x", "-n", "9" * 5_000], "-n/--tokens: got a whole "
     "number of 5,000 digits; none of more than 100 is taken"),
])
def test_command_line_numbers_take_ascii_digits(tmp_path, capsys, args, words) -> None:
    cfg = str(write(tmp_path, TINY_TEXT))
    with pytest.raises(SystemExit) as e:  # argparse's usage error: exit 2
        main([a.replace("{cfg}", cfg) for a in args])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("change, words", [
    ({"vram_budget_mib": 1e308, "expert_cache": None}, "vram_budget_mib: got 1e+308; more "
                                                       "than any machine holds"),
    ({"vram_reserve_mib": 1e300, "expert_cache": None}, "more than any machine holds"),
    ({"ring_mib": 1e308}, "ring_mib: got 1e+308; more than any machine holds"),
    ({"image_cache_mib": 1e308}, "image_cache_mib: got 1e+308; allowed: a number of MiB"),
    ({"prefill": 10 ** 24}, "prefill: got 1000000000000000000000000; expected `auto`"),
    ({"repeats": 10 ** 24}, "repeats: got 1000000000000000000000000; expected an integer"),
    ({"seed": 10 ** 24}, "seed: got 1000000000000000000000000; expected an integer 0.."),
])
def test_sizes_no_machine_holds(tmp_path, capsys, change, words) -> None:
    doc = {k: v for k, v in {**TINY, **change}.items() if v is not None}
    refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))], words)


@pytest.mark.parametrize("where", ["top", "synthetic"])
def test_a_context_beyond_any_model(tmp_path, capsys, where) -> None:
    doc = yaml.safe_load(TINY_TEXT)
    doc["model"]["synthetic"].update(n_heads=4, n_kv_heads=2, head_dim=64, vocab=512)
    if where == "top":
        doc["context"] = 10 ** 20
    else:
        doc["model"]["synthetic"]["context"] = 10 ** 20
    refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))],
            "context: got 100000000000000000000;")


@pytest.mark.parametrize("value", [[], {"a": 1}, [1, [2]]])
def test_a_list_where_a_name_belongs(tmp_path, capsys, value) -> None:
    doc = yaml.safe_load(TINY_TEXT)
    doc["model"]["synthetic"].update(n_heads=4, n_kv_heads=2, head_dim=64, vocab=512,
                                     dense_type=value)
    refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))],
            "model.synthetic.dense_type: got")


def test_rms_eps_beyond_one_is_refused(tmp_path, capsys) -> None:
    doc = yaml.safe_load(TINY_TEXT)
    doc["model"]["synthetic"]["rms_eps"] = 1e308  # normalised to inf: every output NaN
    refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))],
            "model.synthetic.rms_eps: got 1e+308; expected a number > 0 and <= 1")


def test_pairs_beyond_any_measurement(tmp_path, capsys) -> None:
    refused(capsys, ["bench", str(write(tmp_path, TINY_TEXT)), "--pairs", str(10 ** 20)],
            "--pairs: got 100000000000000000000; expected 1..10,000")


def test_budget_gib_beyond_any_device(tmp_path, capsys) -> None:
    refused(capsys, ["inspect", str(tmp_path / "m.gguf"), "--budget-gib", "1e308"],
            "--budget-gib: got 1e+308; expected a VRAM size in GiB > 0 and at most")


def test_integer_switches_take_ascii_digits(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", "١٢")
    refused(capsys, ["run", str(write(tmp_path, TINY_TEXT))],
            "STRATA_WALK_MIN_TOKENS='١٢': expected a positive whole number")


# ------------------------------------------------------------------------ routing profile
@pytest.mark.parametrize("counts, words", [
    ("[[1.5, 0], [0, 0]]", "the count of layer 0, expert 0, 1.5 is not a whole number"),
    ("[[0, 0], [0, 1e30]]", "the count of layer 1, expert 1, 1e+30 is not a whole number"),
    ("[[0, 0], [0, 100000000000000000000000000000]]", "is not a whole number 0..2^62"),
    ("[[true, 0], [0, 0]]", "True is not a whole number"),
    ("[[NaN, 0], [0, 0]]", "NaN is not a count"),
    ("[[0, 0], [0]]", "layer 1 has 1 counts, layer 0 has 2"),
    ('[[0, 0], [0, 0]], "counts": [[1, 1], [1, 1]]', "the key 'counts' appears twice"),
    ("[[-1, 0], [0, 0]]", "-1 is not a whole number"),
])
def test_profiles_take_whole_counts_only(tmp_path, counts, words) -> None:
    path = write(tmp_path, '{"kind": "strata_rt routing profile", "n_layers": 2, '
                           f'"n_experts": 2, "counts": {counts}}}', "p.json")
    with pytest.raises(ConfigError, match="not a strata_rt routing profile") as e:
        RoutingProfile.load(path)
    assert words in str(e.value)


def test_a_profile_round_trips_and_a_fifo_is_named(tmp_path) -> None:
    path = tmp_path / "p.json"
    RoutingProfile(np.array([[3, 0], [1, 2]])).save(path)
    assert RoutingProfile.load(path).counts.tolist() == [[3, 0], [1, 2]]
    with pytest.raises(ConfigError, match="is a FIFO"):
        RoutingProfile.load(fifo(tmp_path))
    assert json.loads(path.read_text())["n_layers"] == 2


# --------------------------------------------------------------------- library and text
def test_engine_config_with_an_unknown_key() -> None:
    settings = {"model": {}, "backend": "reference", "prefil": 64}
    with pytest.raises(ConfigError, match="prefil: unknown key; did you mean `prefill`?"):
        EngineConfig(**settings)
    with pytest.raises(ConfigError, match="model: \\(missing\\)"):
        EngineConfig(backend="reference")
    assert EngineConfig(model={}, prefill=64).prefill == 64


@pytest.mark.parametrize("field, value", [
    ("profile", 7), ("profile", ["p.json"]), ("vram_reserve_mib", float("nan")),
    ("vram_reserve_mib", 1e308), ("walk_min_tokens", True), ("gather_one", "yes"),
    ("expert_cache", True), ("expert_cache", 2 ** 70), ("context", 2 ** 70),
    ("prefill", 2 ** 70), ("ring_bytes", 2 ** 70), ("dump_r", 3), ("trace", ["t.json"]),
])
def test_engine_config_fields_of_the_wrong_kind(field, value) -> None:
    """What a library caller fills in is checked as a config is: a ConfigError naming the
    field, never a TypeError (or an overflow) from deep inside the engine."""
    from strata_rt.weights.model import MoESpec

    spec = MoESpec(2, 256, 256, 8, 2, format="iq3_xxs")
    with pytest.raises(ConfigError, match=f"{field}: got"):
        EngineConfig(model={"spec": spec}, backend="reference", **{field: value}).resolve()


def test_an_empty_config_path(capsys) -> None:
    refused(capsys, ["run", ""], "no config file given")


def test_out_of_memory_message_is_never_empty(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.cli import run

    def fail(*_a, **_k):
        raise MemoryError

    monkeypatch.setattr(run, "open_engine", fail)
    err = refused(capsys, ["run", str(write(tmp_path, TINY_TEXT))], "out of host memory: an "
                  "allocation failed")
    assert not err.rstrip().endswith(":")


def test_invalid_utf8_in_the_prompt_argument(tmp_path) -> None:
    cfg = write(tmp_path, TINY_TEXT)
    proc = subprocess.run([sys.executable, "-m", "strata_rt.cli", "generate", str(cfg),
                           "--prompt", os.fsdecode(b"caf\xe9")], cwd=ROOT, capture_output=True,
                          timeout=120, env={**os.environ, "LC_ALL": "C.UTF-8"})
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert "--prompt is not valid UTF-8 (byte 0xe9 at character 3); give UTF-8 text" in err


def test_stdout_that_cannot_encode_the_text(tmp_path) -> None:
    """A name the terminal's encoding lacks is shown escaped, not a UnicodeEncodeError."""
    cfg = write(tmp_path, TINY_TEXT)
    out = tmp_path / "prøfile.json"
    proc = strata("profile", str(cfg), "--out", str(out), env={"PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "pr\\xf8file.json" in proc.stdout and out.is_file()


@pytest.mark.parametrize("kind, words", [
    ("fifo", "is a FIFO (named pipe); expected a GGUF file"),
    ("device", "is a character device; expected a GGUF file"),
    ("loop", "is a symlink loop (following its links never reaches a file); expected a GGUF"),
])
def test_inspect_names_what_the_file_is(tmp_path, capsys, kind, words) -> None:
    path = {"fifo": lambda: fifo(tmp_path), "device": lambda: Path("/dev/zero"),
            "loop": lambda: symlink_loop(tmp_path)}[kind]()
    refused(capsys, ["inspect", str(path)], f"strata inspect: {path}: {words}", code=1)
