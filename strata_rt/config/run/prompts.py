"""Prompts of a run config, and the checks their files get before the run starts.

MoE-only models have no embedding table, so a prompt becomes hidden states here: a length gives
Gaussian rows from a generator seeded with `seed + prompt index`; a token file embeds each token
id as a fixed Gaussian row seeded with `(seed, token id)` (equal tokens, equal rows); a
`hidden_file` gives the rows directly.

A bad prompt used to surface only when its turn came, after the earlier prompts had run (and
their rows were lost with the traceback). So a token file is read and its ids range-checked
when the config is validated, and a hidden-state file is scanned for NaN and Inf then too,
naming the file, the row and the column.
"""

from __future__ import annotations

import re
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError
from ..files.input_files import DATA_LIMIT, InputFileError, read_text, regular_file_problem
from ..files.numbers import MAX_INT_DIGITS, significant_digits, to_int

INT64_MAX = (1 << 63) - 1
#: a token id as a token file writes it: ASCII digits, an optional sign (int() would also take
#: `1_000`, fullwidth and Arabic-Indic digits)
_ASCII_INT = re.compile(r"[+-]?[0-9]+")
#: rows of a hidden-state file checked per step (bounded memory for any file size)
SCAN_BYTES = 64 << 20


@dataclass(frozen=True)
class Prompt:
    """One prompt: a length, a token file, or a file of hidden states."""

    index: int
    tokens: int
    token_file: Path | None = None
    hidden_file: Path | None = None

    @property
    def label(self) -> str:
        src = self.token_file or self.hidden_file
        return f"{self.tokens} tokens" + (f" ({src.name})" if src else "")

    def token_ids(self, vocab: int, seed: int) -> np.ndarray:
        """int64 [tokens] for a whole model: the token file's ids, or seeded ids for a length
        (each prompt its own, so a run never reuses a cached prefix)."""
        if self.hidden_file is not None:
            raise ConfigError(f"prompt {self.index + 1}: a whole model takes tokens, not hidden "
                              "states", source=str(self.hidden_file))
        if self.token_file is not None:
            return read_token_file(self.token_file, vocab).astype(np.int64)
        rng = np.random.default_rng([seed, self.index, 0x70C])
        return rng.integers(0, vocab, self.tokens, dtype=np.int64)

    def engine_input(self, engine: Any, seed: int) -> np.ndarray:
        """What engine.prefill takes for this prompt: token ids for a whole model, hidden
        states for MoE layers alone."""
        spec = engine.qwen3_spec
        if spec is not None:
            return self.token_ids(spec.vocab, seed)
        return self.hidden_states(engine.model.spec.hidden, seed)

    def hidden_states(self, hidden: int, seed: int) -> np.ndarray:
        """float32 [tokens, hidden], C-contiguous: what Engine.prefill takes."""
        if self.hidden_file is not None:
            return np.ascontiguousarray(load_npy(self.hidden_file, mmap=False),
                                        dtype=np.float32)
        if self.token_file is not None:
            ids = read_token_file(self.token_file)
            uniq, inverse = np.unique(ids, return_inverse=True)
            table = np.stack([np.random.default_rng([seed, int(t)]).standard_normal(
                hidden, dtype=np.float32) for t in uniq])
            return np.ascontiguousarray(table[inverse.reshape(-1)])
        rng = np.random.default_rng(seed + self.index)
        return rng.standard_normal((self.tokens, hidden), dtype=np.float32)


def token_id_problem(ids: np.ndarray, vocab_size: int | None = None) -> str | None:
    """Why these token ids cannot be used (the first bad one, its position and how many are
    bad), or None. ids: integers of any width, including Python ints (dtype object)."""
    if ids.size == 0:
        return None
    high = INT64_MAX if vocab_size is None else vocab_size - 1
    what = "int64's largest value" if vocab_size is None else \
        f"the vocabulary of {vocab_size:,} tokens"
    allowed = "0..2^63-1 (int64)" if vocab_size is None else f"0..{high:,}"
    negative = ids < 0
    if ids.dtype.kind in "iu" and np.iinfo(ids.dtype).max <= high:
        beyond = np.zeros(ids.shape, dtype=bool)  # (numpy refuses to compare past the dtype)
    else:
        beyond = ids > high
    for bad, why in ((negative, "is negative"), (beyond, f"is beyond {what}")):
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            more = int(bad.sum()) - 1
            extra = f" ({more:,} more like it)" if more else ""
            return (f"token id {ids[first]} at position {first} {why}{extra}; token ids are "
                    f"whole numbers {allowed}")
    return None


