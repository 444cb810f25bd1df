"""Hostile YAML in a run config: each ends in one message naming the file and the line, exit
2, no traceback and no wait. YAML that is deep, an alias bomb, has duplicate keys, `1_000`,
base-60 or octal numbers, or a whole number of thousands of digits; what is fine stays fine.
Files, paths and numbers: test_hostile_inputs.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from strata_rt.cli import main
from strata_rt.config.files.yaml_input import MAX_DEPTH, YamlProblem, load_yaml
from strata_rt.config.run.run_config import load_config
from strata_rt.errors import ConfigError

TINY = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                "top_k": 2, "seed": 5}},
        "format": "iq3_xxs", "backend": "reference", "expert_cache": 4, "prompts": [16]}
TINY_TEXT = yaml.safe_dump(TINY)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(capsys, args: list[str], words: str, code: int = 2) -> str:
    """Runs the command; asserts the exit code, that nothing ran (stdout empty), no
    traceback, and that the one message holds `words`."""
    got = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert (got, out) == (code, ""), err
    assert words in err, err
    return err


# ---------------------------------------------------------------------------------- YAML
@pytest.mark.parametrize("text, words", [
    (TINY_TEXT + "format: fp16\n", "duplicate key 'format' (first at line"),
    (TINY_TEXT.replace("seed: 5", "seed: 1_000"), "'1_000' is read by YAML as a number"),
    (TINY_TEXT.replace("seed: 5", "seed: 1:30"), "'1:30' is read by YAML as a number"),
    (TINY_TEXT.replace("expert_cache: 4", "expert_cache: 010"),
     "'010' is read by YAML as an octal number (8)"),
    (TINY_TEXT.replace("expert_cache: 4", "expert_cache: 4\nrepeats: 1_0.5"),
     "'1_0.5' is read by YAML as a number"),
    ("prompts: " + "[" * 5000 + "]" * 5000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    ("prompts: " + "[" * 20000 + "]" * 20000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    ("a: &a [*a]\n", "an alias (*name) refers to the list or mapping that holds it"),
    (TINY_TEXT.replace("seed: 5", "seed: " + "1" * 5001), "a whole number of 5,001 digits"),
    # an octal one: its value was shown in decimal, past Python's 4,300 digits (a traceback)
    (TINY_TEXT.replace("seed: 5", "seed: 0" + "1" * 5000), "a whole number of 5,001 digits"),
    # a value its tag cannot read, or a date that is none: a traceback
    (TINY_TEXT.replace("seed: 5", "seed: !!int x"), "line 10: 'x' cannot be read as !!int; "),
    (TINY_TEXT.replace("seed: 5", "seed: !!bool maybe"), "'maybe' cannot be read as !!bool"),
    (TINY_TEXT.replace("seed: 5", "seed: 2024-02-30"), "line 10: '2024-02-30' is read by YAML "
     "as a date, and there is no such date; quote it to mean text"),
    (TINY_TEXT.replace("seed: 5", "seed: !!set [1]"), "line 10: the tag !!set needs a mapping"),
])
def test_yaml_that_is_refused(tmp_path, capsys, text, words) -> None:
    path = write(tmp_path, text)
    err = refused(capsys, ["run", str(path)], words)
    assert err.startswith(f"strata run: {path}: 1 problem(s):")
    with pytest.raises(ConfigError, match="problem"):
        load_config(path)


def test_alias_bomb_is_refused_at_once(tmp_path, capsys) -> None:
    """Nine lines standing for a billion values: refused before anything expands them (the
    problem message used to print the expansion: 1.9 GB in a minute, and growing)."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(9):
        name, prev = chr(ord("b") + i), chr(ord("a") + i)
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    doc = TINY_TEXT.replace("prompts: [16]", "prompts: *j") + "\n".join(lines) + "\n"
    path = write(tmp_path, doc.replace("prompts: *j", "") + "prompts: *j\n")
    t0 = time.perf_counter()
    err = refused(capsys, ["run", str(path)], "with its aliases (*name) expanded, the document "
                  "holds more than 100,000 values")
    assert time.perf_counter() - t0 < 10 and len(err) < 400


