"""llama.cpp's llama-bench on a file: the commands, running them with a timeout, reading their
JSON and taking the best micro-batch per prompt length.

llama-bench's JSON output (`-o json`) is a list of one object per test, printed as each test
ends: the test's parameters (n_prompt, n_gen, n_depth, n_batch, n_ubatch, n_cpu_moe,
n_gpu_layers, flash_attn, model_filename, gpu_info, ...), its mean time avg_ns and rate avg_ts
(tokens/s over the repetitions) with stddev_ns / stddev_ts, and every repetition in samples_ns
and samples_ts. A run cut short leaves the list unclosed: the tests it finished are still read.

A prompt-processing test (n_gen 0) of n_prompt tokens is the time to first token llama.cpp
offers: n_prompt / avg_ts seconds (its logits of the last token included). A generation test
(n_prompt 0, n_gen N) gives decode tokens/s as avg_ts.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: micro-batches tried for prompts of at most SHORT_BATCH tokens (the best one is kept)
UBATCHES = (512, 2048, 8192)
SHORT_BATCH = 8192
#: a longer prompt runs alone in one batch rounded up to this multiple, micro-batch LONG_UBATCH
BATCH_ROUND = 1024
LONG_UBATCH = 8192
#: characters of a failed command's stderr kept in the results
ERR_TAIL = 2000


def n_cpu_moe(regime: str, n_layers: int) -> int:
    """llama.cpp's -ncmoe for a regime: quarter keeps the experts of 3/4 of the layers in host
    memory (a quarter on the GPU, as strata's quarter regime), all keeps none there."""
    return n_layers * 3 // 4 if regime == "quarter" else 0


def shown(cmd: list[str]) -> str:
    """A command as recorded: the program and the model by their names (no machine paths)."""
    out = list(cmd)
    out[0] = Path(cmd[0]).name
    out[cmd.index("-m") + 1] = Path(cmd[cmd.index("-m") + 1]).name
    return " ".join(out)


def base_args(exe: str, model: Path, n_cpu_moe: int) -> list[str]:
    """Every layer on the GPU, weights loaded into llama.cpp's own buffers (-lm none), flash
    attention, the experts of the first n_cpu_moe layers kept in host memory."""
    return [exe, "-m", str(model), "-ngl", "99", "-lm", "none", "-fa", "1",
            "-ncmoe", str(n_cpu_moe)]


def prefill_commands(exe: str, model: Path, n_cpu_moe: int, prompts: list[int], reps: int
                     ) -> list[list[str]]:
    """One command for the prompts of at most SHORT_BATCH tokens (micro-batches UBATCHES),
    one per longer prompt (its own batch, micro-batch LONG_UBATCH)."""
    base = base_args(exe, model, n_cpu_moe)
    tail = ["-r", str(reps), "-o", "json"]
    short = [p for p in prompts if p <= SHORT_BATCH]
    cmds = []
    if short:
        cmds.append(base + ["-p", ",".join(map(str, short)), "-n", "0", "-b", str(SHORT_BATCH),
                            "-ub", ",".join(map(str, UBATCHES))] + tail)
    for p in (p for p in prompts if p > SHORT_BATCH):
        batch = math.ceil(p / BATCH_ROUND) * BATCH_ROUND
        cmds.append(base + ["-p", str(p), "-n", "0", "-b", str(batch), "-ub", str(LONG_UBATCH)]
                    + tail)
    return cmds


def decode_command(exe: str, model: Path, n_cpu_moe: int, steps: int, reps: int) -> list[str]:
    return base_args(exe, model, n_cpu_moe) + ["-p", "0", "-n", str(steps), "-r", str(reps),
                                               "-o", "json"]


# ---------------------------------------------------------------------- reading the output
def parse_records(text: str) -> list[dict[str, Any]]:
    """The test objects of llama-bench's JSON (or JSON-lines) output; of an unfinished list,
    the objects printed whole."""
    text = text.strip()
    if not text:
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, list):
        return [r for r in doc if isinstance(r, dict)]
    if isinstance(doc, dict):
        return [doc]
    out: list[dict[str, Any]] = []
    dec = json.JSONDecoder()
    i = 0
    while (j := text.find("{", i)) >= 0:
        try:
            obj, i = dec.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def rate(rec: dict[str, Any]) -> float | None:
    """Tokens/s of a test: avg_ts, else its tokens over avg_ns."""
    ts = rec.get("avg_ts")
    if isinstance(ts, int | float) and ts > 0:
        return float(ts)
    ns = rec.get("avg_ns")
    n = int(rec.get("n_prompt") or 0) + int(rec.get("n_gen") or 0)
    if isinstance(ns, int | float) and ns > 0 and n > 0:
        return n / (ns / 1e9)
    return None


