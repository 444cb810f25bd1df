"""GGUF files built byte by byte, for tests of hostile headers.

GGUFWriter writes only valid files, so a test of a float block count, a 2^63 array length or
two tensors on one byte range takes a good file apart (keys with their GGUF types and raw
payloads, the tensor list with relative offsets, the data section), changes what it wants and
writes the bytes back with any counts, types, dims and offsets."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata_rt.weights.gguf_file.gguf_header import ARRAY, SCALARS, STRING, parse

U8, I32, U32, F32, BOOL, U64, F64 = 0, 5, 4, 6, 7, 10, 12


def value_bytes(t: int, v: Any, elem: int | None = None) -> bytes:
    """The payload of one value of GGUF type t (arrays: `v` a list of `elem` values)."""
    if t == STRING:
        b = v if isinstance(v, bytes) else v.encode()
        return struct.pack("<Q", len(b)) + b
    if t == ARRAY:
        assert elem is not None
        return struct.pack("<IQ", elem, len(v)) + b"".join(value_bytes(elem, x) for x in v)
    return struct.pack("<" + SCALARS[t][1], v)


@dataclass
class Doc:
    keys: list[list[Any]]      # [name (str or raw bytes), type id, payload bytes]
    tensors: list[list[Any]]   # [name, dims innermost first, ggml type id, offset in data]
    data: bytes
    version: int = 3
    alignment: int = 32

    @classmethod
    def of(cls, path: Path) -> Doc:
        h = parse(path)
        keys = [[kv.name, kv.type,
                 value_bytes(ARRAY, h.array(kv.name), kv.elem_type) if kv.type == ARRAY
                 else value_bytes(kv.type, kv.value)] for kv in h.keys.values()]
        tensors = [[t.name, list(t.shape), int(t.tensor_type), t.offset - h.data_start]
                   for t in h.tensors]
        return cls(keys, tensors, path.read_bytes()[h.data_start:], h.version, h.alignment)

    def copy(self) -> Doc:
        return Doc([list(k) for k in self.keys], [[n, list(d), t, o] for n, d, t, o in
                                                  self.tensors], self.data, self.version,
                   self.alignment)

    def set(self, name: str, t: int, v: Any = None, elem: int | None = None, *,
            payload: bytes | None = None) -> Doc:
        """Sets key `name` to a value of type t (or to raw payload bytes), in place."""
        raw = payload if payload is not None else value_bytes(t, v, elem)
        for k in self.keys:
            if k[0] == name:
                k[1], k[2] = t, raw
                return self
        self.keys.append([name, t, raw])
        return self

    def drop(self, name: str) -> Doc:
        self.keys = [k for k in self.keys if k[0] != name]
        return self

    def tensor(self, name: str) -> list[Any]:
        return next(t for t in self.tensors if t[0] == name)

    def to_bytes(self, n_tensors: int | None = None, n_keys: int | None = None) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", self.version,
                                    len(self.tensors) if n_tensors is None else n_tensors,
                                    len(self.keys) if n_keys is None else n_keys)]
        for name, t, payload in self.keys:
            out += [value_bytes(STRING, name), struct.pack("<I", t), payload]
        for name, dims, t, off in self.tensors:
            out += [value_bytes(STRING, name), struct.pack("<I", len(dims)),
                    struct.pack(f"<{len(dims)}Q", *dims), struct.pack("<IQ", t, off)]
        head = b"".join(out)
        return head + b"\0" * (-len(head) % self.alignment) + self.data

    def write(self, path: Path, **counts: int) -> Path:
        path.write_bytes(self.to_bytes(**counts))
        return path
