"""Shared pieces of the IQ3_XXS kernel tests: the group cases they build."""

from __future__ import annotations

import numpy as np
from _format_harness import GroupCase, make_case

from strata_rt.quants.iq3_xxs import IQ3XXS

#: (hidden, ffn) of the small test geometry and of Qwen3-30B-A3B
SMALL = (512, 256)
QWEN3_30B = (2048, 768)


def case(rng: np.random.Generator, dims: tuple[int, int], part: str, counts: list[int],
         expert_ids: tuple[int, ...]) -> GroupCase:
    return make_case(IQ3XXS("f16_pipe"), rng, dims[0], dims[1], part, counts, expert_ids)


def group_of(counts: list[int], rows_of_group: list[int], rng: np.random.Generator,
             n_layer: int = 40) -> tuple[list[int], tuple[int, ...]]:
    """Layer row counts with a group of len(rows_of_group) experts at random ascending ids
    holding those counts; the other experts of the layer get `counts` cycled."""
    ids = tuple(sorted(rng.choice(n_layer, size=len(rows_of_group), replace=False).tolist()))
    layer = [counts[i % len(counts)] for i in range(n_layer)]
    for e, r in zip(ids, rows_of_group):
        layer[e] = r
    return layer, ids
