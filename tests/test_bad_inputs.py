"""Bad inputs on the config and CLI side fail before the run, with one message and an exit code
and no traceback: host memory (and absurd sizes), token ids, NaN and Inf in prompt files,
paths that are folders, environment switches. Output paths and Ctrl-C: test_bad_outputs.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from strata_rt.cli import main
from strata_rt.config import hostmem
from strata_rt.config.run.prompts import load_npy, read_token_file
from strata_rt.config.run.run_config import load_config
from strata_rt.config.run.schema import host_memory_parts
from strata_rt.errors import ConfigError, HostMemoryError
from strata_rt.formats.registry import registry

ROOT = Path(__file__).resolve().parent.parent
BIG = ROOT / "configs" / "qwen3-235b-a22b-stream.yaml"
GiB = 1 << 30

TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16, 24]}


def config(tmp_path: Path, **changes) -> Path:
    doc = yaml.safe_load(yaml.safe_dump(TINY))
    doc.update(changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """main() as the user runs it; an exception it does not turn into a message fails the
    test, so 'no traceback' holds whenever this returns."""
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def strata(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata_rt.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def small_host(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(hostmem, "available", lambda: hostmem.Available(
        int(gib * GiB), "MemAvailable in /proc/meminfo"))


# ------------------------------------------------------------------------------ host memory
def test_a_model_larger_than_host_memory_fails_at_validation(capsys, monkeypatch) -> None:
    small_host(monkeypatch, 23.1)
    code, out, err = cli(capsys, "run", str(BIG), "--backend", "reference")
    assert code == 2 and out == ""
    monkeypatch.setenv("STRATA_HOST_MEMORY_CHECK", "0")
    cfg = load_config(BIG)
    fmt = registry()["iq3_xxs"]
    parts = host_memory_parts(cfg.spec, fmt, False, cfg.prompts, cfg.chunk_tokens())
    need = hostmem.format_bytes(sum(parts.values()))
    assert f"  - model: the run needs {need} of host memory; 23.1 GiB available" in err
    assert "expert store 81.0 GiB = 94 layers x 128 experts x 6.9 MiB" in err
    assert "STRATA_HOST_MEMORY_CHECK=0 skips this check" in err


def test_the_big_config_on_this_machine() -> None:
    """The real check, in a fresh process: refused at once where the host is smaller."""
    free = hostmem.available().nbytes
    if free is None or free > 90 * GiB:
        pytest.skip(f"this host has room for the 235B shape ({free} bytes available)")
    done = strata("run", str(BIG), "--backend", "reference")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "of host memory;" in done.stderr and "GiB available" in done.stderr
    assert done.stdout == ""  # nothing was built


@pytest.mark.parametrize("change, words", [
    ({"model": {"synthetic": {"n_layers": 10 ** 12, "hidden": 256, "ffn": 256,
                              "n_experts": 8, "top_k": 2}}}, "more than any machine holds"),
    ({"prompts": [10 ** 18]}, "more than a 64-bit address space holds"),
])
def test_absurd_sizes_are_refused_even_without_the_check(tmp_path: Path, capsys, monkeypatch,
                                                         change: dict, words: str) -> None:
    monkeypatch.setenv("STRATA_HOST_MEMORY_CHECK", "0")
    code, out, err = cli(capsys, "run", str(config(tmp_path, **change)))
    assert code == 2 and out == ""
    assert "model: the run needs" in err and words in err


def test_prompt_lengths_on_the_command_line_are_checked(tmp_path: Path, capsys,
                                                        monkeypatch) -> None:
    small_host(monkeypatch, 1.0)
    code, _, err = cli(capsys, "run", str(config(tmp_path)), "--prompts", "16,100000000")
    assert code == 2
    assert "--prompts: the run needs" in err and "1.0 GiB available" in err
    assert "longest prompt in and out 190.7 GiB" in err  # 2 x 1e8 tokens x 256 x 4 bytes


def test_unknown_available_memory_refuses_only_impossible_sizes(monkeypatch) -> None:
    monkeypatch.setattr(hostmem, "available", lambda: hostmem.Available(None, "unknown"))
    assert hostmem.shortfall(100 * GiB, "x") is None
    assert hostmem.shortfall(hostmem.MAX_MACHINE + 1, "x") == (
        "x needs 1.0 PiB of host memory, more than any machine holds")


def test_require_raises_exit_2(monkeypatch) -> None:
    small_host(monkeypatch, 2.0)
    hostmem.require(GiB, "the expert store")
    with pytest.raises(HostMemoryError) as info:
        hostmem.require(3 * GiB, "the expert store", "4 layers x 8 experts")
    assert info.value.exit_code == 2
    assert str(info.value).startswith("the expert store needs 3.0 GiB of host memory; 2.0 GiB "
                                      "available (4 layers x 8 experts)")


def test_available_memory_sources(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 32000000 kB\nMemAvailable:   24224000 kB\n")
    assert hostmem._meminfo_available(meminfo) == 24224000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert hostmem._meminfo_available(meminfo) is None
    group = tmp_path / "cg" / "job"
    group.mkdir(parents=True)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("0::/job\n")
    (group / "memory.max").write_text(f"{GiB}\n")
    (group / "memory.current").write_text(f"{GiB // 4}\n")
    assert hostmem._cgroup_headroom(tmp_path / "cg", self_cgroup) == GiB - GiB // 4
    (group / "memory.max").write_text("max\n")
    assert hostmem._cgroup_headroom(tmp_path / "cg", self_cgroup) is None


def test_memory_error_that_no_check_foresaw(tmp_path: Path, capsys, monkeypatch) -> None:
    from strata_rt.cli import run

    def fail(*_a, **_k):
        raise MemoryError("Unable to allocate 81.0 GiB for an array with shape (86, 1)")

    monkeypatch.setattr(run, "open_engine", fail)
    code, _, err = cli(capsys, "run", str(config(tmp_path)))
    assert code == 2
    assert err == ("strata run: out of host memory: Unable to allocate 81.0 GiB for an array "
                   "with shape (86, 1)\n")


# ------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize("text, words", [
    ("1 2 -7 3 -1", "token id -7 at position 2 is negative (1 more like it)"),
    ("5, 99999999999999999999", "token id 99999999999999999999 at position 1 is beyond "
                                "int64's largest value"),
])
def test_token_ids_out_of_range(tmp_path: Path, capsys, text: str, words: str) -> None:
    (tmp_path / "toks.txt").write_text(text)
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[8, {"file": "toks.txt"}])))
    assert code == 2 and out == ""  # the first prompt did not run either
    assert f"  - prompts[1].file: got 'toks.txt'; {tmp_path / 'toks.txt'}: {words}" in err
    assert "token ids are whole numbers 0..2^63-1 (int64)" in err


def test_npy_token_ids_beyond_int64(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.array([3, 2 ** 64 - 1], dtype=np.uint64))
    with pytest.raises(ConfigError, match="token id 18446744073709551615 at position 1 is "
                                          "beyond int64's largest value"):
        read_token_file(tmp_path / "t.npy")
    np.save(tmp_path / "ok.npy", np.array([[3, 4], [5, 6]], dtype=np.uint16))
    assert read_token_file(tmp_path / "ok.npy").tolist() == [3, 4, 5, 6]


@pytest.mark.parametrize("mark, byte", [(b"{", b"("), (b"}", b"("), (b"'descr'", b"x")])
def test_a_damaged_npy_header_is_named_not_a_traceback(tmp_path: Path, capsys, mark: bytes,
                                                        byte: bytes) -> None:
    """numpy parses an .npy header as a Python literal: a damaged one raised tokenize's and
    ast's errors out of the config check; both prompt kinds now name the file."""
    for name, arr in (("h.npy", np.ones((4, 256), np.float32)), ("t.npy", np.arange(4))):
        np.save(tmp_path / name, arr)
        raw = (tmp_path / name).read_bytes()
        at = raw.index(mark) + len(mark) - 1
        (tmp_path / name).write_bytes(raw[:at] + byte + raw[at + 1:])
    with pytest.raises(ConfigError, match=r"t\.npy: not a readable \.npy array"):
        read_token_file(tmp_path / "t.npy")
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[{"hidden_file":
                                                                       "h.npy"}])))
    assert (code, out) == (2, "") and "Traceback" not in err, err
    assert "prompts[0].hidden_file: got 'h.npy'; unreadable:" in err
    assert "not a readable .npy array" in err


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


