"""The sampling keys of a run config's `generate` mapping: temperature, top_k, top_p, min_p,
repeat_penalty and seed, read into one SamplingParams (strata_rt.text.sampling) when the config
is validated, so a bad value is reported with the file's other problems, before any prompt
runs. Absent keys keep greedy's defaults; `strata generate`'s flags override them one by one.
"""

from __future__ import annotations

from dataclasses import fields

from ...text.sampling import NAMES, SamplingParams, sampling_problems
from .problem_sink import Problems

#: config key -> SamplingParams field
SAMPLING_KEYS = {name: field for field, name in NAMES.items()}


def check_sampling(p: Problems, gen: dict | None) -> SamplingParams:
    """The SamplingParams of `generate:`'s sampling keys (greedy when none is given); every
    bad value is added to `p` under its key path, and greedy is returned in its place."""
    if not isinstance(gen, dict):
        return SamplingParams()
    given = {SAMPLING_KEYS[k]: v for k, v in gen.items() if k in SAMPLING_KEYS}
    bad = sampling_problems(given)
    for field, value, allowed in bad:
        p.add(f"generate.{NAMES[field]}", value, allowed)
    if bad:
        return SamplingParams()
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in given.items() if k in known})
