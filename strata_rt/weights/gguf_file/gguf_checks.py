"""NaN/Inf checks of the GGUF tensors the engine reads, vectorized over whole tensors.

A NaN in a router row, a norm weight or one block scale of one expert loads without a word and
turns every token that touches it into NaN, with exit code 0. These checks run at load (each
expert tensor just before its bytes are copied or converted) and in `strata inspect`, and
name the tensor, the layer and the experts. A Qwen3-30B-shaped file holds 18,432 expert
matrices: each check is a handful of numpy operations over one whole tensor, no Python loop
per expert or block.

Expert tensors are checked in their GGUF encoding: float types by their values, block types
by the scale fields every block carries (the fp16 `d` of IQ3_XXS's 98-byte block, `d` and
`dmin` of the K-quants, ...), read straight from the bytes. A block type with no entry in
`F16_SCALES` is dequantized by the gguf package and its values checked.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from ...formats.ggml_types import F16_SCALES

#: float types: GGML type id -> (unsigned view, exponent mask); all exponent bits set = NaN/Inf
FLOAT_BITS = {0: (np.uint32, 0x7F800000), 1: (np.uint16, 0x7C00), 30: (np.uint16, 0x7F80),
              28: (np.uint64, 0x7FF0000000000000)}
#: experts named one by one in a message; the rest are counted
MAX_NAMED = 8


@cache
def dequantizable(ggml_type: int) -> bool:
    """Whether the gguf package turns this type into float values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qt = GGMLQuantizationType(int(ggml_type))
        dequantize(np.zeros(GGML_QUANT_SIZES[qt][1], np.uint8), qt)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def typed(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes of a tensor (or of its first rows) as the gguf reader presents them: float
    types as their dtype in `shape`, block types as uint8 rows of blocks."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
             Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
    dt = plain.get(Q(ggml_type))
    if dt is not None:
        return raw.view(dt).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, Q(ggml_type)))


def _exponent_all_ones(raw: np.ndarray, dtype: Any, mask: int) -> np.ndarray:
    bits = raw.view(dtype)
    return (bits & dtype(mask)) == dtype(mask)


