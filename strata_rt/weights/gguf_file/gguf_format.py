"""The formats a GGUF's experts run in when the config names none: per layer, the loaded
format of the layer's expert tensors' type, so `model: {gguf: FILE}` alone runs the file's bytes
as they are (a raw copy, no conversion).

Downloaded quantizations mix types: llama.cpp's Q4_K_M keeps some layers' ffn_down in Q6_K,
Q3_K_M all of them in Q4_K, and community mixes override tensors one by one. A layer whose down
tensor differs from its gate and up runs the down_typed format of the pair (each part decoded by
its own type's gathers, the products shared); layers differ freely (weights.layer_formats). A
layer whose gate and up tensors differ in type is refused, naming them: it runs once the config
names a format, to which every expert tensor is then converted.
"""

from __future__ import annotations

from typing import Any

from ..layer_formats import LayerFormats
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


def _layer_types(types: dict[str, int]) -> dict[int, dict[str, int]]:
    """{layer: {"gate" | "up" | "down": type id}} from the expert tensors' names."""
    layers: dict[int, dict[str, int]] = {}
    for name, t in types.items():
        parts = name.split(".")  # blk.N.ffn_<part>_exps.weight
        if len(parts) == 4 and parts[1].isdigit() and parts[2].startswith("ffn_"):
            layers.setdefault(int(parts[1]), {})[parts[2][4:-5]] = t
    return layers


def file_layer_formats(header: Header, registry: Any, hidden: int, ffn: int
                       ) -> tuple[LayerFormats | None, str | None]:
    """(each layer's format as the file stores its experts, None) or (None, why not). A
    layer's format is the loaded format of its one type (the registry's object, default
    variant), or down_typed(gate/up type, down type) where only the down tensor differs."""
    from ...formats.ggml_format import down_typed
    from ...formats.ggml_types import BY_ID

    types = expert_types(header)
    if not types:
        return None, "the file holds no expert tensors (blk.N.ffn_*_exps.weight) to take a " \
                     "format from; name one with `format:`"
    loaded = {lf.format.ggml_type: lf.format for lf in registry.formats.values()
              if lf.format.ggml_type is not None}
    formats, problems = [], []
    by_pair: dict[tuple[int, int], Any] = {}
    for layer, parts in sorted(_layer_types(types).items()):
        g, u, d = (parts.get(k) for k in ("gate", "up", "down"))
        if g is None or u is None or d is None:
            problems.append(f"layer {layer} lacks an expert tensor")
        elif g != u:
            problems.append(f"layer {layer}: ffn_gate_exps is {_type_name(g)} and ffn_up_exps "
                            f"{_type_name(u)} (the gate/up products need one type)")
        elif g not in loaded:
            problems.append(f"layer {layer}: {_type_name(g)}, which no loaded format stores")
        elif d == g:
            formats.append(loaded[g].for_variant(None))
        elif g in BY_ID and d in BY_ID:
            if (g, d) not in by_pair:
                by_pair[(g, d)] = down_typed(BY_ID[g].name, BY_ID[d].name)()
            formats.append(by_pair[(g, d)])
        else:
            problems.append(f"layer {layer}: down {_type_name(d)} beside gate/up "
                            f"{_type_name(g)} has no built-in decoder")
    if problems:
        shown = "; ".join(problems[:MAX_NAMED])
        more = f" and {len(problems) - MAX_NAMED} more" if len(problems) > MAX_NAMED else ""
        offered = ", ".join(f"{lf.format.name} ({_type_name(lf.format.ggml_type)})"
                            if lf.format.ggml_type is not None else f"{lf.format.name} (no GGUF "
                            "type)" for lf in registry.formats.values()) or "none"
        return None, (f"its experts cannot run as stored: {shown}{more} (loaded formats: "
                      f"{offered}). Name a format with `format:` to convert every expert "
                      "tensor to it")
    try:
        return LayerFormats.of(formats, hidden, ffn), None
    except Exception as e:  # a FormatError: dims or layers that cannot share buffers
        return None, f"its layers' formats cannot run together: {e}"