_GOOD_NPY = _npy(np.ones((2, 8), np.float32))
_OBJECTS = np.empty(2, dtype=object)
_OBJECTS[:] = [1, "x"]


@pytest.mark.parametrize("raw, words", [
    (_GOOD_NPY[:100], "cut short: the file ends before the data its header describes"),
    (_GOOD_NPY[:-5], "cut short: the file ends before the data its header describes"),
    (_npy(_OBJECTS), "holds Python objects (pickled), which are never loaded"),
    (b"X" + _GOOD_NPY[1:], "not an .npy file (it does not start with \\x93NUMPY)"),
    (b"1 2 3\n", "not an .npy file"),
    (_GOOD_NPY[:6] + b"\x01\x65" + _GOOD_NPY[8:], "an .npy format version other than 1.0"),
    (_GOOD_NPY.replace(b"(2, 8)", b"f(2,8)"), "its header is damaged: an .npy header is a "
     "dictionary of descr, fortran_order and shape"),
    (_GOOD_NPY.replace(b"shape", b"sXape"), "its header is damaged: an .npy header is a "
     "dictionary of descr, fortran_order and shape (Header does not contain the correct keys"),
])
@pytest.mark.parametrize("mmap", [True, False])
def test_npy_damage_is_said_in_words(tmp_path: Path, raw: bytes, words: str,
                                     mmap: bool) -> None:
    """numpy's own words named its exception types and ast nodes (`<ast.Call object at
    0x...>`), or advised loading the file as a pickle; each damage is now said as such."""
    (tmp_path / "h.npy").write_bytes(raw)
    with pytest.raises(ConfigError) as e:
        load_npy(tmp_path / "h.npy", mmap=mmap)
    text = str(e.value)
    assert f"h.npy: not a readable .npy array: {words}" in text, text
    assert not any(w in text for w in ("Error", " object at 0x", "allow_pickle")), text


