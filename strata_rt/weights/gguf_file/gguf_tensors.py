"""Checks of a GGUF tensor list as a whole: where each tensor's bytes lie, before any is read.

Two expert tensors pointing at one byte range load and run, one layer computing with another
layer's weights; an offset off the file's alignment reads every value shifted by a few bytes;
dims a corrupt header makes huge read as "the file is truncated". Each of these is a problem
named here, from the tensor list alone: an unknown type, rows that are not whole blocks, a
dimension of 0, an offset off the alignment, two tensors sharing bytes (the dims of the first
are named: a tensor running into the next one is usually a wrong dim), a tensor larger than the
whole file, and data past the end of the file (truncation, up to MAX_LISTED named).

An edited or lost `general.alignment` moves the start of the data section by a few bytes and
every tensor is read shifted, yet each offset still looks fine. GGUF writers (the gguf
package, llama.cpp) end the file at the last tensor's end padded to the alignment, so the file's
size is checked against that end (`data_end_problem`): a data section that starts anywhere else
leaves bytes over.

Problems are collected in a `Problems`, which keeps the lines a message shows and counts the
rest: a million bad entries cost a count, not a million lines.
"""

from __future__ import annotations

import math
from typing import Any

from .gguf_problems import Problems

#: tensors named one by one in one kind of problem; the rest are counted
MAX_LISTED = 10


def _spans_overlap(spans: list[tuple[int, int, str]], dims: dict[str, tuple[int, ...]],
                   types: dict[str, str]) -> tuple[Problems, set[str]]:
    """Problems for tensors sharing bytes, one per tensor that others run into; and the
    names involved."""
    hits: dict[str, list[tuple[str, int]]] = {}
    end, owner = -1, ""
    for lo, hi, name in sorted(spans):
        if lo < end:
            hits.setdefault(owner, []).append((name, lo))
        if hi > end:
            end, owner = hi, name
    span = {name: (lo, hi) for lo, hi, name in spans}
    problems, involved = Problems(), set()
    for first, others in hits.items():
        lo, hi = span[first]
        names = ", ".join(n for n, _ in others[:MAX_LISTED])
        more = f" and {len(others) - MAX_LISTED} more" if len(others) > MAX_LISTED else ""
        problems.append(
            f"tensors share bytes: tensor {first} (dims {list(dims[first])} of {types[first]}, "
            f"bytes {lo:,}..{hi:,}) overlaps tensor{'s' if len(others) > 1 else ''} {names}"
            f"{more} (from byte {others[0][1]:,}); each tensor needs bytes of its own, else "
            "one is read as the other (a wrong offset or dim)")
        involved.add(first)
        involved.update(n for n, _ in others)
    return problems, involved


#: (name, dims innermost first, GGMLQuantizationType, absolute offset, bytes)
Placed = tuple[str, tuple[int, ...], Any, int, int]


def nbytes_of(shape: tuple[int, ...], block: int, type_bytes: int) -> int:
    """Bytes of a tensor of `shape` (Python ints: no overflow however absurd the dims)."""
    return math.prod(shape) // block * type_bytes