def integer_ids(token_ids: Any, source: str) -> np.ndarray:
    """Token ids (any integer dtype, flattened) or ConfigError: strings, floats, booleans,
    ragged lists and ids beyond int64 are refused here, with words, not numpy's traceback."""
    try:
        ids = np.asarray(token_ids).reshape(-1)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"token ids must be integers ({e})", source=source) from None
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"token ids must be integers, got {ids.dtype}", source=source)
    return ids


def check_token_ids(token_ids: Any, vocab: int, source: str = "prefill") -> np.ndarray:
    """int64 [T] token ids, refused unless a non-empty 1-D integer array inside the vocabulary
    (what a whole model's prefill takes, on every backend and in the numpy model)."""
    try:
        ids = np.asarray(token_ids)
    except (ValueError, TypeError) as e:  # ragged lists, objects numpy cannot hold
        raise ConfigError(f"token ids must be a non-empty 1-D integer array ({e})",
                          source=source) from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"token ids must be a non-empty 1-D integer array, got shape "
                          f"{ids.shape} of {ids.dtype}", source=source)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(f"token id {int(ids[i])} at index {i} is outside the vocabulary "
                          f"0..{vocab - 1}", source=source)
    return ids.astype(np.int64)


def check_hidden_states(hidden: Any, width: int, source: str = "prefill") -> np.ndarray:
    """float32 [T, width] hidden states (C order), refused unless a 2-D array of real numbers
    (any float or integer type; not bool, complex, text or objects) `width` wide: what MoE
    layers alone take. A value past float32's range becomes infinity, refused with NaN later."""
    expected = f"expected [tokens, {width}] hidden states of a float or integer type"
    try:
        h = np.asarray(hidden)
    except (ValueError, TypeError) as e:  # ragged lists, objects numpy cannot hold
        raise ConfigError(f"prefill input is no array ({e}); {expected}", source=source) from None
    if h.ndim != 2 or h.shape[1] != width:
        raise ConfigError(f"prefill input has shape {h.shape}; {expected}", source=source)
    if h.dtype.kind not in "iuf":
        raise ConfigError(f"prefill input holds {h.dtype} values; {expected}", source=source)
    with np.errstate(over="ignore"):  # what overflows float32 is refused as infinity
        return np.ascontiguousarray(h, dtype=np.float32)


#: what numpy's .npy reader raises on a damaged file: its header is parsed as a Python literal
#: (tokenize, then ast), its data read after it
_NPY_ERRORS = (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError, TypeError)


#: what every .npy file starts with
_NPY_MAGIC = b"\x93NUMPY"
#: numpy's words for a header whose dictionary parsed but holds the wrong things (worth
#: quoting: they name the key)
_NPY_HEADER_WORDS = ("Header does not contain", "Header is not a dictionary", "shape is not",
                     "fortran_order is not", "descr is not")


def _npy_why(path: Path, e: BaseException) -> str:
    """What is wrong with an .npy file numpy could not read, in words (numpy's own name its
    exception types, ast nodes, or advise loading a pickle)."""
    text = str(e)
    if isinstance(e, OSError):
        return f"cannot be read: {e.strerror or text}"
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_NPY_MAGIC))
    except OSError as err:
        return f"cannot be read: {err.strerror or err}"
    if magic != _NPY_MAGIC:
        return "not an .npy file (it does not start with \\x93NUMPY)"
    if isinstance(e, EOFError) or text.startswith(("EOF", "Failed to read all data")) \
            or "mmap length" in text or "cannot reshape" in text:
        return "cut short: the file ends before the data its header describes"
    if "pickled" in text or "Python objects" in text or "Object arrays" in text:
        return ("holds Python objects (pickled), which are never loaded; save an array of "
                "numbers")
    if "format version" in text or "Invalid version" in text:
        return "an .npy format version other than 1.0, 2.0 or 3.0"
    detail = f" ({text[:200]})" if text.startswith(_NPY_HEADER_WORDS) else ""
    return ("its header is damaged: an .npy header is a dictionary of descr, fortran_order "
            f"and shape{detail}")


def load_npy(path: Path, mmap: bool = True) -> np.ndarray:
    """The array of an .npy file (memory-mapped unless mmap is False); ConfigError naming the
    file and saying what is wrong for anything numpy cannot read as one (a pickle, another
    format, a damaged header, a cut), never numpy's own exception or words."""
    try:
        # numpy parses the header as a Python literal: a damaged one draws the parser's
        # warnings (an invalid escape such as a backslash before an o), which are not ours
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except _NPY_ERRORS as e:
        raise ConfigError(f"{path}: not a readable .npy array: {_npy_why(path, e)}") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive (np.load opens those too)
        getattr(arr, "close", lambda: None)()
        raise ConfigError(f"{path}: an .npz archive of arrays, not one .npy array")
    return arr