def test_a_header_escape_draws_no_python_warning(tmp_path: Path) -> None:
    """numpy parses the header as a Python literal: a backslash put into it made the parser's
    DeprecationWarning ("invalid escape sequence") reach the user beside the message."""
    (tmp_path / "h.npy").write_bytes(_GOOD_NPY.replace(b"fortran_order", b"fortran\\order"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="its header is damaged"):
            load_npy(tmp_path / "h.npy")
    assert [str(w.message) for w in caught] == []


def test_an_npz_archive_is_named_as_one(tmp_path: Path) -> None:
    np.savez(tmp_path / "h.npz", a=np.ones(2))
    (tmp_path / "h.npz").rename(tmp_path / "h.npy")
    with pytest.raises(ConfigError, match=r"h\.npy: an \.npz archive of arrays, not one \.npy"):
        load_npy(tmp_path / "h.npy")


def test_token_ids_beyond_the_vocabulary(tmp_path: Path) -> None:
    """The hook a model with an embedding table uses: its vocabulary size."""
    from strata_rt.config.run.schema import Problems, check_prompts

    (tmp_path / "toks.txt").write_text("0 151935 151936 200000")
    assert read_token_file(tmp_path / "toks.txt", vocab_size=200001).size == 4
    p = Problems()
    check_prompts(p, {"prompts": [{"file": "toks.txt"}]}, tmp_path, 256, vocab_size=151936)
    assert p.items == [f"prompts[0].file: got 'toks.txt'; {tmp_path / 'toks.txt'}: token id "
                       "151936 at position 2 is beyond the vocabulary of 151,936 tokens (1 more "
                       "like it); token ids are whole numbers 0..151,935"]


# ------------------------------------------------------------------------------ NaN in prompts
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_nan_or_inf_in_a_hidden_file(tmp_path: Path, capsys, bad: float) -> None:
    h = np.ones((40, 256), np.float32)
    h[17, 3] = bad
    h[30, 0] = np.nan
    np.save(tmp_path / "h.npy", h)
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[8, {"hidden_file":
                                                                          "h.npy"}])))
    assert code == 2 and out == ""
    assert (f"  - prompts[1].hidden_file: got 'h.npy'; row 17 (column 3) holds {bad}; 2 of "
            "its 40 rows hold NaN or Inf; hidden states must be finite") in err


