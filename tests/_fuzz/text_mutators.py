"""Seeded mutators of run configs (YAML) and prompt files (token text, hidden-state .npy).

Configs are mutated as data (a key dropped, renamed or added; a value replaced by a hostile
one: wrong type, boundary number, NaN, a path to a folder, to nothing or to an input) and as
text (YAML syntax: tags, anchors, tabs, an alias bomb, a 5,000-digit integer, deep nesting,
invalid UTF-8, a cut). Prompt mutants say whether they are still valid where that is known, so
a run that exits 0 on an invalid one is caught as a silent wrong answer."""

from __future__ import annotations

import copy
import io
import random
from typing import Any

import numpy as np
import yaml

#: values a config key may get instead of its own (types, boundaries, non-numbers, paths)
HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2, 3, 2**31, 2**63, 2**64, -(2**63), 10**30, 1.5, -0.0,
    float("nan"), float("inf"), 1e308, "", "auto", "all", "1", "0x10", "1e3", "nope", [],
    [0], [3, -1], {}, {"a": 1}, ".", "/", "/dev/null", "/proc/strata-none/x", "~", "a\0b",
    "x" * 5000, "m.gguf", "run.yaml", "toks.txt", "h.npy")
#: keys a mutant may add (misspellings draw a "did you mean"; the rest are unknown)
EXTRA_KEYS = ("prefil", "expert_cach", "backends", "Model", "prompts ", "outputs", "x" * 300)
#: text spliced into a config's YAML
YAML_SNIPPETS = (
    "{", "}", "[", "]", ": ", "- ", "&a ", "*a", "!!python/object/apply:os.system ['true']",
    "!!binary AAAA", "%YAML 1.1\n", "\t", "'", '"', "\\", "\0", "\ufeff", "---\n", "...\n",
    "? ", "|\n", ">\n", "<<: *b\n", "1" * 5000, "[" * 3000 + "]" * 3000, "~", "0o777",
    ".inf", ".nan", "-.inf", "2001-12-14", "1_000", "0b101", "=", "@", "`")
#: an alias bomb: nine levels of nine aliases (387 million leaves if expanded naively)
ALIAS_BOMB = ("a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")))


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested dict/list document, outermost first."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*prefix, i))
            out.extend(_paths(v, (*prefix, i)))
    return out


def _parent(doc: Any, path: tuple) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


def _hostile(rng: random.Random) -> Any:
    """A hostile value, copied: a later edit of the same case may write into it (a dict or
    a list), which must change neither the table nor, through a shared object, the value
    itself into a loop."""
    return copy.deepcopy(rng.choice(HOSTILE_VALUES))


def _data_edit(doc: dict, rng: random.Random) -> str:
    paths = _paths(doc)
    path = rng.choice(paths)
    parent, key = _parent(doc, path), path[-1]
    how = rng.randrange(10)
    where = ".".join(str(p) for p in path)
    if how == 0:
        del parent[key]
        return f"{where} removed"
    if how == 1 and isinstance(parent, dict):
        new = rng.choice(EXTRA_KEYS)
        parent[new] = parent.pop(key)
        return f"{where} renamed {new!r}"
    if how == 2:
        new = rng.choice(EXTRA_KEYS)
        target = parent if isinstance(parent, dict) else doc
        target[new] = _hostile(rng)
        return f"{new!r} added"
    value = _hostile(rng)
    parent[key] = value
    return f"{where} = {value!r:.60}"


def _text_edit(text: str, rng: random.Random) -> str:
    how = rng.randrange(8)
    at = rng.randrange(len(text) + 1)
    if how <= 2:
        return text[:at] + rng.choice(YAML_SNIPPETS) + text[at:]
    if how == 3:
        end = min(len(text), at + rng.randint(1, 40))
        return text[:at] + text[end:]
    if how == 4:
        return text[:at]
    if how == 5:
        lines = text.splitlines(keepends=True)
        if not lines:  # an earlier edit of the case cut the text to nothing
            return text
        i = rng.randrange(len(lines))
        return "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])  # a duplicate key
    if how == 6:
        return ALIAS_BOMB + text
    return text.replace("  ", "\t", 1)


