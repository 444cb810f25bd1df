"""Reading a GGUF file's header (keys and tensor list) without trusting a byte of it.

A GGUF header is a chain of counts and lengths: a key count, string lengths, array lengths,
dimension counts, dims, offsets. A reader that believes them loops 2^63 times, allocates what
a corrupt length asks for, or maps a tensor onto another tensor's bytes. This parser checks
every count and length against the bytes left in the file before it reads or allocates by it,
walks the header once, and then checks the tensor list as a whole: known types, whole blocks,
sane dims, offsets on the file's alignment, data inside the file and ending where the file
does (an edited alignment reads every tensor shifted), no two tensors sharing a byte, no two
tensors or keys of one name. Names are printable (a newline or a terminal escape in a name
would forge lines of a message), tensor names shorter than ggml's 64 bytes. The file is
opened without blocking and mapped read-only; tensor data is viewed from the map, never
copied here. The descriptor stays open with the header (opened_file.OpenedFile): what a run
reads after open is read through it, not the map, so a file cut short since is an error
rather than SIGBUS.

String arrays (a tokenizer's 300,000 tokens and merges) are walked in one tight loop that
records where each string lies, and are read back from one buffer (gguf_strings), never one
Python call per string.

The result (Header) holds typed values: the GGUF type of each key is kept, so the key checks
(strata_rt.weights.gguf_file.gguf_keys) can refuse a float where a count belongs. Structural damage that stops
the walk is a GGUFError at once; problems of individual tensors are collected in
`Header.problems` so one message lists them all.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...config.files.file_kinds import not_a_file, open_regular
from ...errors import GGUFError
from .gguf_problems import Problems
from .gguf_strings import StringArray
from .gguf_tensors import data_end_problem, tensor_problems
from .opened_file import OpenedFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: GGUF value type id -> (name, struct code, size); 8 string and 9 array are handled apart
SCALARS: dict[int, tuple[str, str, int]] = {
    0: ("uint8", "B", 1), 1: ("int8", "b", 1), 2: ("uint16", "H", 2), 3: ("int16", "h", 2),
    4: ("uint32", "I", 4), 5: ("int32", "i", 4), 6: ("float32", "f", 4), 7: ("bool", "B", 1),
    10: ("uint64", "Q", 8), 11: ("int64", "q", 8), 12: ("float64", "d", 8)}
STRING, ARRAY = 8, 9
INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_TYPES = frozenset({6, 12})
#: ggml's limit on a tensor's dimensions
MAX_DIMS = 4
#: more keys or tensors than any model has; a header claiming more is refused before the walk
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
#: strings in all array keys together (a tokenizer holds about 150,000 tokens and as many
#: merges); walking each costs a step, so this bounds the time a header of empty strings takes
MAX_STRINGS = 1 << 22
#: ggml's GGML_MAX_NAME: a tensor name is shorter (llama.cpp refuses a longer one)
MAX_TENSOR_NAME = 64
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
          28: np.float64}


def type_name(t: int, elem: int | None = None) -> str:
    """'uint32', 'string', 'array of float32', ... for a GGUF value type id."""
    if t == ARRAY:
        return "array" if elem is None else f"array of {type_name(elem)}"
    if t == STRING:
        return "string"
    return SCALARS[t][0] if t in SCALARS else f"type {t}"


@dataclass(frozen=True)
class KeyValue:
    """One key: its GGUF type and value (scalars); arrays keep their element type, count and
    where their elements start, and are decoded on request (`Header.array`)."""

    name: str
    type: int
    value: Any = None
    elem_type: int | None = None
    count: int = 0
    start: int = 0
    #: string arrays: (start, end) of each string's bytes, from the walk
    spans: Any = field(default=None, repr=False, compare=False)

    @property
    def type_name(self) -> str:
        return type_name(self.type, self.elem_type)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the list. `shape` is GGUF's order (innermost first), `offset` the
    absolute byte offset of its data, `n_bytes` its size; `data` views the map as the gguf
    package's reader does (float and integer types typed, block types as uint8 rows)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # GGMLQuantizationType (an int id when the gguf package lacks the type)
    offset: int
    n_bytes: int
    buf: Any = field(default=None, repr=False, compare=False)
    #: the file the bytes lie in (a shard's, for a split model)
    file: str = field(default="", compare=False)
    #: that file as it was opened (OpenedFile): reads after open go through it
    opened: OpenedFile | None = field(default=None, repr=False, compare=False)

    @property
    def data_offset(self) -> int:
        return self.offset

    @property
    def data(self) -> np.ndarray:
        from gguf.quants import quant_shape_to_byte_shape

        raw = np.frombuffer(self.buf, np.uint8, self.n_bytes, self.offset)
        logical = tuple(reversed(self.shape))
        dt = _PLAIN.get(int(self.tensor_type))
        if dt is not None:
            return raw.view(dt).reshape(logical)
        return raw.reshape(quant_shape_to_byte_shape(logical, self.tensor_type))


@dataclass
class Header:
    """A GGUF file's keys and tensors, checked (see the module doc) and memory-mapped."""

    path: Path
    size: int
    version: int
    alignment: int
    data_start: int
    keys: dict[str, KeyValue]
    tensors: list[TensorInfo]
    problems: Problems
    buf: Any = field(default=None, repr=False)
    #: every file of a split model, the first (this header's `path`) first; () for one file
    shards: tuple[Path, ...] = ()

    def value(self, name: str) -> Any:
        """A key's value (arrays as lists), or None when absent."""
        kv = self.keys.get(name)
        if kv is None:
            return None
        return self.array(name) if kv.type == ARRAY else kv.value

    def array(self, name: str) -> list[Any]:
        kv = self.keys[name]
        assert kv.elem_type is not None
        if kv.elem_type == STRING:
            return self.strings(name).decode(name, self.path)
        code, size = SCALARS[kv.elem_type][1:]
        vals = np.frombuffer(self.buf, np.dtype("<" + code), kv.count, kv.start)
        return [bool(v) for v in vals] if kv.elem_type == 7 else vals.tolist()

    def strings(self, name: str) -> StringArray:
        """A string array key as one bytes buffer and offsets (no Python object per
        string)."""
        kv = self.keys[name]
        assert kv.elem_type == STRING and kv.spans is not None
        return StringArray.gather(self.buf, *kv.spans)

    def numbers(self, name: str) -> np.ndarray:
        """An array key of numbers as a numpy array (a view of the map, little-endian)."""
        kv = self.keys[name]
        assert kv.elem_type in SCALARS
        code = SCALARS[kv.elem_type][1]
        return np.frombuffer(self.buf, np.dtype("<" + code), kv.count, kv.start)


