"""How many compute lanes a chunk's groups alternate over (plan.LANES says what a lane is).

Why a rule and not always two: a lane costs a second set of group buffers (16 experts' images),
and two groups in flight only pay while one launch of 16 experts leaves SMs idle, that is while
experts have few rows. At long chunks the launches fill many waves and two of them contend for
L2 and memory bandwidth instead (bench/notes.md W28 measured both sides).

Pure Python: the config check, the planners and the benchmarks read the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ...errors import ConfigError

if TYPE_CHECKING:
    from ...weights.model import MoESpec

LanesSetting = Literal["auto", "1", "2"]
LANE_SETTINGS: tuple[str, ...] = ("auto", "1", "2")
#: two lanes up to this walk rows hint (rows per expert the launches are sized for)
LANES_MAX_ROWS = 512


def parse_lanes(value: object, where: str = "compute_lanes") -> LanesSetting:
    """A setting from a config value or an environment string (None: auto)."""
    text = "auto" if value is None else str(value).strip().lower()
    if text not in LANE_SETTINGS:
        raise ConfigError(f"{where}: got {value!r}; expected one of {', '.join(LANE_SETTINGS)} "
                          "(auto: two lanes when every expert is resident, else one)")
    return text  # type: ignore[return-value]


def walk_rows_hint(tokens: int, spec: MoESpec) -> int:
    """Rows per expert the walk sizes its MMQ grids for, where the counts never reach the host:
    twice the mean rows per expert (a token picks an expert at most once, so never more than
    tokens). A busier expert is still covered, by fewer blocks looping over its tiles; sizing
    for the worst case (all tokens) launched 8x more blocks, nearly all of them exiting."""
    return max(1, min(tokens, -(-2 * tokens * spec.top_k // spec.n_experts)))


def allocated_lanes(setting: LanesSetting, all_resident: bool) -> int:
    """Lanes whose group buffers an engine allocates: the setting's, and under auto two when
    every expert is resident (nothing streams, so compute bounds every prompt) and one when
    experts stream (there the second set of buffers would take resident slots, and the copies
    bound the prompt)."""
    if setting == "auto":
        return 2 if all_resident else 1
    return int(setting)


def chunk_lanes(allocated: int, tokens: int, spec: MoESpec, timing: bool = False) -> int:
    """Lanes a chunk of `tokens` is planned with: two while the walk rows hint stays within
    LANES_MAX_ROWS and a second set of buffers exists; one under STRATA_PREFILL_TIMING, whose
    phase events sit on one stream and would misattribute overlapping lanes."""
    if allocated < 2 or timing:
        return 1
    return 2 if walk_rows_hint(tokens, spec) <= LANES_MAX_ROWS else 1