def mutate_config(text: str, rng: random.Random) -> tuple[bytes, str]:
    """A mutant of a run config's YAML text and what was done to it."""
    if rng.random() < 0.6:
        doc = yaml.safe_load(text)
        steps = [_data_edit(doc, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        return yaml.safe_dump(doc, sort_keys=False).encode(), "data: " + "; ".join(steps)
    new = text
    for _ in range(rng.choice([1, 1, 2])):
        new = _text_edit(new, rng)
    raw = new.encode("utf-8", "surrogatepass")
    if rng.random() < 0.1:
        at = rng.randrange(len(raw) + 1)
        raw = raw[:at] + b"\xff\xfe\xc3" + raw[at:]
        return raw, "text edit and invalid UTF-8"
    return raw, "text edit"


# ---------------------------------------------------------------------------- token files
#: what a line of a token file may be: (text, whether a token file may hold it; None where
#: either reading is defensible: a byte-order mark, a no-break space)
TOKENS: tuple[tuple[str, bool | None], ...] = (
    ("7", True), (" 12 ", True), ("0", True), ("63", True), ("64", False), ("-1", False),
    ("9" * 30, False), (str(2**63), False), ("1.0", False), ("1e3", False), ("0x10", False),
    ("nan", False), ("", True), ("\0", False), ("1,2", True), ("3 4", True),
    ("\u0663", False), ("1_0", False), ("+3", None), ("\ufeff5", None), ("5\r", True),
    ("\u00a05", None), ("\xff", False))


def mutate_tokens(vocab: int, rng: random.Random) -> tuple[bytes, str, bool | None]:
    """A token file for a model of `vocab` ids: (bytes, description, still valid or None)."""
    lines = [str(rng.randrange(vocab)) for _ in range(rng.randint(1, 6))]
    verdicts: list[bool | None] = []
    changed = []
    for _ in range(rng.randint(1, 3)):
        text, ok = rng.choice(TOKENS)
        if text in ("63", "64"):
            text, ok = (str(vocab - 1), True) if text == "63" else (str(vocab), False)
        lines.insert(rng.randrange(len(lines) + 1), text)
        verdicts.append(ok)
        changed.append(repr(text))
    valid: bool | None = False if False in verdicts else None if None in verdicts else True
    body = "\n".join(lines)
    raw = body.encode("utf-8")
    if rng.random() < 0.05:
        raw = raw[: rng.randrange(len(raw) + 1)]
        return raw, "token lines " + ", ".join(changed) + " then cut", None
    return raw, "token lines " + ", ".join(changed), valid


# ---------------------------------------------------------------------------- hidden states
def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    return buf.getvalue()


def mutate_hidden(hidden: int, rng: random.Random) -> tuple[bytes, str, bool | None]:
    """A hidden-state .npy for `hidden` columns: (bytes, description, still valid; None where
    its bytes were damaged and nobody can say)."""
    rows = rng.randint(1, 4)
    arr: Any = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(
        (rows, hidden)).astype(np.float32)
    how = rng.randrange(9)
    if how == 0:
        v = rng.choice([np.nan, np.inf, -np.inf, 3e38, -3e38])
        arr[rng.randrange(rows), rng.randrange(hidden)] = v
        return _npy(arr), f"one value {v}", False
    if how == 1:
        arr = arr.astype(np.float64)
        arr[0, 0] = rng.choice([1e300, -1e39, 1e-320])
        return _npy(arr), f"float64 with {arr[0, 0]}", abs(arr[0, 0]) < 3.4e38
    if how == 2:
        dtype = rng.choice([np.float16, np.int32, np.int8, np.complex64, np.bool_, "U3"])
        return _npy(arr.astype(dtype)), f"dtype {np.dtype(dtype)}", dtype is np.float16
    if how == 3:
        shape = rng.choice([(hidden,), (rows, hidden - 1), (0, hidden), (rows, hidden, 1),
                            (rows, 2 * hidden), ()])
        data = np.zeros(shape, np.float32)
        return _npy(data), f"shape {shape}", False
    if how == 4:
        obj = np.empty(2, dtype=object)
        obj[:] = [arr, "x"]
        return _npy(obj), "an object (pickled) array", False
    if how == 5:
        return _npy(np.asfortranarray(arr)), "Fortran order", True
    raw = bytearray(_npy(arr))
    if how == 6:  # the header: magic, version, header length, the dict's text
        at = rng.randrange(min(len(raw), 128))
        raw[at] = rng.randrange(256)
        return bytes(raw), f"header byte {at} randomised", None
    if how == 7:
        cut = rng.randrange(len(raw))
        return bytes(raw[:cut]), f"cut to {cut} bytes", cut >= len(raw)
    return bytes(raw), "unchanged", True