def test_a_float64_hidden_file_beyond_float32s_range(tmp_path: Path, capsys) -> None:
    """Finite in the file, infinite once read as float32: refused before the run, naming the
    file, with no numpy warning on the way."""
    h = np.ones((40, 256), np.float64)
    h[5, 7] = 1e300
    h[9, 0] = -1e39
    np.save(tmp_path / "h.npy", h)
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[{"hidden_file":
                                                                       "h.npy"}])))
    assert code == 2 and out == ""
    assert ("  - prompts[0].hidden_file: got 'h.npy'; row 5 (column 7) holds 1e+300, beyond "
            "float32's range (the engine reads hidden states as float32); 2 of its 40 rows "
            "do") in err
    assert "Warning" not in err


def test_nan_scan_reads_in_slices(tmp_path: Path, monkeypatch) -> None:
    import strata_rt.config.run.prompts as prompts

    monkeypatch.setattr(prompts, "SCAN_BYTES", 3 * 256 * 2)  # three float16 rows per slice
    h = np.zeros((50, 256), np.float16)
    h[49, 255] = np.inf
    np.save(tmp_path / "h.npy", h)
    assert prompts.first_nonfinite(np.load(tmp_path / "h.npy", mmap_mode="r")) == (49, 255, 1)
    h[49, 255] = 0
    assert prompts.first_nonfinite(h) is None


# ------------------------------------------------------------------------------ folders
@pytest.mark.parametrize("key", ["profile", "prompt file", "gguf"])
def test_a_folder_given_for_a_file_is_called_a_folder(tmp_path: Path, capsys, key: str) -> None:
    (tmp_path / "somedir").mkdir()
    change = {"profile": {"profile": "somedir"},
              "prompt file": {"prompts": [{"file": "somedir"}]},
              "gguf": {"model": {"gguf": "somedir"}}}[key]
    code, _, err = cli(capsys, "run", str(config(tmp_path, **change)))
    assert code == 2
    assert f"got 'somedir'; is a directory ({tmp_path / 'somedir'}); expected a file" in err
    assert "no such file" not in err


# ------------------------------------------------------------------------------ home folders
NO_USER = "~no-such-user-strata"
NO_HOME = (f"starts with {NO_USER}, which names the home folder of user "
           "'no-such-user-strata', and there is no such user")


@pytest.mark.parametrize("key", ["profile", "prompt file", "gguf", "output"])
def test_a_home_folder_of_no_user_is_named(tmp_path: Path, capsys, key: str) -> None:
    """`~name` of a user this machine lacks: pathlib's error escaped the config check as a
    traceback; it is a problem naming the key."""
    value = f"{NO_USER}/x"
    change = {"profile": {"profile": value}, "prompt file": {"prompts": [{"file": value}]},
              "gguf": {"model": {"gguf": value}}, "output": {"output": {"json": value}}}[key]
    code, out, err = cli(capsys, "run", str(config(tmp_path, **change)))
    assert (code, out) == (2, ""), err
    assert f"got '{value}'; {NO_HOME}" in err


def test_a_file_named_with_a_leading_tilde(tmp_path: Path, capsys) -> None:
    """What the message advises: `./~name` is the file of that name beside the config."""
    (tmp_path / "~t.txt").write_text("1\n2\n3\n")
    code, _, err = cli(capsys, "run", str(config(tmp_path, prompts=[{"file": "~t.txt"}])))
    assert code == 2 and "write ./~t.txt" in err
    code, out, err = cli(capsys, "run", str(config(tmp_path, prompts=[{"file": "./~t.txt"}])))
    assert code == 0 and "tokens/s" in out, err


@pytest.mark.parametrize("args, words", [
    (["generate", "{config}", "--prompt-file", f"{NO_USER}/p.txt"],
     f"--prompt-file: {NO_USER}/p.txt: {NO_HOME}"),
    (["run", "{config}", "--json", f"{NO_USER}/out.json"],
     f"--json: got '{NO_USER}/out.json'; {NO_HOME}"),
])
def test_a_home_folder_of_no_user_on_the_command_line(tmp_path: Path, capsys, args: list[str],
                                                      words: str) -> None:
    args = [a.format(config=config(tmp_path)) for a in args]
    code, out, err = cli(capsys, *args)
    assert (code, out) == (2, ""), err
    assert words in err


