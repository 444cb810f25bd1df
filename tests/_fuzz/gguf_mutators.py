"""Seeded mutators of a GGUF file: one to three edits per case, aimed at what a reader trusts.

Integer fields (counts, string lengths, value and tensor types, dims, offsets) get boundary
values; floats get NaN, infinities and extremes; names and keys get foreign bytes or another
entry's name; the file is cut at a field or grown; tensor data gets NaN where the engine reads
floats. Each mutant carries a description precise enough to rebuild it by hand."""

from __future__ import annotations

import random
import struct

from .gguf_layout import Field, Layout

#: float32 values that break arithmetic downstream (the last is finite but squares to inf)
HOSTILE_FLOATS = (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, 1e-45, 3e38)


def _ints(value: int, size: int, rng: random.Random) -> int:
    top = (1 << (8 * size)) - 1
    pool = [0, 1, 2, 3, value - 1, value + 1, value * 2, value * 256, top, top >> 1,
            (top >> 1) + 1, 0x7FFFFFFF, 0x80000000, 1 << 40, rng.randrange(top + 1)]
    return rng.choice(pool) & top


def _put(buf: bytearray, f: Field, raw: bytes) -> None:
    buf[f.offset: f.offset + f.size] = raw[: f.size].ljust(f.size, b"\0")


def _int_field(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    fields = [f for f in lay.fields if f.code in ("I", "Q", "i", "q", "H", "B")]
    # the fields readers size things by, drawn more often than plain values
    hot = [f for f in fields if f.name.endswith(("len", "count", "n_dims", "type", "offset",
                                                 "n_tensors", "n_kv", "version"))
           or ".dims[" in f.name]
    f = rng.choice(hot if rng.random() < 0.8 else fields)
    (old,) = struct.unpack_from("<" + f.code.upper(), buf, f.offset)
    new = _ints(int(old), f.size, rng)
    _put(buf, f, struct.pack("<" + f.code.upper(), new))
    return f"{f.name} {old} -> {new}"


def _float_field(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    fields = [f for f in lay.fields if f.code in ("f", "d")]
    if not fields:
        return _int_field(buf, lay, rng)
    f = rng.choice(fields)
    v = rng.choice(HOSTILE_FLOATS)
    _put(buf, f, struct.pack("<" + f.code, v))
    return f"{f.name} -> {v!r}"


def _name(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    fields = [f for f in lay.fields if f.code == "bytes" and f.size > 0
              and f.name != "header.magic"]
    f = rng.choice(fields)
    how = rng.randrange(4)
    if how == 0:  # another entry's name of the same length: a duplicate key or tensor
        same = [g for g in fields if g.size == f.size and g is not f
                and g.name.split(".")[0][:3] == f.name.split(".")[0][:3]]
        if same:
            g = rng.choice(same)
            _put(buf, f, bytes(buf[g.offset: g.offset + g.size]))
            return f"{f.name} := {g.name} (a duplicate name)"
    if how <= 1:  # bytes that are not UTF-8
        at = f.offset + rng.randrange(f.size)
        buf[at] = rng.choice([0x80, 0xC3, 0xFF, 0xFE])
        return f"{f.name}: byte {at - f.offset} -> invalid UTF-8"
    if how == 2:
        at = f.offset + rng.randrange(f.size)
        buf[at] = 0
        return f"{f.name}: byte {at - f.offset} -> NUL"
    at = f.offset + rng.randrange(f.size)
    buf[at] = rng.randrange(0x21, 0x7F)
    return f"{f.name}: byte {at - f.offset} -> {chr(buf[at])!r}"


def _magic(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    new = rng.choice([b"GGUG", b"GGML", b"\0\0\0\0", b"FUGG", b"ggjt"])
    buf[0:4] = new
    return f"header.magic -> {new!r}"


def _swap_offsets(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    offs = lay.of("tensor[")
    offs = [f for f in offs if f.name.endswith(".offset")]
    a, b = rng.sample(offs, 2)
    va, vb = bytes(buf[a.offset: a.offset + 8]), bytes(buf[b.offset: b.offset + 8])
    buf[a.offset: a.offset + 8], buf[b.offset: b.offset + 8] = vb, va
    return f"swap {a.name} and {b.name}"


def _truncate(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.5:  # at a field boundary, or inside a field
        f = rng.choice(lay.fields)
        cut = f.offset + rng.randrange(f.size + 1)
    elif pick < 0.6:
        cut = rng.randrange(0, 4)
    else:  # inside the data section: a tensor's bytes cut short
        cut = rng.randrange(lay.data_start, len(buf))
    del buf[cut:]
    return f"truncated to {cut} bytes"


def _extend(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    n = rng.choice([1, 7, 31, 4096])
    buf.extend(rng.randbytes(n))
    return f"{n} junk bytes appended"


def _flip(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    """Random bytes anywhere in the header and tables (what the structured edits miss)."""
    done = []
    for _ in range(rng.randint(1, 6)):
        at = rng.randrange(min(len(buf), lay.data_start))
        buf[at] = rng.randrange(256)
        done.append(str(at))
    return "header bytes " + ",".join(done) + " randomised"


def _data(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    """A hostile float32 into an F32 tensor (router rows, norms), or into an expert's bytes."""
    f32 = [t for t in lay.tensors if t[1] == 0]
    if f32 and rng.random() < 0.7:
        name, _, dims, off = rng.choice(f32)
        count = 1
        for d in dims:
            count *= d
        i = rng.randrange(count)
        v = rng.choice(HOSTILE_FLOATS)
        struct.pack_into("<f", buf, lay.data_start + off + 4 * i, v)
        return f"{name}[{i}] -> {v!r}"
    name, _, _, off = rng.choice(lay.tensors)
    at = min(len(buf) - 2, lay.data_start + off + rng.randrange(4096))
    buf[at: at + 2] = rng.choice([b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", rng.randbytes(2)])
    return f"{name}: 2 bytes at file offset {at} (an fp16 scale's width) changed"


MUTATORS = ((_int_field, 30), (_float_field, 6), (_name, 10), (_magic, 2), (_swap_offsets, 5),
            (_truncate, 12), (_extend, 3), (_flip, 10), (_data, 12))


def mutate_gguf(data: bytes, lay: Layout, rng: random.Random) -> tuple[bytes, str]:
    """A mutant of `data` (whose layout is `lay`) and what was done to it."""
    buf = bytearray(data)
    funcs, weights = zip(*MUTATORS)
    chosen = rng.choices(funcs, weights, k=rng.choice([1, 1, 1, 2, 3]))
    # a cut goes last, so that the other edits hit bytes still there
    order = [f for f in chosen if f is not _truncate] + [_truncate] * (_truncate in chosen)
    what = "; ".join(step(buf, lay, rng) for step in order)
    return bytes(buf), what
