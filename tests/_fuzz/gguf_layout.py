"""Where each field of a GGUF file's header, key/value table and tensor table lies, so the
mutators hit the fields a reader trusts (counts, lengths, types, dims, offsets) instead of
spending most cases on expert bytes no reader parses.

The layout follows the GGUF spec (version 3, little-endian): magic, version u32, tensor count
u64, key count u64; each key a u64-length string, a u32 value type and the value (arrays: a
u32 item type, a u64 count, the items); each tensor a name, u32 n_dims, n_dims u64 dims, a u32
GGML type and a u64 offset into the data section, which starts at the next multiple of
general.alignment (default 32)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

#: value type -> (struct code, byte size) of GGUF's scalar types
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
           6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9
#: array items whose length fields are listed (the rest are skipped over)
ARRAY_ITEMS_LISTED = 4


@dataclass(frozen=True)
class Field:
    """One field: where it lies, its width and how it is read ("I", "Q", "f", "bytes")."""

    name: str
    offset: int
    size: int
    code: str


@dataclass
class Layout:
    fields: list[Field] = field(default_factory=list)
    #: (name, ggml type, dims, data offset) of every tensor, in table order
    tensors: list[tuple[str, int, tuple[int, ...], int]] = field(default_factory=list)
    #: byte offset where the tensor table ends, and where the data section starts
    table_end: int = 0
    data_start: int = 0

    def of(self, prefix: str) -> list[Field]:
        return [f for f in self.fields if f.name.startswith(prefix)]


class _Cursor:
    def __init__(self, data: bytes, layout: Layout):
        self.data, self.pos, self.layout = data, 0, layout

    def take(self, name: str, code: str) -> int | float:
        size = struct.calcsize("<" + code)
        (value,) = struct.unpack_from("<" + code, self.data, self.pos)
        self.layout.fields.append(Field(name, self.pos, size, code))
        self.pos += size
        return value

    def string(self, name: str, listed: bool = True) -> str:
        n = int(self.take(f"{name}.len", "Q")) if listed else self._skip_len()
        raw = self.data[self.pos: self.pos + n]
        if listed:
            self.layout.fields.append(Field(f"{name}.bytes", self.pos, n, "bytes"))
        self.pos += n
        return raw.decode("utf-8", "replace")

    def _skip_len(self) -> int:
        (n,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return int(n)

    def value(self, name: str, vtype: int) -> object:
        if vtype == STRING:
            return self.string(name)
        if vtype == ARRAY:
            itype = int(self.take(f"{name}.item_type", "I"))
            count = int(self.take(f"{name}.count", "Q"))
            items = []
            for i in range(count):
                listed = i < ARRAY_ITEMS_LISTED
                if itype == STRING:
                    items.append(self.string(f"{name}[{i}]", listed))
                elif itype in SCALARS:
                    code, size = SCALARS[itype]
                    if listed:
                        items.append(self.take(f"{name}[{i}]", code))
                    else:
                        self.pos += size
                else:
                    raise ValueError(f"array of type {itype}")
            return items
        code, _ = SCALARS[vtype]
        return self.take(f"{name}.value", code)


def parse(data: bytes) -> Layout:
    """The layout of a well-formed GGUF file (the fuzzer's seeds: it never parses mutants)."""
    layout = Layout()
    cur = _Cursor(data, layout)
    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    layout.fields.append(Field("header.magic", 0, 4, "bytes"))
    cur.pos = 4
    cur.take("header.version", "I")
    n_tensors = int(cur.take("header.n_tensors", "Q"))
    n_kv = int(cur.take("header.n_kv", "Q"))
    alignment = 32
    for i in range(n_kv):
        key = cur.string(f"kv[{i}].key")
        vtype = int(cur.take(f"kv[{i}].type", "I"))
        value = cur.value(f"kv[{i}]", vtype)
        if key == "general.alignment":
            alignment = int(value)  # type: ignore[call-overload]
    for i in range(n_tensors):
        name = cur.string(f"tensor[{i}].name")
        n_dims = int(cur.take(f"tensor[{i}].n_dims", "I"))
        dims = tuple(int(cur.take(f"tensor[{i}].dims[{d}]", "Q")) for d in range(n_dims))
        ttype = int(cur.take(f"tensor[{i}].type", "I"))
        offset = int(cur.take(f"tensor[{i}].offset", "Q"))
        layout.tensors.append((name, ttype, dims, offset))
    layout.table_end = cur.pos
    layout.data_start = -(-cur.pos // alignment) * alignment
    return layout