# ---------------------------------------------------------------------------- the walk
class _Cut(Exception):
    def __init__(self, end: int):
        self.end = end


class _Fatal(Exception):
    pass


def _beyond(detail: str) -> _Fatal:
    """A length or count that runs past the end of the file: a cut or a corrupt header."""
    return _Fatal(f"its header is cut short or corrupt: {detail}")


def _said(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


#: the rest of a tensor entry after its name and dimension count, by dimension count: the
#: dims, the ggml type id, the offset
_ENTRY_TAIL = {n: struct.Struct(f"<{n}QIQ") for n in range(1, 5)}
_U64 = struct.Struct("<Q")


class _Walker:
    def __init__(self, buf: Any, size: int):
        self.buf, self.size, self.pos = buf, size, 0
        self.strings = 0  # strings in array keys so far

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Cut(self.pos + max(n, 0))

    def scalar(self, code: str, n: int) -> Any:
        self.need(n)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str | Callable[[], str], strict: bool = True) -> str:
        """A length-prefixed string; `strict=False` (values of keys) keeps undecodable bytes
        as U+FFFD, so a stray byte in a description does not refuse the file (a key that is
        used then fails its own check). `what` names it in a message (a callable is called
        only then: a million tensor names cost no million messages)."""
        at = self.pos
        n = self.scalar("Q", 8)
        if n > self.size - self.pos:
            raise _beyond(f"{_said(what)} at byte {at:,} claims {n:,} bytes; only "
                          f"{self.size - self.pos:,} bytes are left in the file")
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            if not strict:
                return raw.decode("utf-8", "replace")
            raise _Fatal(f"{_said(what)} at byte {at:,} is not valid UTF-8 "
                         f"({raw[:24]!r})") from None

    def strings_at(self, name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Walks `count` length-prefixed strings from here: (start, end) of each payload.
        One tight loop (a tokenizer is 300,000 strings); every length is checked against
        the bytes left before the walk moves by it."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        starts = [0] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise _Cut(pos + 8)
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                raise _beyond(f"key {name}: a string at byte {pos - 8:,} claims {n:,} bytes; "
                              f"only {size - pos:,} are left")
            starts[i] = pos
            pos += n
        self.pos = pos
        lo = np.array(starts, np.int64)
        hi = np.empty_like(lo)
        hi[:-1] = lo[1:] - 8
        if count:
            hi[-1] = pos
        return lo, hi

    def value(self, name: str, t: int) -> KeyValue:
        if t in SCALARS:
            _, code, n = SCALARS[t]
            v = self.scalar(code, n)
            if t == 7:
                if v not in (0, 1):
                    raise _Fatal(f"key {name} is a bool holding byte {v}; a bool is 0 or 1")
                v = bool(v)
            return KeyValue(name, t, v)
        if t == STRING:
            return KeyValue(name, t, self.string(f"the string value of key {name}", False))
        if t != ARRAY:
            raise _Fatal(f"key {name} has value type id {t}, which GGUF does not define "
                         "(0-12)")
        elem = self.scalar("I", 4)
        at = self.pos
        count = self.scalar("Q", 8)
        left = self.size - self.pos
        if elem == ARRAY:
            raise _Fatal(f"key {name} is an array of arrays, which GGUF readers do not take")
        if elem == STRING:
            if count > left // 8:
                raise _beyond(f"key {name}: the array at byte {at:,} claims {count:,} "
                              f"strings; the {left:,} bytes left in the file hold at most "
                              f"{left // 8:,}")
            self.strings += count
            if self.strings > MAX_STRINGS:
                raise _Fatal(f"key {name} holds {count:,} strings, {self.strings:,} with the "
                             f"array keys before it; strata_rt reads at most {MAX_STRINGS:,} "
                             "(a tokenizer has about 150,000 tokens and as many merges)")
            start = self.pos
            starts = self.strings_at(name, count)
            return KeyValue(name, t, None, elem, count, start, starts)
        if elem not in SCALARS:
            raise _Fatal(f"key {name} is an array of value type id {elem}, which GGUF does "
                         "not define")
        width = SCALARS[elem][2]
        if count > left // width:
            raise _beyond(f"key {name}: the array at byte {at:,} claims {count:,} "
                          f"{type_name(elem)} values ({count * width:,} bytes); only {left:,} "
                          "bytes are left in the file")
        start = self.pos
        self.pos += count * width
        return KeyValue(name, t, None, elem, count, start)


def _count(w: _Walker, what: str, least: int, cap: int) -> int:
    """A count of the header, refused when beyond `cap` or when the bytes left cannot hold
    that many entries of at least `least` bytes (so no loop runs by an unchecked count)."""
    n = w.scalar("Q", 8)
    if n > cap:
        raise _Fatal(f"the header says the file holds {n:,} {what}; strata_rt reads at most "
                     f"{cap:,} (the count is corrupt)")
    if n * least > w.size - w.pos:
        raise _Fatal(f"its header is cut short or its {what} count is wrong: it lists {n:,} "
                     f"{what}, which need at least {w.pos + n * least:,} bytes; the file has "
                     f"{w.size:,} bytes")
    return n


def _name(w: _Walker, kind: str, i: int, cap: int | None = None) -> str:
    """A key or tensor name: UTF-8 (strict), printable, at most `cap` bytes. Names go into
    every message about their key or tensor, so a newline or a terminal escape in one would
    forge lines of the message, and a megabyte name would fill it."""
    def what() -> str:
        return f"the name of {kind} {i}"

    at = w.pos
    name = w.string(what)
    if cap is not None and w.pos - at - 8 >= cap:
        raise _Fatal(f"{what()} at byte {at:,} is {w.pos - at - 8:,} bytes long "
                     f"({name[:40]!r}...); ggml reads names of at most {cap - 1} bytes")
    if not name.isprintable():
        raise _Fatal(f"{what()} at byte {at:,} holds a control character ({name[:60]!r}); "
                     "names are printable text")
    return name


def _walk(w: _Walker) -> tuple[int, dict[str, KeyValue], list[tuple], Problems]:
    w.need(4)
    magic = bytes(w.buf[0:4])
    if magic != MAGIC:
        raise _Fatal(f"not a GGUF file: it starts with {magic!r}, not the magic {MAGIC!r}")
    w.pos = 4
    version = w.scalar("I", 4)
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and (version >> 16) in (1, 2, 3):
            raise _Fatal("a big-endian GGUF file; strata_rt reads little-endian files only")
        raise _Fatal(f"GGUF version {version}; strata_rt reads versions "
                     f"{', '.join(map(str, VERSIONS))}")
    w.need(16)
    n_tensors = _count(w, "tensors", 8 + 4 + 4 + 8, MAX_TENSORS)
    n_keys = _count(w, "keys", 8 + 4 + 1, MAX_KEYS)
    keys: dict[str, KeyValue] = {}
    problems = Problems()
    for i in range(n_keys):
        name = _name(w, "key", i)
        t = w.scalar("I", 4)
        kv = w.value(name, t)
        if name in keys:
            problems.append(f"key {name} appears twice (which one holds is ambiguous)")
        else:
            keys[name] = kv
    infos = []
    for i in range(n_tensors):
        at = w.pos
        name = _name(w, "tensor", i, MAX_TENSOR_NAME)
        n_dims = w.scalar("I", 4)
        if n_dims > MAX_DIMS or n_dims == 0:
            raise _Fatal(f"tensor {name} (entry {i}, byte {at:,}) has {n_dims:,} dimensions; "
                         f"strata_rt reads tensors of 1 to {MAX_DIMS}")
        tail = _ENTRY_TAIL[n_dims]
        w.need(tail.size)
        *dims, ggml_type, offset = tail.unpack_from(w.buf, w.pos)
        w.pos += tail.size
        infos.append((name, tuple(dims), ggml_type, offset))
    return version, keys, infos, problems


def _alignment(keys: dict[str, KeyValue]) -> int:
    kv = keys.get("general.alignment")
    if kv is None:
        return DEFAULT_ALIGNMENT
    if kv.type != 4:
        raise _Fatal(f"key general.alignment is a {kv.type_name}; GGUF stores it as uint32")
    if kv.value == 0 or kv.value & (kv.value - 1):
        raise _Fatal(f"key general.alignment = {kv.value}; expected a power of two")
    return int(kv.value)


def parse(path: str | Path) -> Header:
    """Opens, maps and checks a GGUF file's header; raises GGUFError naming the file and the
    first damage that stops the walk. Tensor problems are in `.problems`."""
    path = Path(path)
    why = not_a_file(path)
    if why == "no such file":
        raise GGUFError(f"{path}: no such GGUF file")
    if why is not None:
        raise GGUFError(f"{path}: {why}; expected a GGUF file")
    try:
        fd, st = open_regular(path)
    except ValueError as e:
        raise GGUFError(f"{path}: {e}; expected a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        size = st.st_size
        if size == 0:
            raise GGUFError(f"{path}: the file is empty (0 bytes); expected a GGUF file")
        try:
            buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GGUFError(f"{path}: cannot map it for reading: {e}") from None
    except BaseException:
        os.close(fd)
        raise
    opened = OpenedFile(path, fd, st)  # owns the descriptor from here
    w = _Walker(buf, size)
    try:
        version, keys, infos, problems = _walk(w)
        alignment = _alignment(keys)
    except _Cut as e:
        raise GGUFError(f"{path}: not a readable GGUF file: its header is cut short (reading "
                        f"its keys and tensor list needs {e.end:,} bytes; the file has "
                        f"{size:,} bytes)") from None
    except _Fatal as e:
        raise GGUFError(f"{path}: not a readable GGUF file: {e}") from None
    data_start = w.pos + (-w.pos) % alignment
    if infos and data_start >= size and "general.alignment" in keys:
        raise GGUFError(f"{path}: not a readable GGUF file: with key general.alignment = "
                        f"{alignment:,} its data section would start at byte {data_start:,}, "
                        f"past the end of the file ({size:,} bytes): the alignment is wrong "
                        "(or the file is cut short)")
    moved = data_start - (w.pos + (-w.pos) % DEFAULT_ALIGNMENT)
    placed, more = tensor_problems(infos, data_start, alignment, size, max(moved, 0))
    if not more:
        end = data_end_problem(placed, data_start, alignment, size)
        more += [] if end is None else [end]
    tensors = [TensorInfo(name, dims, qt, lo, n, buf, str(path), opened)
               for name, dims, qt, lo, n in placed]
    return Header(path, size, version, alignment, data_start, keys, tensors, problems + more,
                  buf)
