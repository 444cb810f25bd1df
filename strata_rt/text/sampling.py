"""Sampling beside greedy: the definition, in numpy, that the CUDA kernel reproduces exactly.

`sample(logits, params, seen, step)` draws the next token from one position's float32 logits:

1. repetition penalty: every distinct id in `seen` (the prompt and the tokens produced so
   far) has its logit divided by the penalty when > 0 and multiplied by it when < 0 (as
   transformers applies it; each id once however often it occurs);
2. temperature: logits / temperature (float32); temperature 0 keeps only the best candidate;
3. top-k: the k best candidates by (logit desc, id asc), k = top_k, or MAX_CANDIDATES when
   top_k is 0 (the bound of the kernel's candidate buffer; also the most top_k may be);
4. top-p: the shortest prefix of those whose probability mass reaches top_p (a candidate is
   kept while the mass before it is below top_p times the candidates' total);
5. min-p: candidates at least min_p times as likely as the best one;
6. the draw: u = uniform(seed, step) in [0, 1); the first kept candidate whose inclusive
   prefix sum of weights exceeds u times the kept total.

Probabilities are never normalised: a candidate's weight is exp(l - l_best) in float64
(sampling_math.exp_nonpositive), prefix sums in a fixed order (sampling_math.inclusive_scan),
and each filter compares sums and weights against scaled thresholds, which is the softmax's
filters without a division. A penalty or temperature that would overflow float32 saturates at
+-FLT_MAX (a finite logit stays finite); a -inf logit is a token that can never be drawn;
NaN or +inf logits, or every logit -inf, are errors.

Exactness contract: given the same float32 logits, `seen` and (seed, step), the kernel
(kernels/model/sampling.cu) returns the same id as `sample`, always (every operation is
IEEE-rounded and ordered the same on both sides; tested on the GPU over random logits with ties
and -inf). What differs between backends is only the logits themselves: the CUDA backend's
logits are not the reference backend's bytes, so a sampled sequence matches across backends
only as far as their logits do.

Greedy stays the default: `SamplingParams()` (temperature 0, no penalty) is `is_greedy`, and
decoding then takes the plain argmax path (text/generate.py), untouched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from ..errors import ConfigError, StrataError
from .sampling_math import exp_nonpositive, inclusive_scan, ordered_keys, uniform

#: candidates the sampler considers at most (top_k 0 means these many); the kernel's buffer
MAX_CANDIDATES = 2048
FLT_MAX = float(np.finfo(np.float32).max)
#: the smallest positive float32: a temperature or penalty below it is 0 to the kernel
FLT_TINY = float(np.finfo(np.float32).smallest_subnormal)
SEED_LIMIT = 1 << 64

#: SamplingParams field -> what the command line and the config call it
NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
         "repetition_penalty": "repeat_penalty", "seed": "seed"}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def sampling_problems(values: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """(field, value, what is allowed) for every bad value among SamplingParams fields given
    in `values`: one list, so a config or a command line reports them all at once."""
    checks = {
        "temperature": (lambda v: _number(v) and (v == 0 or FLT_TINY <= v <= FLT_MAX),
                        "expected a number >= 0 (0: greedy, the most likely token) that a "
                        f"float32 holds: 0 or {FLT_TINY:.2g} .. {FLT_MAX:.2g}"),
        "top_k": (lambda v: _integer(v) and 0 <= v <= MAX_CANDIDATES,
                  f"expected an integer 0..{MAX_CANDIDATES} (0: off, which keeps the "
                  f"{MAX_CANDIDATES} most likely tokens)"),
        "top_p": (lambda v: _number(v) and 0 < v <= 1,
                  "expected a number > 0 and <= 1 (1: off)"),
        "min_p": (lambda v: _number(v) and 0 <= v < 1,
                  "expected a number >= 0 and < 1 (0: off)"),
        "repetition_penalty": (lambda v: _number(v) and FLT_TINY <= v <= FLT_MAX,
                               "expected a number > 0 (1: off; above 1 discourages repeats) "
                               f"that a float32 holds: {FLT_TINY:.2g} .. {FLT_MAX:.2g}"),
        "seed": (lambda v: v is None or (_integer(v) and 0 <= v < SEED_LIMIT),
                 "expected an integer 0..2**64-1 (absent: a fresh one per run)"),
    }
    return [(k, v, checks[k][1]) for k, v in values.items()
            if k in checks and not checks[k][0](v)]


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (see the module docstring for the order). The defaults are
    greedy. seed None: `resolved()` draws one from the OS, so a run can report and repeat it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        bad = sampling_problems(asdict(self))
        if bad:
            raise ConfigError([f"{NAMES[k]}: got {v!r}; {why}" for k, v, why in bad],
                              source="sampling")

    @property
    def is_greedy(self) -> bool:
        """Whether this is the plain argmax (temperature 0, no penalty): the default path."""
        return self.temperature == 0 and self.repetition_penalty == 1

    def resolved(self) -> SamplingParams:
        """These parameters with a seed: the given one, else 64 random bits from the OS."""
        if self.seed is not None:
            return self
        return replace(self, seed=int.from_bytes(os.urandom(8), "little"))

    def as_dict(self) -> dict[str, Any]:
        """The parameters under their command-line/config names (what a JSON record keeps)."""
        return {NAMES[k]: v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class SamplePlan:
    """What the kernel is launched with: the candidate count, the float32 temperature it
    divides by (1 when it does not) and the float32 penalty. Shared so numpy and the launcher
    cannot disagree."""

    candidates: int
    temperature: np.float32
    penalty: np.float32
    top_p: float
    min_p: float


def plan(params: SamplingParams, vocab: int) -> SamplePlan:
    """The launch values of `params` for a vocabulary of `vocab` ids. Temperature 0 is one
    candidate (the penalised argmax, lowest id on ties) and no division."""
    if vocab < 1:
        raise StrataError(f"sampling over a vocabulary of {vocab} ids")
    greedy = params.temperature == 0
    k = 1 if greedy else min(params.top_k or MAX_CANDIDATES, MAX_CANDIDATES, vocab)
    return SamplePlan(k, np.float32(1.0 if greedy else params.temperature),
                      np.float32(params.repetition_penalty), float(params.top_p),
                      float(params.min_p))


def distinct_ids(seen: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    """The distinct ids of `seen` as sorted int32 (what the kernel's penalty reads); an id
    outside 0..vocab-1 is an error."""
    ids = np.unique(np.asarray(seen, dtype=np.int64).reshape(-1))
    if ids.size and (ids[0] < 0 or ids[-1] >= vocab):
        bad = int(ids[0] if ids[0] < 0 else ids[-1])
        raise StrataError(f"token id {bad} is outside the vocabulary 0..{vocab - 1}")
    return ids.astype(np.int32)


def _saturate(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """new clipped to +-FLT_MAX where old was finite (a -inf logit stays -inf)."""
    return np.where(np.isfinite(old), np.clip(new, -FLT_MAX, FLT_MAX), new).astype(np.float32)


def adjusted(logits: np.ndarray, sp: SamplePlan, seen: np.ndarray) -> np.ndarray:
    """Steps 1-2: float32 logits after the penalty (on the ids of `seen`, distinct) and the
    temperature, every zero +0. NaN or +inf in `logits` is an error."""
    row = np.asarray(logits, dtype=np.float32).reshape(-1)
    if np.isnan(row).any() or np.isposinf(row).any():
        raise StrataError("the logits hold NaN or +inf; the model or its weights are broken")
    out = row.copy()
    with np.errstate(over="ignore", under="ignore"):
        if sp.penalty != 1 and seen.size:
            v = out[seen]
            pen = np.where(v > 0, v / sp.penalty, np.where(v < 0, v * sp.penalty, v))
            out[seen] = _saturate(pen, v)
        if sp.temperature != 1:
            out = _saturate(out / sp.temperature, out)
    return out + np.float32(0.0)


def candidates(values: np.ndarray, k: int) -> np.ndarray:
    """Step 3: the k best ids by (value desc, id asc), in that order."""
    ids = np.arange(values.size, dtype=np.uint64)
    composite = (ordered_keys(values).astype(np.uint64) << np.uint64(32)) | (
        np.uint64(0xFFFFFFFF) - ids)
    if k < values.size:
        composite = composite[np.argpartition(composite, values.size - k)[values.size - k:]]
    top = np.sort(composite)[::-1][:k]
    return (np.uint64(0xFFFFFFFF) - (top & np.uint64(0xFFFFFFFF))).astype(np.int64)


def choice_index(best: np.ndarray, sp: SamplePlan, u: float) -> int:
    """Steps 4-6 over the candidates' float32 values (best first): the index drawn."""
    if np.isneginf(best[0]):
        raise StrataError("every logit is -inf: no token can be drawn")
    k = best.size
    w = np.zeros(MAX_CANDIDATES, np.float64)
    w[:k] = exp_nonpositive(best.astype(np.float64) - np.float64(best[0]))
    c = inclusive_scan(w)
    before = np.concatenate(([0.0], c[: k - 1]))
    cut_p = np.flatnonzero(before >= sp.top_p * c[k - 1])
    cut_m = np.flatnonzero(w[:k] < sp.min_p)
    # at least the best one (a top_p so small that top_p * total rounds to 0 keeps it too)
    n = max(1, min(k, int(cut_p[0]) if cut_p.size else k, int(cut_m[0]) if cut_m.size else k))
    above = np.flatnonzero(c[:n] > u * c[n - 1])
    return int(above[0]) if above.size else n - 1


def sample(logits: np.ndarray, params: SamplingParams, seen: Sequence[int] | np.ndarray,
           step: int) -> int:
    """The id drawn from one position's logits (float32 [vocab]) after the ids `seen`, at
    decode step `step` (0 for the first new token), with params.seed (which must be set:
    see SamplingParams.resolved)."""
    if params.seed is None:
        raise StrataError("sampling needs a seed: call SamplingParams.resolved() first")
    row = np.asarray(logits).reshape(-1)
    sp = plan(params, row.size)
    values = adjusted(row, sp, distinct_ids(seen, row.size))
    ids = candidates(values, sp.candidates)
    best = values[ids]
    u = float(uniform(params.seed, step))
    return int(ids[choice_index(best, sp, u)])


def filtered_probabilities(logits: np.ndarray, params: SamplingParams,
                           seen: Sequence[int] | np.ndarray = ()) -> np.ndarray:
    """The distribution `sample` draws from, float64 [vocab] summing to 1, computed with the
    library exp and plain softmax arithmetic (the analytic yardstick of the tests, not part of
    the exactness contract)."""
    row = np.asarray(logits).reshape(-1)
    sp = plan(params, row.size)
    values = adjusted(row, sp, distinct_ids(seen, row.size))
    ids = candidates(values, sp.candidates)
    best = values[ids].astype(np.float64)
    w = np.exp(best - best[0])
    mass = np.cumsum(w) / w.sum()
    keep = int(np.sum(np.concatenate(([0.0], mass[:-1])) < sp.top_p))
    keep = min(keep, int(np.sum(w >= sp.min_p)))
    out = np.zeros(row.size, np.float64)
    out[ids[:keep]] = w[:keep] / w[:keep].sum()
    return out


def describe(params: SamplingParams) -> str:
    """One line for logs and summaries."""
    if params.is_greedy:
        return "greedy"
    parts = [f"temperature {params.temperature:g}"]
    if params.top_k:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1:
        parts.append(f"top-p {params.top_p:g}")
    if params.min_p > 0:
        parts.append(f"min-p {params.min_p:g}")
    if params.repetition_penalty != 1:
        parts.append(f"repeat penalty {params.repetition_penalty:g}")
    parts.append(f"seed {params.seed}" if params.seed is not None else "seed fresh")
    return "sampling: " + ", ".join(parts)


__all__ = ["MAX_CANDIDATES", "SamplePlan", "SamplingParams", "adjusted", "candidates",
           "choice_index", "describe", "distinct_ids", "filtered_probabilities", "plan",
           "sample", "sampling_problems"]