@dataclass
class Prefill:
    """llama.cpp's best time to first token of one prompt length."""

    tokens: int
    ms: float
    tokens_per_s: float
    n_ubatch: int | None
    stddev_ts: float | None
    #: ms of every micro-batch tried
    by_ubatch: dict[int, float] = field(default_factory=dict)


def best_prefill(records: list[dict[str, Any]]) -> dict[int, Prefill]:
    """Per prompt length, the micro-batch of the highest tokens/s (prompt tests at depth 0)."""
    best: dict[int, Prefill] = {}
    for rec in records:
        n = int(rec.get("n_prompt") or 0)
        if n <= 0 or int(rec.get("n_gen") or 0) != 0 or int(rec.get("n_depth") or 0) != 0:
            continue
        ts = rate(rec)
        if ts is None:
            continue
        ub = rec.get("n_ubatch")
        ub = int(ub) if isinstance(ub, int) else None
        ms = n / ts * 1e3
        have = best.get(n)
        tried = dict(have.by_ubatch) if have else {}
        if ub is not None:
            tried[ub] = ms
        if have is None or ts > have.tokens_per_s:
            sd = rec.get("stddev_ts")
            best[n] = Prefill(n, ms, ts, ub, float(sd) if isinstance(sd, int | float) else None)
        best[n].by_ubatch = tried
    return best


def decode_rate(records: list[dict[str, Any]]) -> float | None:
    """Tokens/s of the generation test (n_prompt 0), the best if several."""
    rates = [r for rec in records if int(rec.get("n_gen") or 0) > 0
             and int(rec.get("n_prompt") or 0) == 0 and (r := rate(rec)) is not None]
    return max(rates) if rates else None


# ---------------------------------------------------------------------- running
@dataclass
class Invocation:
    """One llama-bench command and what came of it (error None: it exited 0)."""

    command: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    stderr_tail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"command": " ".join(self.command), "seconds": self.seconds,
                "returncode": self.returncode, "error": self.error,
                "stderr_tail": self.stderr_tail, "records": self.records}


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def run(cmd: list[str], timeout: float) -> Invocation:
    """Runs one command; a missing program, a timeout or a failure is recorded, never
    raised (the tests it finished before are kept)."""
    inv = Invocation(cmd)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False, stdin=subprocess.DEVNULL)
        out, err, inv.returncode = done.stdout, done.stderr, done.returncode
        if done.returncode != 0:
            inv.error = f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        inv.error = f"timed out after {timeout:g} s"
    except OSError as e:  # not found, not executable
        out, err = "", ""
        inv.error = f"cannot run {cmd[0]}: {e.strerror or e}"
    inv.seconds = time.perf_counter() - t0
    inv.records = parse_records(out)
    inv.stderr_tail = err[-ERR_TAIL:]
    if inv.error is None and not inv.records:
        inv.error = "no test results in its output"
    if inv.error:
        last = err.strip().splitlines()[-1:] if err.strip() else []
        print(f"  llama-bench: {inv.error}" + (f" ({last[0][:200]})" if last else ""),
              flush=True)
    return inv
