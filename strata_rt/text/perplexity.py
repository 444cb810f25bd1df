"""Perplexity of a token sequence: the figure people judge a quant format by.

The sequence is cut into non-overlapping windows of `ctx` tokens; each window runs from an
empty KV cache, so no window sees another's tokens. From the logits of every position of a
window, the negative log-likelihood of tokens 1..n-1 (each predicted from the ones before it;
token 0 has no prediction) is summed, with the log-softmax in float64. A last window shorter
than `ctx` is kept when it has at least two tokens (it predicts n-1 of them) and is marked by
its length. Perplexity = exp(total NLL / predicted tokens), over all windows and per window.

This is what transformers' `model(ids, labels=ids).loss` computes per window (the tests hold
the two together). llama.cpp's perplexity tool instead scores only the second half of each
window, so its figures are lower for the same text and are not comparable one to one.

A window's logits are [ctx, vocab] float32: on large vocabularies the window is prefilled in
pieces (the cache carries the earlier ones, which gives the same logits) so that one piece's
logits stay under `max_logit_bytes`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config.run.prompts import integer_ids
from ..errors import ConfigError, StrataError
from ..report.progress import Progress
from .generate import LogitsSession

log = logging.getLogger(__name__)

MAX_LOGIT_BYTES = 1 << 30
#: the largest mean NLL (nats a token) whose perplexity, e^x, a float holds
MAX_MEAN_NLL = math.log(sys.float_info.max)


class ScoreError(StrataError):
    """The logits give no perplexity to report (beyond a float's range): the model's weights
    are the likely cause, so a caller names the model."""


@dataclass
class Window:
    """One window: its first token's index in the sequence, its length, the summed NLL of
    its predicted tokens (nats) and the seconds it took."""

    start: int
    tokens: int
    nll: float
    seconds: float

    @property
    def predicted(self) -> int:
        return self.tokens - 1

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.predicted)

    def as_dict(self) -> dict[str, Any]:
        return {"start": self.start, "tokens": self.tokens, "predicted": self.predicted,
                "nll": self.nll, "mean_nll": self.nll / self.predicted,
                "perplexity": self.perplexity, "seconds": self.seconds}


@dataclass
class PerplexityResult:
    ctx: int
    tokens: int
    windows: list[Window] = field(default_factory=list)
    #: True when Ctrl-C ended the run: the windows are the finished ones
    interrupted: bool = False

    @property
    def predicted(self) -> int:
        return sum(w.predicted for w in self.windows)

    @property
    def nll(self) -> float:
        return float(sum(w.nll for w in self.windows))

    @property
    def perplexity(self) -> float | None:
        return math.exp(self.nll / self.predicted) if self.predicted else None

    @property
    def seconds(self) -> float:
        return float(sum(w.seconds for w in self.windows))

    @property
    def tokens_per_s(self) -> float:
        done = sum(w.tokens for w in self.windows)
        return done / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"ctx": self.ctx, "tokens": self.tokens, "predicted": self.predicted,
                "nll": self.nll, "perplexity": self.perplexity, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s, "complete": not self.interrupted,
                "windows": [w.as_dict() for w in self.windows]}


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[t])[targets[t]] per row, in float64 (logits [rows, vocab])."""
    x = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(x).all():
        raise StrataError("the logits hold NaN or Inf; the model or its weights are broken")
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return lse - x[np.arange(len(x)), np.asarray(targets)]


def windows_of(n_tokens: int, ctx: int) -> list[tuple[int, int]]:
    """(start, end) of the windows: whole ones of ctx tokens, then the rest if >= 2 tokens."""
    spans = [(s, min(s + ctx, n_tokens)) for s in range(0, n_tokens, ctx)]
    return [(s, e) for s, e in spans if e - s >= 2]


def check_ctx(ctx: Any, context: int, n_tokens: int) -> None:
    problems = []
    if isinstance(ctx, bool) or not isinstance(ctx, int | np.integer) or not 2 <= ctx <= context:
        problems.append(f"ctx is {ctx!r}; a window needs at least 2 tokens and at most the "
                        f"model's context of {context}")
    if n_tokens < 2:
        problems.append(f"the text has {n_tokens} token(s); perplexity needs at least 2 (the "
                        "first token has no prediction)")
    if problems:
        raise ConfigError(problems, source="perplexity")


def window_nll(session: LogitsSession, ids: np.ndarray, max_logit_bytes: int = MAX_LOGIT_BYTES
               ) -> float:
    """Summed NLL of ids[1:] given the earlier ids, from an empty cache; the window is
    prefilled in pieces whose logits stay under max_logit_bytes."""
    session.reset()
    piece = max(1, max_logit_bytes // (4 * session.vocab))
    total = 0.0
    n = len(ids)
    for lo in range(0, n, piece):
        hi = min(n, lo + piece)
        logits, _ = session.prefill(ids[lo:hi], all_logits=True)
        logits = np.asarray(logits).reshape(hi - lo, -1)
        rows = min(hi, n - 1) - lo  # the last token of the window predicts nothing
        if rows > 0:
            total += float(token_nll(logits[:rows], ids[lo + 1: lo + 1 + rows]).sum())
    return total


def perplexity(session: LogitsSession, token_ids: Sequence[int] | np.ndarray, ctx: int,
               progress: Progress | None = None, max_logit_bytes: int = MAX_LOGIT_BYTES,
               on_window: Callable[[int, Window], None] | None = None) -> PerplexityResult:
    """Perplexity of token_ids over non-overlapping windows of ctx tokens (see the module's
    docstring). `progress` labels each window (the engine draws its per-layer line);
    `on_window(index, window)` is called as each finishes (a caller prints it then, so a
    later failure loses none). Ctrl-C (or SIGTERM, strata_rt.report.interrupts) after the first
    window returns the finished ones, marked interrupted."""
    ids = integer_ids(token_ids, "perplexity")
    ids = ids.astype(np.int64)
    check_ctx(ctx, session.context, int(ids.size))
    spans = windows_of(len(ids), int(ctx))
    result = PerplexityResult(ctx=int(ctx), tokens=int(ids.size))
    for i, (lo, hi) in enumerate(spans):
        if progress is not None:
            progress.start(f"window {i + 1}/{len(spans)} ({hi - lo} tokens)")
        t0 = time.perf_counter()
        try:
            nll = window_nll(session, ids[lo:hi], max_logit_bytes)
        except KeyboardInterrupt:
            if not result.windows:
                raise
            result.interrupted = True
            log.warning("interrupted after %d of %d windows", len(result.windows), len(spans))
            break
        finally:
            if progress is not None:
                progress.end()
        w = Window(start=lo, tokens=hi - lo, nll=nll, seconds=time.perf_counter() - t0)
        mean = nll / w.predicted
        if mean > MAX_MEAN_NLL:  # (so no total, a mean of the windows', exceeds it either)
            raise ScoreError(f"window {i + 1} (tokens {lo}..{hi - 1}): a mean NLL of "
                             f"{mean:.4g} nats a token, whose perplexity (e^{mean:.4g}) is "
                             "beyond a float's range: the logits are extreme (damaged "
                             "weights?)")
        result.windows.append(w)
        try:
            if on_window is not None:
                on_window(i, w)
        except KeyboardInterrupt:  # while the caller printed it: the window is kept
            result.interrupted = True
            break
        log.debug("window %d/%d: %d tokens, perplexity %.4f (%.2f s)", i + 1, len(spans),
                 w.tokens, w.perplexity, w.seconds)
    session.reset()
    return result