@pytest.mark.parametrize("key", ["profile", "prompt file", "gguf", "output", "output dir"])
def test_a_path_holding_a_lone_surrogate_is_named(tmp_path: Path, capsys, key: str) -> None:
    """A YAML escape such as "\\ud800" gives a string no file name can hold: the file system
    call raised an encoding error out of the config check as a traceback."""
    value = "a\ud800.x"
    change = {"profile": {"profile": value}, "prompt file": {"prompts": [{"file": value}]},
              "gguf": {"model": {"gguf": value}}, "output": {"output": {"json": value}},
              "output dir": {"output": {"dir": value, "json": "r.json"}}}[key]
    path = config(tmp_path, **change)
    assert "\\uD800" in path.read_text()  # as a user writes it: an escape in quotes
    code, out, err = cli(capsys, "run", str(path))
    assert (code, out) == (2, ""), err
    assert ("got 'a\\ud800.x'; character 2 (\\ud800) is half of a UTF-16 surrogate pair, which "
            "no file name can hold") in err


# ------------------------------------------------------------------------------ environment
def test_unknown_switch_names_the_closest(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_MMQ_KERNL", "f16")
    code, out, err = cli(capsys, "run", str(config(tmp_path)))
    assert code == 0 and "tokens/s" in out  # a warning, not an error
    assert ("strata: warning: environment variable STRATA_MMQ_KERNL is not a strata_rt switch "
            "(ignored); did you mean STRATA_MMQ_KERNEL?") in err
    monkeypatch.setenv("STRATA_MMQ_KERNL", "f16")
    code, _, err = cli(capsys, "-qq", "plugins")
    assert code == 0 and "STRATA_MMQ_KERNL" not in err  # -qq: errors only


@pytest.mark.parametrize("name, value, words", [
    ("STRATA_CUDA_GRAPH", "yes", "expected 0 or 1"),  # used by the CUDA backend only
    ("STRATA_HOST_MEMORY_CHECK", "off", "expected 0 or 1"),
    ("STRATA_WALK_MIN_TOKENS", "0", "expected a positive whole number"),
    ("STRATA_WALK_MIN_TOKENS", "١٢", "expected a positive whole number"),
    ("STRATA_NVCC", "/nonexistent/nvcc", "no such program"),
    ("STRATA_KERNEL_CACHE", "{file}", "is a file, not a folder"),
    ("STRATA_PREFILL_DUMP_R", "{dir}", "is a directory; give a file path"),
    ("STRATA_PREFILL_DUMP_R", "{file}/r.bin", "{file} is a file, so no folder can be created"),
    ("STRATA_PREFILL_TRACE", f"{NO_USER}/t.json", NO_HOME),
])
@pytest.mark.parametrize("command", ["run", "plugins"])
def test_every_switch_is_checked_on_every_command(tmp_path: Path, capsys, monkeypatch,
                                                  name: str, value: str, words: str,
                                                  command: str) -> None:
    (tmp_path / "afile").write_text("x")
    value = value.format(file=tmp_path / "afile", dir=tmp_path)
    words = words.format(file=tmp_path / "afile")
    monkeypatch.setenv(name, value)
    args = ["run", str(config(tmp_path))] if command == "run" else ["plugins"]
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(f"strata {command}: environment: 1 problem(s):\n  - {name}={value!r}: "
                          f"{words}"), err


def test_an_integer_switch_of_thousands_of_digits(tmp_path: Path, capsys, monkeypatch) -> None:
    """Past 4,300 digits Python's own limit escaped the switch check as a traceback."""
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", "9" * 5_000)
    code, out, err = cli(capsys, "plugins")
    assert (code, out) == (2, "") and len(err) < 400, err
    assert ("STRATA_WALK_MIN_TOKENS='999" in err and "... (5,000 characters): a whole number "
            "of 5,000 digits; expected one of at most 18") in err
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", "0" * 30 + "12")  # leading zeros are fine
    assert cli(capsys, "-qq", "plugins")[0] == 0


def test_unknown_switch_in_a_fresh_process(tmp_path: Path) -> None:
    done = strata("run", str(config(tmp_path)), "--prompts", "4",
                  env={"STRATA_PREFIL_TIMING": "1", "STRATA_CUDA_GRAPH": "2"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "did you mean STRATA_PREFILL_TIMING?" in done.stderr
    assert "STRATA_CUDA_GRAPH='2': expected 0 or 1" in done.stderr
