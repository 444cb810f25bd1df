"""The format a GGUF's experts run in when the config names none: the loaded format whose GGML
type is the type of the file's expert tensors, so `model: {gguf: FILE}` alone runs the file's
bytes as they are (a raw copy, no conversion).

A format holds one encoding for all of an expert's weights, so the three expert tensors of
every layer must share one type. Many downloaded quantizations mix types (ffn_down a few bits
wider than gate and up); such a file is refused here with the mix listed per tensor, and runs
once the config names a format, to which every expert tensor is then converted.
"""

from __future__ import annotations

from typing import Any

from .gguf_header import Header

#: tensors named per type in a message; the rest are counted
MAX_NAMED = 6


def expert_types(header: Header) -> dict[str, int]:
    """The GGML type id of every expert tensor (blk.N.ffn_{gate,up,down}_exps.weight)."""
    return {t.name: int(t.tensor_type) for t in header.tensors
            if t.name.startswith("blk.") and t.name.endswith("_exps.weight")}


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def file_format(header: Header, registry: Any) -> tuple[str | None, str | None]:
    """(the loaded format whose `ggml_type` is the expert tensors' type, None) or (None, why
    not: no expert tensors, types mixed per tensor, or no loaded format of that type)."""
    types = expert_types(header)
    if not types:
        return None, "the file holds no expert tensors (blk.N.ffn_*_exps.weight) to take a " \
                     "format from; name one with `format:`"
    by_type: dict[int, list[str]] = {}
    for name, t in types.items():
        by_type.setdefault(t, []).append(name)
    if len(by_type) > 1:
        parts = []
        for t, names in sorted(by_type.items(), key=lambda kv: -len(kv[1])):
            listed = ", ".join(names[:MAX_NAMED])
            more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
            parts.append(f"{_type_name(t)} ({len(names)}): {listed}{more}")
        return None, ("its expert tensors are of mixed types, and a format holds one type "
                      "for all of them: " + "; ".join(parts) + ". Name a format with "
                      "`format:` to convert every expert tensor to it")
    (t,) = by_type
    loaded = {n: lf.format for n, lf in registry.formats.items()}
    for name, fmt in loaded.items():
        if fmt.ggml_type == t:
            return name, None
    offered = ", ".join(f"{n} ({_type_name(f.ggml_type)})" if f.ggml_type is not None
                        else f"{n} (no GGUF type)" for n, f in loaded.items()) or "none"
    return None, (f"its expert tensors are {_type_name(t)}, which no loaded format stores "
                  f"(loaded: {offered}); name one with `format:` to convert them to it")
