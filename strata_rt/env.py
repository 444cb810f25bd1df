"""The one list of environment switches strata_rt reads (the README mirrors it).

Reading switches in one place keeps them discoverable and makes a typo in a value an error
instead of a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str  # "flag" (0/1), "int", "path" or "str"
    help: str


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch("STRATA_PREFILL_GATHER_ONE", "flag",
               "1: one gather launch per expert instead of one batched launch per group "
               "(native formats only; results are bit-identical)."),
        Switch("STRATA_PREFILL_TIMING", "flag",
               "1: record events at phase boundaries and print a phase table per prompt "
               "(instrumented runs are slower)."),
        Switch("STRATA_PREFILL_DUMP_R", "path",
               "path: after each chunk append the final residual of every 64th position "
               "(int64 position + float32 values) so two runs compare with `cmp`."),
        Switch("STRATA_WALK_MIN_TOKENS", "int",
               "N: chunks of at least N tokens take the streamed walk, smaller ones the "
               "staging ring (default: the walk once half of a layer's experts are expected "
               "to be routed; the original fixed rule was 1024)."),
        Switch("STRATA_CHECK_PLAN", "flag",
               "1: run the hazard checker on every plan before it executes."),
        Switch("STRATA_MMQ_KERNEL", "str",
               "MMQ variant for formats that offer several (see `strata plugins`); "
               "default: the format's fastest measured variant."),
        Switch("STRATA_CUDA_GRAPH", "flag",
               "0: launch the streamed walk kernel by kernel instead of replaying a CUDA graph."),
        Switch("STRATA_KERNEL_CACHE", "path",
               "directory of compiled cubins (default: ~/.cache/strata_rt/kernels)."),
        Switch("STRATA_NVCC", "path", "the nvcc to use (default: nvcc on PATH)."),
        Switch("STRATA_PLUGINS", "path",
               "the plugins.yaml to load instead of the one next to the package "
               "(`strata --plugins PATH` sets it)."),
    )
}


def _raw(name: str) -> str | None:
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a strata_rt switch; known: {', '.join(SWITCHES)}")
    value = os.environ.get(name)
    return None if value is None or value == "" else value


def flag(name: str, default: bool = False) -> bool:
    """A 0/1 switch; any other value is an error naming the switch."""
    value = _raw(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ConfigError(f"environment {name}={value!r}: expected 0 or 1", source="environment")
    return value == "1"


def text(name: str) -> str | None:
    """A path or string switch, or None when unset."""
    return _raw(name)


def integer(name: str) -> int | None:
    """A positive whole-number switch, or None when unset."""
    value = _raw(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"environment {name}={value!r}: expected a positive whole number",
                          source="environment")
    return int(value)
