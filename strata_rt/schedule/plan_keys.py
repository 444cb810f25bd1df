"""The keys the chunk driver caches plans (and their CUDA graphs) by, and which decode plan a
whole model's one-token step runs: one job, so the driver, the benchmarks and the tests name a
plan the same way.

A key is (chunk size, gather_one, attention start): the walk's, or with ROUTED in
gather_one's place a chunk's routed plan, with ROUTED_WALK its routed walk; DECODE_KEY is the decode plan (one token, any gather
mode, the position read on the device), GEMV_DECODE_KEY the decode plan whose layers run
RoutedExperts (the config's decode "gemv", or "auto" on a model whose every layer offers it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..weights.layer_formats import LayerFormats

WalkKey = tuple[int, bool | str, int | None]
ROUTED = "routed"
ROUTED_WALK = "routed_walk"
GEMV = "gemv"
AUTO = "auto"
DECODE_KEY: WalkKey = (1, False, -1)
GEMV_DECODE_KEY: WalkKey = (1, GEMV, -1)
DECODE_KEYS = (DECODE_KEY, GEMV_DECODE_KEY)


def resolve_decode(decode: str | None, formats: LayerFormats,
                   layers: Iterable[int]) -> str | None:
    """The decode setting a model runs: "auto" is "gemv" where every layer's format offers the
    matrix-vector kernels (QuantFormat.offers_gemv_routed), else "routed"; any other setting
    is itself."""
    if decode != AUTO:
        return decode
    every = all(formats.format(layer).offers_gemv_routed() for layer in layers)
    return GEMV if every else ROUTED


def decode_key(decode: str | None, formats: LayerFormats, layers: Iterable[int]) -> WalkKey:
    """The decode plan a step runs: GEMV_DECODE_KEY under decode "gemv", else DECODE_KEY.
    The rule has no fallback: gemv on a model with a layer whose format lacks the
    matrix-vector kernels (QuantFormat.offers_gemv_routed) is a ConfigError naming it, as
    routed in its place would run other kernels, with other bytes. "auto" takes gemv only
    where every layer offers it (resolve_decode)."""
    decode = resolve_decode(decode, formats, layers)
    if decode != GEMV:
        return DECODE_KEY
    for layer in layers:
        fmt = formats.format(layer)
        if not fmt.offers_gemv_routed():
            raise ConfigError(f"decode: gemv (STRATA_DECODE) runs a decode step's experts as "
                              f"matrix-vector kernels, which format {fmt.name} of layer "
                              f"{layer} does not offer; use routed or staging",
                              source="engine config")
    return GEMV_DECODE_KEY


def decodes_planned(decode: str | None, routed_gathers: bool) -> bool:
    """Whether a one-token step runs a decode plan rather than the staging ring: decode
    "routed" on an executor whose format gathers routed experts, or "gemv" (decode_key
    refuses a model it cannot run); `decode` as resolve_decode leaves it ("auto" resolved)."""
    return decode == GEMV or (routed_gathers and decode == ROUTED)