def tensor_problems(infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
                    alignment: int, size: int, moved: int = 0
                    ) -> tuple[list[Placed], Problems]:
    """infos: (name, dims innermost first, ggml type id, offset in the data section) as the
    header lists them; moved: how many bytes later a declared alignment puts the data
    section than the default one would (a truncation by no more is blamed on the key too).
    -> (the tensors that passed, every problem)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    problems = Problems()
    seen: set[str] = set()
    placed: list[Placed] = []
    kinds: dict[int, tuple[Any, int, int] | None] = {}  # type id -> (type, block, bytes)
    for name, dims, t, off in infos:
        if name in seen:
            problems.append(f"tensor {name} appears twice in the tensor list (which one holds "
                            "is ambiguous)")
            continue
        seen.add(name)
        if t not in kinds:
            try:
                qt = GGMLQuantizationType(t)
                kinds[t] = (qt, *GGML_QUANT_SIZES[qt])
            except (ValueError, KeyError):
                kinds[t] = None
        kind = kinds[t]
        if kind is None:
            problems.append(f"tensor {name} has type id {t}, which this gguf package does not "
                            "know")
            continue
        qt, block, type_bytes = kind
        if 0 in dims:
            problems.append(f"tensor {name} has dims {list(dims)}; every dimension must be at "
                            "least 1")
            continue
        if dims[0] % block:
            problems.append(f"tensor {name}: rows of {dims[0]} values are not a multiple of the "
                            f"{qt.name} block of {block}")
            continue
        nbytes = nbytes_of(dims, block, type_bytes)
        if nbytes > size:
            many = f"{nbytes:,} bytes" if nbytes < 1 << 64 else "more than 2^64 bytes"
            problems.append(f"tensor {name} has dims {list(dims)} of {qt.name}: {many}, more "
                            f"than the whole file ({size:,} bytes); its dims are wrong (or the "
                            "file is truncated)")
            continue
        if off % alignment:
            problems.append(f"tensor {name} starts at offset {off:,} of the data section, not "
                            f"a multiple of the file's alignment ({alignment}): its values "
                            "would be read shifted")
            continue
        placed.append((name, dims, qt, data_start + off, nbytes))
    overlap, involved = _spans_overlap(
        [(lo, lo + n, name) for name, _, _, lo, n in placed],
        {p[0]: p[1] for p in placed}, {p[0]: p[2].name for p in placed})
    problems += overlap
    short = [(name, lo, lo + n) for name, _, _, lo, n in placed
             if lo + n > size and name not in involved]
    over = max((hi for _, _, hi in short), default=size) - size
    if 0 < over <= moved:
        problems.append(f"with the file's alignment ({alignment}) the data section starts "
                        f"at byte {data_start:,}, {moved:,} bytes later than the default "
                        f"alignment puts it, and the tensors then end {over:,} bytes past the "
                        "file: key general.alignment is wrong (or the file is cut short)")
    for name, lo, hi in short[:MAX_LISTED]:
        if lo < size:
            problems.append(f"the file is truncated: tensor {name} needs bytes {lo:,}..{hi:,} "
                            f"({hi - lo:,} bytes); the file has {size:,} bytes")
        else:
            problems.append(f"tensor {name} starts at byte {lo:,}, past the end of the file "
                            f"({size:,} bytes): the file is truncated or the offset is wrong")
    if len(short) > MAX_LISTED:
        problems.append(f"{len(short) - MAX_LISTED} more tensors end past the file's "
                        f"{size:,} bytes")
    ok = [p for p in placed if p[3] + p[4] <= size and p[0] not in involved]
    return ok, problems


def data_end_problem(placed: list[Placed], data_start: int, alignment: int, size: int
                     ) -> str | None:
    """The problem when the file does not end where its tensors do: from the end of the last
    tensor up to that end padded to the alignment (what writers produce). Bytes beyond mean
    the data section starts later than the alignment puts it (an edited or missing
    `general.alignment`: every tensor would be read shifted) or bytes were appended. Tensors
    that run past the file are truncation, named by `tensor_problems`."""
    if not placed:
        return None
    name, _, _, lo, n = max(placed, key=lambda p: p[3] + p[4])
    end = lo + n
    padded = end + (data_start - end) % alignment
    if size <= padded:
        return None
    pad = f", {padded:,} with the padding to the alignment" if padded > end else ""
    return (f"the file holds {size - padded:,} bytes past its last tensor ({name} ends at byte "
            f"{end:,}{pad}; the file has {size:,} bytes): the data section does not start where the alignment "
            f"({alignment}) puts it (byte {data_start:,}), so every tensor would be read "
            "shifted; key general.alignment is wrong, or bytes were added to the file")