def test_a_long_flat_list_is_refused_while_it_is_read(tmp_path, capsys, monkeypatch) -> None:
    from strata_rt.config.files import yaml_input

    monkeypatch.setattr(yaml_input, "MAX_NODES", 1_000)  # the rule, at a size tested quickly
    path = write(tmp_path, "prompts: [" + "1, " * 2_000 + "1]\n")
    refused(capsys, ["run", str(path)], "line 1: more than 1,000 values")


def test_yaml_rules_keep_what_is_fine() -> None:
    assert load_yaml("base: &b {x: 1}\nc:\n  <<: *b\n  x: 2\nn: [0x10, 7, -3, 2.5]\n") == {
        "base": {"x": 1}, "c": {"x": 2}, "n": [16, 7, -3, 2.5]}  # a merge may override
    assert load_yaml("a: &a [1, 2]\nb: [*a, *a]\n") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
    assert load_yaml("") is None
    with pytest.raises(YamlProblem, match="not valid YAML"):
        load_yaml("a: [1\n")


def test_problem_values_are_shown_bounded(tmp_path, capsys) -> None:
    doc = dict(TINY, prompts=[{"file": "x" * 100_000}], backend=list(range(5_000)))
    err = refused(capsys, ["run", str(write(tmp_path, yaml.safe_dump(doc)))], "backend: got [0")
    assert len(err) < 2_000


def test_null_true_and_false_are_shown_as_yaml_writes_them(tmp_path, capsys) -> None:
    """A problem showed YAML's `null` as None and `true` as True (Python's words): each is
    shown as the file spells it, alone, in a list, as a key and through a setting's parser."""
    text = TINY_TEXT.replace("backend: reference", "backend: true").replace(
        "prompts:\n- 16", "prompts: [16, null]\ndevices: [0, false]\ncompute_lanes: true\n"
        "null: 1\nprefill: null")
    err = refused(capsys, ["run", str(write(tmp_path, text))], "backend: got true; allowed")
    for words in ("prompts[1]: got null;", "devices: got [0, false]; false is not a device",
                  "compute_lanes: got true; expected one of auto", "null: unknown key",
                  "prefill: got null;"):
        assert words in err, err
    assert not any(w in err for w in ("None", "True", "False")), err
    err = refused(capsys, ["run", str(write(tmp_path, TINY_TEXT + "devices: true\n"))],
                  "devices: got true; expected a list of device indices")
    assert err.count("got") == 1, err  # said once (it was `got True; got True`)
    err = refused(capsys, ["run", str(write(tmp_path, TINY_TEXT + "~: 1\nnull: 2\n"))],
                  "duplicate key null (first at line")


@pytest.mark.parametrize("text, words", [
    ("? [a, b]\n: 1\n", "line 14: the key ['a', 'b'] is a list; a key is a name, a number or "
     "quoted text"),
    ("x:\n  {y: 1}: 2\n", "line 15: the key {'y': 1} is a mapping"),
    ("z: [1, 2\n", "line 15, column 1: not valid YAML: expected ',' or ']', but got '<stream "
     "end>' (while parsing a flow sequence from line 14)"),
    ("z: !!python/object:os.system 1\n", "line 14, column 4: not valid YAML: could not "
     "determine a constructor for the tag '!!python/object:os.system'"),
])
def test_yaml_errors_name_the_line_in_the_products_words(tmp_path, capsys, text,
                                                         words) -> None:
    """PyYAML's messages named the text `in "<unicode string>"` (an unhashable key's among
    them): each names the line of the config instead."""
    err = refused(capsys, ["run", str(write(tmp_path, TINY_TEXT + text))], words)
    assert "unicode string" not in err and "^" not in err, err