def read_token_file(path: Path, vocab_size: int | None = None) -> np.ndarray:
    """Token ids (int64) from a .npy integer array or a text file of integers (spaces, commas
    or newlines between them). ConfigError for anything else, for a negative id, one beyond
    int64 and, given `vocab_size` (a model with an embedding table), one beyond it."""
    if path.suffix == ".npy":
        why = regular_file_problem(path)
        if why is not None:
            raise ConfigError(f"{path}: {why}")
        ids = load_npy(path)
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"{path}: token ids must be integers, found dtype {ids.dtype}")
        flat = np.asarray(ids).reshape(-1)
    else:
        try:
            words = read_text(path, DATA_LIMIT, "a token file").replace(",", " ").split()
        except InputFileError as e:
            raise ConfigError(f"{path}: {e.why}") from None
        bad = next((i for i, w in enumerate(words) if not _ASCII_INT.fullmatch(w)), None)
        if bad is not None:
            raise ConfigError(f"{path}: token files hold integers written with the digits "
                              f"0-9: {shown_word(words[bad])} (token {bad}) is not one")
        long = next((i for i, w in enumerate(words) if significant_digits(w) > MAX_INT_DIGITS),
                    None)
        if long is not None:  # named by its length, not read
            n = significant_digits(words[long])
            raise ConfigError(f"{path}: token {long} is a whole number of {n:,} digits "
                              f"({shown_word(words[long])}); a token id has at most "
                              f"{len(str(INT64_MAX))} (int64)")
        flat = np.array([to_int(w) for w in words], dtype=object)
    why = token_id_problem(flat, vocab_size)
    if why is not None:
        raise ConfigError(f"{path}: {why}")
    return flat.astype(np.int64)


def shown_word(word: str) -> str:
    """A word of a file as a message quotes it: its repr, cut at 40 characters."""
    return repr(word) if len(word) <= 40 else repr(word[:40]) + "..."


def first_nonfinite(arr: np.ndarray) -> tuple[int, int, int] | None:
    """(row, column, rows holding NaN or Inf) of a 2-D float array, or None when all are
    finite; reads the array (a memory map too) in slices of about SCAN_BYTES."""
    step = max(1, SCAN_BYTES // max(1, arr.shape[1] * arr.dtype.itemsize))
    found, bad_rows = None, 0
    for lo in range(0, arr.shape[0], step):
        bad = ~np.isfinite(np.asarray(arr[lo: lo + step]))
        rows = bad.any(axis=1)
        if rows.any():
            bad_rows += int(rows.sum())
            if found is None:
                r, c = np.argwhere(bad)[0]
                found = (lo + int(r), int(c))
    return None if found is None else (found[0], found[1], bad_rows)


def hidden_file_problem(path: Path, hidden: int | None) -> tuple[int | None, str | None]:
    """(rows, None) for a usable hidden-state file, else (None, why): the shape and dtype
    against [tokens, hidden] float, then the first row holding NaN or Inf."""
    arr = load_npy(path)
    if arr.ndim != 2 or (hidden is not None and arr.shape[1] != hidden) \
            or arr.dtype.kind != "f" or arr.shape[0] == 0:
        want = f"[tokens, {hidden if hidden is not None else 'hidden'}]"
        return None, f"expected a float array {want}, found {arr.dtype} {arr.shape}"
    bad = first_nonfinite(arr)
    if bad is not None:
        row, col, n = bad
        value = arr[row, col]
        more = f"; {n:,} of its {arr.shape[0]:,} rows hold NaN or Inf" if n > 1 else ""
        return None, (f"row {row} (column {col}) holds {value}{more}; hidden states must be "
                      "finite (rows count from 0)")
    if arr.dtype.itemsize > 4:  # finite here, but not once read as the engine's float32
        beyond = np.abs(arr) > np.finfo(np.float32).max
        if beyond.any():
            rows = np.flatnonzero(beyond.any(axis=1))
            row = int(rows[0])
            col = int(np.flatnonzero(beyond[row])[0])
            more = f"; {rows.size:,} of its {arr.shape[0]:,} rows do" if rows.size > 1 else ""
            return None, (f"row {row} (column {col}) holds {arr[row, col]}, beyond float32's "
                          f"range (the engine reads hidden states as float32){more}")
    return int(arr.shape[0]), None
