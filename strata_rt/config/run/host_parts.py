"""The host memory a run allocates, by part, and the check that it fits the machine (run from
the config's validation, before any of it is allocated)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...weights.model import SYNTHETIC_POOL_BYTES, MoESpec
from ..hostmem import format_bytes, shortfall
from .prompts import Prompt

if TYPE_CHECKING:
    from ...formats.contract import QuantFormat

#: layers of GGUF expert bytes held in host memory while the store is filled: the loader copies
#: from the file's memory map a tensor at a time (measured: store + less than one layer)
GGUF_STAGED_LAYERS: int | None = 1


def host_memory_parts(spec: MoESpec, fmt: QuantFormat, gguf: bool, prompts: Sequence[Prompt],
                      chunk: int) -> dict[str, int]:
    """Host bytes a run allocates, by part: the expert store (pinned on the CUDA backend),
    the model's other weights, the longest prompt's input and output, and one chunk's
    working arrays (an estimate of the largest the backends hold at once)."""
    L, E, H, F, K = spec.n_layers, spec.n_experts, spec.hidden, spec.ffn, spec.top_k
    lay = fmt.layout(H, F)
    parts = {"expert store": L * E * lay.slot_bytes,
             "router and norm weights": (L * E * H + L * H) * 4}
    if gguf:
        layers = L if GGUF_STAGED_LAYERS is None else min(L, GGUF_STAGED_LAYERS)
        parts["GGUF experts read before the store is filled"] = layers * E * lay.blob_bytes
    else:
        total = L * E
        pool = total if total * lay.blob_bytes <= SYNTHETIC_POOL_BYTES else max(
            1, min(total, SYNTHETIC_POOL_BYTES // lay.blob_bytes))
        parts["synthetic expert pool"] = pool * lay.blob_bytes
    longest = max((pr.tokens for pr in prompts), default=0)
    parts["longest prompt in and out"] = 2 * longest * H * 4
    rows = min(chunk, longest)
    parts["chunk working arrays"] = rows * (4 * H + 3 * K * F) * 4
    return parts


def host_memory_problem(spec: MoESpec, fmt: QuantFormat, gguf: bool,
                        prompts: Sequence[Prompt], chunk: int,
                        extra: dict[str, int] | None = None) -> str | None:
    """'the run needs X of host memory; Y available (parts)', or None when it fits. `extra`:
    more parts (a whole model's, whole.whole_host_parts)."""
    parts = {**host_memory_parts(spec, fmt, gguf, prompts, chunk), **(extra or {})}
    slot = format_bytes(fmt.layout(spec.hidden, spec.ffn).slot_bytes)
    shown = [f"{k} {format_bytes(v)}" for k, v in parts.items() if v]
    shown[0] += f" = {spec.n_layers} layers x {spec.n_experts} experts x {slot}"
    return shortfall(sum(parts.values()), "the run", ", ".join(shown))