def bad_counts(raw: np.ndarray, ggml_type: int, n_experts: int, block_bytes: int
               ) -> tuple[np.ndarray, int, str] | None:
    """Non-finite fields per expert of one expert tensor. raw: its bytes (uint8, contiguous,
    n_experts equal parts). -> (count per expert, fields per expert, what the fields are), or
    None when the type has no direct check (the caller dequantizes)."""
    raw = np.ascontiguousarray(raw).reshape(-1)
    t = int(ggml_type)
    if t in FLOAT_BITS:
        dtype, mask = FLOAT_BITS[t]
        bad = _exponent_all_ones(raw, dtype, mask)
        what = "weights"
    elif t in F16_SCALES:
        what = "fp16 block scale d" if len(F16_SCALES[t]) == 1 else "fp16 block scales"
        if block_bytes % 2 == 0:
            words = raw.view("<u2").reshape(-1, block_bytes // 2)
            fields = [words[:, off // 2] for off in F16_SCALES[t]]
        else:  # no built-in type has odd blocks; kept general
            blocks = raw.reshape(-1, block_bytes)
            fields = [blocks[:, off].astype(np.uint16) | blocks[:, off + 1].astype(np.uint16)
                      << np.uint16(8) for off in F16_SCALES[t]]
        bad = np.zeros(fields[0].shape, bool)
        for f in fields:
            bad |= (f & np.uint16(0x7C00)) == np.uint16(0x7C00)
    elif t == 39:  # MXFP4: e8m0 block exponent, 0xFF is NaN
        bad = raw.reshape(-1, block_bytes)[:, 0] == 0xFF
        what = "e8m0 block exponents"
    else:
        return None
    per = bad.reshape(n_experts, -1)
    return per.sum(axis=1), per.shape[1], what


def dequantized_counts(data: np.ndarray, ggml_type: int) -> tuple[np.ndarray, int, str] | None:
    """The fallback: data as the gguf reader presents it [n_experts, ...]; None when the gguf
    package cannot dequantize the type."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if not dequantizable(ggml_type):
        return None
    qt = GGMLQuantizationType(int(ggml_type))
    n = data.shape[0]
    counts = np.zeros(n, np.int64)
    size = 0
    for e in range(n):  # one expert at a time bounds the float32 copy
        with np.errstate(all="ignore"):  # counted below, not warned about
            vals = np.asarray(dequantize(data[e], qt))
        counts[e] = int(np.count_nonzero(~np.isfinite(vals)))
        size = vals.size
    return counts, size, "dequantized weights"


def describe(name: str, layer: int, counts: np.ndarray, size: int, what: str,
             first_expert: int = 0) -> str | None:
    """The problem line for one tensor, or None when every count is zero."""
    hit = np.flatnonzero(counts)
    if hit.size == 0:
        return None
    listed = ", ".join(f"expert {first_expert + int(e)} ({int(counts[e]):,} of {size:,})"
                       for e in hit[:MAX_NAMED])
    more = f" and {hit.size - MAX_NAMED} more" if hit.size > MAX_NAMED else ""
    return (f"tensor {name} (layer {layer}): NaN or Inf in the {what} of {hit.size} "
            f"expert(s): {listed}{more}")


def check_router(name: str, layer: int, router: np.ndarray) -> list[str]:
    """router float32 [n_experts, hidden]: row e is expert e's logit weights."""
    bad = ~np.isfinite(router)
    if not bad.any():
        return []
    rows = np.flatnonzero(bad.any(axis=1))
    listed = ", ".join(f"expert {int(e)} (column {int(np.flatnonzero(bad[e])[0])})"
                       for e in rows[:MAX_NAMED])
    more = f" and {rows.size - MAX_NAMED} more" if rows.size > MAX_NAMED else ""
    return [f"tensor {name} (layer {layer}, router): NaN or Inf in the rows of {rows.size} "
            f"expert(s): {listed}{more}"]


def check_norm(name: str, layer: int, norm: np.ndarray) -> list[str]:
    cols = np.flatnonzero(~np.isfinite(norm))
    if cols.size == 0:
        return []
    listed = ", ".join(str(int(c)) for c in cols[:MAX_NAMED])
    more = f" and {cols.size - MAX_NAMED} more" if cols.size > MAX_NAMED else ""
    return [f"tensor {name} (layer {layer}, norm): {cols.size} NaN or Inf value(s), at "
            f"column(s) {listed}{more}"]


#: bytes of a dense tensor checked at once (bounds the temporaries of a large embedding)
DENSE_CHUNK_BYTES = 64 << 20


def check_dense(name: str, data: np.ndarray, ggml_type: int, shape: tuple[int, ...]
                ) -> str | None:
    """One dense weight as a DenseTensor holds it (float values, or uint8 rows of blocks),
    `shape` logical (rows outermost): the problem line naming its rows with NaN/Inf, or None.
    A NaN in one embedding row or attention weight loads silently and makes every logit that
    touches it NaN; checked in chunks of rows, so a 1 GiB embedding needs no 1 GiB copy."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qt = GGMLQuantizationType(int(ggml_type))
    block_bytes = GGML_QUANT_SIZES[qt][1]
    rows = shape[0] if len(shape) > 1 else 1
    flat = np.ascontiguousarray(data).reshape(rows, -1)
    row_bytes = flat.nbytes // rows
    step = max(1, DENSE_CHUNK_BYTES // max(row_bytes, 1))
    counts = np.zeros(rows, np.int64)
    size, what = 0, "weights"
    for lo in range(0, rows, step):
        part = flat[lo: lo + step]
        found = bad_counts(part.reshape(-1).view(np.uint8), int(qt), part.shape[0],
                           block_bytes)
        if found is None:
            if not dequantizable(int(qt)):
                return None  # the loader refuses the type itself
            with np.errstate(all="ignore"):  # counted below, not warned about
                vals = np.asarray(dequantize(part, qt)).reshape(part.shape[0], -1)
            found = ((~np.isfinite(vals)).sum(axis=1), vals.shape[1], "dequantized weights")
        counts[lo: lo + part.shape[0]], size, what = found
    hit = np.flatnonzero(counts)
    if hit.size == 0:
        return None
    listed = ", ".join(f"row {int(r)} ({int(counts[r]):,} of {size:,})" for r in hit[:MAX_NAMED])
    more = f" and {hit.size - MAX_NAMED} more" if hit.size > MAX_NAMED else ""
    return f"tensor {name}: NaN or Inf in the {what} of {hit.size} row(s): {listed}{more}"


def check_expert_bytes(name: str, layer: int, raw: np.ndarray, ggml_type: int,
                       shape: tuple[int, ...], first_expert: int = 0) -> str | None:
    """One expert tensor (or a run of its experts): raw uint8 bytes, `shape` the logical
    [n_experts, rows, cols] of those bytes. -> the problem line, or None."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))][1]
    found = bad_counts(raw, ggml_type, shape[0], block_bytes)
    if found is None:
        found = dequantized_counts(typed(raw, ggml_type, shape), ggml_type)
    if found is None:
        return None  # the loader refuses the type itself, with its own message
    return describe(name, layer, *found, first_expert=first_expert)


def check_experts(moe: Any, file_map: Any, on_layer: Callable[[int], None] | None = None
                  ) -> list[str]:
    """Every expert tensor of a scanned MoEFile, a tensor at a time, each released from the
    map after its check. `strata inspect` runs this over the whole file; `on_layer(layer)`
    is called after each layer (progress)."""
    problems = []
    for layer, refs in enumerate(moe.experts):
        for ref in (refs or {}).values():
            bad = check_expert_bytes(ref.name, layer, file_map.bytes(ref), ref.ggml_type,
                                     ref.shape)
            file_map.release(ref)
            if bad is not None:
                problems.append(bad)
        if on_layer is not None:
            on_layer(layer)
    return problems


def shape_problem(name: str, part: str, shape: tuple[int, ...], want: tuple[int, ...],
                  arch: str, dims: dict[str, Any]) -> str | None:
    """Why a tensor's shape (outermost first) is not the one the keys give, or None; an
    expert tensor whose expert axis alone differs is said in those terms."""
    if shape == want:
        return None
    E = dims["n_experts"]
    if len(shape) == len(want) and part != "norm" and shape[0] != E and shape[1:] == want[1:]:
        return f"tensor {name} holds {shape[0]} experts but key {arch}.expert_count = {E}"
    return (f"tensor {name} has shape {list(shape)}; expected {list(want)} from the keys "
            f"(n_experts={E}, ffn={dims['ffn']}, hidden={dims['hidden']})")


def dims_against_tensors(tensors: Any, arch: str, dims: dict[str, Any]) -> list[str]:
    """Where layer 0's router or gate experts disagree with the dims the keys give (a damaged
    or edited header): the first such tensor, named when the header is read, so a mismatch is
    the file's problem and not a prompt's or a budget's further on."""
    E, F, H = dims["n_experts"], dims["ffn"], dims["hidden"]
    want = {"blk.0.ffn_gate_inp.weight": ("router", (E, H)),
            "blk.0.ffn_gate_exps.weight": ("gate", (E, F, H))}
    for t in tensors:
        if t.name in want:
            part, shape = want[t.name]
            got = tuple(int(x) for x in reversed(list(t.shape)))  # outermost first
            why = shape_problem(t.name, part, got, shape, arch, dims)
            if why is not None:
                return [why]
    return []
