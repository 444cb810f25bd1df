"""Decoding: the tokens a whole model writes after a prompt, one per step, greedy by default.

The prompt is prefilled once; each step then prefills the single token chosen last, at the
next position of the KV cache the earlier calls left, and takes the argmax of its logits
(ties go to the lower id, as numpy's and torch's argmax do). That is what transformers'
`generate(do_sample=False)` computes, and the tests hold the two to the same ids.

Decoding runs on anything that prefills token ids into a KV cache and returns logits, a
`LogitsSession`: the engine (`EngineSession`, any backend) or the numpy reference without an
engine (`ReferenceSession`, for tests and checks). Choices a caller should know:

- every call to `greedy` starts from an empty cache (`session.reset()`); `greedy_after`
  continues a prompt the caller prefilled (and timed) itself;
- prompt + max_new must fit the context: refused before anything runs, never cut short midway
  (a caller that wants fewer tokens asks for fewer);
- max_new = 0 prefills the prompt only (its timing is still measured), no token is produced;
- the EOS token, when produced, ends the ids (it is included, as transformers includes it);
- Ctrl-C after the first token ends the run early with stop reason "interrupted" and what
  was produced so far.

Sampling (`generate`/`generate_after` with SamplingParams, strata_rt.text.sampling) replaces
only the argmax: each step draws from the logits with the prompt and the tokens so far as the
repetition penalty's ids, the step index (0 for the first new token) and the seed. A session
that can draw on its device (`sample_on_device`: the CUDA backend) does, else the numpy
definition runs on the host logits; greedy parameters (temperature 0, no penalty) take the
argmax path above, unchanged.

A greedy step on a session with `prefill_argmax` (EngineSession) asks for the token alone:
under decode_argmax "device" the CUDA backend takes the argmax where the head left the logits,
with numpy's tie rule and the same refusal of NaN or Inf, so the ids are those of the host
argmax and only the id comes back; otherwise the engine takes the argmax of the row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..config.run.prompts import integer_ids
from ..errors import ConfigError, StrataError
from ..report.stats import Stats
from .sampling import SamplingParams, sample

log = logging.getLogger(__name__)


@runtime_checkable
class LogitsSession(Protocol):
    """A whole model with a KV cache: `prefill(ids)` appends ids at positions kv_length.. and
    returns (logits float32 [vocab] of the last one, or [tokens, vocab] with all_logits, and
    the call's Stats or None); `reset()` empties the cache; `context` is the most positions the
    cache holds; `vocab` the number of logits."""

    @property
    def kv_length(self) -> int: ...

    @property
    def context(self) -> int: ...

    @property
    def vocab(self) -> int: ...

    def prefill(self, token_ids: Any, all_logits: bool = False
                ) -> tuple[np.ndarray, Stats | None]: ...

    def reset(self) -> None: ...


class ReferenceSession:
    """A LogitsSession over strata_rt.models.qwen3.Qwen3Reference (numpy, no engine): the yardstick
    the engine's sessions are checked against. `context` defaults to the spec's."""

    def __init__(self, model: Any, dtype: type = np.float32, context: int | None = None):
        from ..models.qwen3 import Qwen3Reference

        self.ref = model if isinstance(model, Qwen3Reference) else Qwen3Reference(model, dtype)
        spec = self.ref.spec
        self._context = spec.context if context is None else int(context)
        self.cache = self.ref.new_cache(self._context)

    @property
    def kv_length(self) -> int:
        return self.cache.length

    @property
    def context(self) -> int:
        return self._context

    @property
    def vocab(self) -> int:
        return self.ref.spec.vocab

    def prefill(self, token_ids: Any, all_logits: bool = False
                ) -> tuple[np.ndarray, Stats | None]:
        n = len(np.asarray(token_ids).reshape(-1))
        if self.cache.length + n > self._context:
            raise ConfigError(f"{n} tokens after the {self.cache.length} cached ones exceed "
                              f"the context of {self._context} positions", source="prefill")
        t0 = time.perf_counter()
        logits = self.ref.prefill(token_ids, self.cache, all_logits=all_logits)
        wall = time.perf_counter() - t0
        stats = Stats(tokens=n, chunks=1, wall_s=wall, host_s=wall)
        return np.asarray(logits, dtype=np.float32), stats

    def reset(self) -> None:
        self.cache.truncate(0)


class EngineSession:
    """A LogitsSession over an open strata_rt.engine.Engine that runs a whole model."""

    def __init__(self, engine: Any):
        if engine.qwen3_spec is None:
            raise ConfigError("this engine runs MoE layers alone: decoding and perplexity "
                              "need a whole model (model: {qwen3: ...} or a whole-model GGUF)",
                              source="model")
        self.engine = engine

    @property
    def kv_length(self) -> int:
        return int(self.engine.kv_length)

    @property
    def context(self) -> int:
        return int(self.engine.context_tokens)

    @property
    def vocab(self) -> int:
        return int(self.engine.qwen3_spec.vocab)

    def prefill(self, token_ids: Any, all_logits: bool = False
                ) -> tuple[np.ndarray, Stats | None]:
        return self.engine.prefill(np.asarray(token_ids, dtype=np.int64),
                                   all_logits=all_logits)

    def reset(self) -> None:
        self.engine.reset()

    def prefill_argmax(self, token_ids: Any) -> tuple[int, Stats | None]:
        """prefill, returning the last position's greedy token instead of its logits."""
        return self.engine.prefill_argmax(np.asarray(token_ids, dtype=np.int64))

    def sample_on_device(self, params: SamplingParams, seen: Sequence[int], step: int
                         ) -> int | None:
        """The next token drawn where the last prefill left its logits (the CUDA backend:
        only the id comes back); None when the backend has no device to draw on."""
        draw = getattr(self.engine.backend, "sample_last", None)
        return None if draw is None else int(draw(params, seen, step))


@dataclass
class GenerateResult:
    """What one run produced and how long it took. Times are host clocks around each call
    (prefill + the token's choice): what a user waits for."""

    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    #: "eos", "length" or "interrupted"
    stop: str = "length"
    #: the prompt's prefill and the choice of the first token, seconds
    prefill_s: float = 0.0
    #: wall seconds of each decode step (the tokens after the first)
    step_wall_s: list[float] = field(default_factory=list)
    #: host seconds of each decode step, as the backend's Stats report it (None where not)
    step_host_s: list[float | None] = field(default_factory=list)
    experts_streamed: int = 0
    bytes_streamed: int = 0
    #: the sampling parameters, seed resolved (None: greedy)
    sampling: SamplingParams | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: the prompt's prefill and its argmax (None when -n 0)."""
        return self.prefill_s if self.ids else None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_s(self) -> float:
        return float(sum(self.step_wall_s))

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second of the decode steps (None with fewer than two tokens: the
        first comes from the prefill)."""
        return len(self.step_wall_s) / self.decode_s if self.step_wall_s and self.decode_s > 0 \
            else None

    @property
    def host_fraction(self) -> float | None:
        """Host time over wall time summed over the decode steps whose Stats give it."""
        pairs = [(h, w) for h, w in zip(self.step_host_s, self.step_wall_s) if h is not None]
        wall = sum(w for _, w in pairs)
        return sum(h for h, _ in pairs) / wall if pairs and wall > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "ids": list(self.ids),
                "generated": len(self.ids), "stop": self.stop, "ttft_s": self.ttft_s,
                "prefill_s": self.prefill_s, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "decode_s": self.decode_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "host_fraction": self.host_fraction, "step_wall_s": list(self.step_wall_s),
                "step_host_s": list(self.step_host_s),
                "experts_streamed": self.experts_streamed,
                "bytes_streamed": self.bytes_streamed,
                "sampling": None if self.sampling is None else self.sampling.as_dict()}


def check_request(session: LogitsSession, n_prompt: int, max_new: int) -> None:
    """Refuses, before anything runs, an empty prompt, a negative count and a prompt plus
    new tokens that the context cannot hold (the last new token sits at position
    n_prompt + max_new - 1)."""
    problems = []
    if n_prompt < 1:
        problems.append("the prompt is empty: it gives no token to start from")
    if isinstance(max_new, bool) or not isinstance(max_new, int | np.integer) or max_new < 0:
        problems.append(f"the number of new tokens is {max_new!r}; expected an integer >= 0 "
                        "(0 prefills the prompt only)")
    elif n_prompt + max_new > session.context:
        if n_prompt > session.context:
            problems.append(f"the prompt has {n_prompt} tokens; the context holds "
                            f"{session.context}")
        else:
            problems.append(f"{n_prompt} prompt tokens + {max_new} new ones need "
                            f"{n_prompt + max_new} positions; the context holds "
                            f"{session.context} (ask for at most "
                            f"{session.context - n_prompt} new tokens)")
    if problems:
        raise ConfigError(problems, source="greedy decoding")


def next_token(logits: np.ndarray, position: int) -> int:
    """The argmax of one position's logits (lowest id on ties); NaN or Inf is an error."""
    row = np.asarray(logits).reshape(-1)
    if not np.isfinite(row).all():
        raise StrataError(f"the logits at position {position} hold NaN or Inf; the model or "
                          "its weights are broken")
    return int(np.argmax(row))


def _add(result: GenerateResult, stats: Stats | None) -> float | None:
    """Adds a call's streaming counters to the result; returns its host seconds, if given."""
    if stats is None:
        return None
    result.experts_streamed += int(stats.experts_streamed)
    result.bytes_streamed += int(stats.bytes_streamed)
    return float(stats.host_s) if stats.host_s > 0 else None


class Chooser:
    """Picks each step's token: the argmax (greedy parameters or none), else a draw with the
    resolved parameters, on the session's device when it has one. Keeps the ids the
    repetition penalty reads (the prompt, then every token chosen)."""

    def __init__(self, session: LogitsSession, sampling: SamplingParams | None,
                 prompt_ids: Sequence[int] | np.ndarray = ()):
        self.params = None if sampling is None or sampling.is_greedy else sampling.resolved()
        penalised = self.params is not None and self.params.repetition_penalty != 1
        self.seen: list[int] = [int(t) for t in np.asarray(prompt_ids).reshape(-1)] \
            if penalised else []
        self._penalised = penalised
        self._device = getattr(session, "sample_on_device", None) \
            if self.params is not None else None
        self.step = 0

    def __call__(self, logits: np.ndarray, position: int) -> int:
        token: int | None
        if self.params is None:
            token = next_token(logits, position)
        else:
            token = self._device(self.params, self.seen, self.step) \
                if self._device is not None else None
            if token is None:
                token = sample(logits, self.params, self.seen, self.step)
        self.step += 1
        if self._penalised:
            self.seen.append(token)
        return token


def greedy(session: LogitsSession, prompt_ids: Sequence[int] | np.ndarray, max_new: int,
           eos_id: int | None, on_token: Callable[[int], None] | None = None
           ) -> GenerateResult:
    """Prefills `prompt_ids` from an empty cache, then produces up to `max_new` tokens, one
    prefill of the last token per step; stops after the EOS token (`eos_id`, None: never).
    `on_token(id)` is called as each token is chosen (streamed output)."""
    return generate(session, prompt_ids, max_new, eos_id, on_token)


def generate(session: LogitsSession, prompt_ids: Sequence[int] | np.ndarray, max_new: int,
             eos_id: int | None, on_token: Callable[[int], None] | None = None,
             sampling: SamplingParams | None = None) -> GenerateResult:
    """`greedy`, with each token chosen by `sampling` (None or greedy parameters: the
    argmax). The result's `sampling` holds the parameters with the seed used."""
    ids = integer_ids(prompt_ids, "generate")
    check_request(session, int(ids.size), max_new)
    session.reset()
    result = GenerateResult(prompt_tokens=int(ids.size))
    t0 = time.perf_counter()
    logits, stats = session.prefill(ids.astype(np.int64))
    _add(result, stats)
    choose = Chooser(session, sampling, ids)
    return _decode(session, result, logits, max_new, eos_id, on_token, t0, choose)


def greedy_after(session: LogitsSession, logits: np.ndarray, max_new: int,
                 eos_id: int | None, on_token: Callable[[int], None] | None = None
                 ) -> GenerateResult:
    """The greedy tokens after a prompt the caller has prefilled itself (its session.kv_length
    tokens, `logits` those of its last position): what `strata run` adds after each timed
    prompt. prefill_s (and the time to first token) then cover only the first argmax."""
    return generate_after(session, logits, max_new, eos_id, on_token)


def generate_after(session: LogitsSession, logits: np.ndarray, max_new: int,
                   eos_id: int | None, on_token: Callable[[int], None] | None = None,
                   sampling: SamplingParams | None = None,
                   prompt_ids: Sequence[int] | np.ndarray = ()) -> GenerateResult:
    """`greedy_after` with each token chosen by `sampling`; `prompt_ids`, the prompt the
    caller prefilled, are the repetition penalty's first ids."""
    check_request(session, session.kv_length, max_new)
    result = GenerateResult(prompt_tokens=session.kv_length)
    choose = Chooser(session, sampling, prompt_ids)
    return _decode(session, result, logits, max_new, eos_id, on_token, time.perf_counter(),
                   choose)


def _decode(session: LogitsSession, result: GenerateResult, logits: np.ndarray, max_new: int,
            eos_id: int | None, on_token: Callable[[int], None] | None, t0: float,
            choose: Chooser) -> GenerateResult:
    """The decode loop from the prompt's last logits; t0 is when the prompt's prefill began."""
    result.sampling = choose.params
    if max_new == 0:
        result.prefill_s = time.perf_counter() - t0
        return result
    token = choose(logits, session.kv_length - 1)
    result.prefill_s = time.perf_counter() - t0
    result.ids.append(token)
    if on_token is not None:
        on_token(token)
    # a greedy step's token straight from the session, where it can take it on its device
    step_argmax = getattr(session, "prefill_argmax", None) if choose.params is None else None
    try:
        while token != eos_id and len(result.ids) < max_new:
            t0 = time.perf_counter()
            if step_argmax is not None:
                token, stats = step_argmax(np.array([token], np.int64))
                choose.step += 1
            else:
                logits, stats = session.prefill(np.array([token], np.int64))
                token = choose(logits, session.kv_length - 1)
            result.step_wall_s.append(time.perf_counter() - t0)
            result.step_host_s.append(_add(result, stats))
            result.ids.append(token)
            if on_token is not None:
                on_token(token)
    except KeyboardInterrupt:
        result.stop = "interrupted"
        log.warning("interrupted after %d of %d tokens", len(result.ids), max_new)
        return result
    result.stop = "eos" if token == eos_id else "length"
    return result
