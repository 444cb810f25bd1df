"""strata_rt's side: the run config of each regime on a file, and the run itself, made in a
child process of its own per (file, regime), so a crash or a hang of one is a row of the table,
not the end of the benchmark, and the GPU is free again when llama-bench runs.

A regime's config is the base config (configs/qwen3-30b-a3b-whole.yaml: backend, context
32768, prefill chunk 8192, ring_mib 512, seed) with `model: {gguf: FILE}` and no `format` (the
file's experts run as stored), and `expert_cache`:
  quarter  n_layers x n_experts / 4 experts resident (1,536 of 6,144 at the 30B shape), the
           rest streamed from pinned host memory over PCIe;
  all      `all`: every expert resident.

Timing is the other benchmarks' own: bench_whole.time_prefill (warm-ups, then timed prefills
from an empty KV cache, host clock around the call, logits included; the median is kept) and
bench_decode.run_regime (warm-up greedy runs, then greedy steps after the prompt's token,
tokens/s over the steps). The pinned host-to-device ceiling is bench_whole.h2d_ceiling (torch;
absent: no PCIe share).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REGIMES = ("quarter", "all")
#: keys of the base config a regime's config does not take over
_REPLACED = ("model", "format", "expert_cache", "vram_reserve_mib", "vram_budget_mib", "prompts",
             "generate", "output", "profile", "repeats")


def expert_total(path: Path) -> tuple[int, int]:
    """(layers, experts per layer) of a GGUF, from its keys."""
    from strata_rt.weights.gguf_file.gguf_io import read_header

    _, dims = read_header(path)
    return int(dims["n_layers"]), int(dims["n_experts"])


def resident_for(regime: str, n_layers: int, n_experts: int) -> int | str:
    if regime == "quarter":
        return n_layers * n_experts // 4
    if regime == "all":
        return "all"
    raise ValueError(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")


def regime_doc(base_config: Path, gguf: Path, regime: str, prompts: list[int],
               backend: str | None, n_layers: int, n_experts: int) -> dict[str, Any]:
    """The run config (as a parsed YAML document) of one regime on one file."""
    from strata_rt.config.files.yaml_input import load_yaml

    base = load_yaml(base_config.read_text())
    doc = {k: v for k, v in base.items() if k not in _REPLACED}
    doc["model"] = {"gguf": str(gguf)}
    doc["expert_cache"] = resident_for(regime, n_layers, n_experts)
    doc["prompts"] = list(prompts)
    if backend:
        doc["backend"] = backend
    return doc


def _save(path: Path, res: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_job(job: dict[str, Any]) -> int:
    """The child's work (module doc): writes its results to job["out"] after each step, so
    what finished before a crash is kept. -> exit status."""
    out = Path(job["out"])
    res: dict[str, Any] = {"regime": job["regime"], "file": job["file"], "prompts": [],
                           "decode": None, "error": None}
    try:
        _run(job, res, out)
    except Exception as e:  # reported in the table; the traceback kept in the JSON
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        res["traceback"] = traceback.format_exc()[-4000:]
        print(f"strata ({job['regime']}): {res['error']}", file=sys.stderr, flush=True)
    _save(out, res)
    return 1 if res["error"] else 0


def _run(job: dict[str, Any], res: dict[str, Any], out: Path) -> None:
    from bench_decode import run_regime
    from bench_whole import h2d_ceiling, time_prefill

    from strata_rt.cli.common import open_engine
    from strata_rt.config.run.prompts import Prompt
    from strata_rt.config.run.run_config import validate

    gguf = Path(job["file"])
    n_layers, n_experts = expert_total(gguf)
    doc = regime_doc(Path(job["config"]), gguf, job["regime"], job["prompts"] or [1],
                     job.get("backend"), n_layers, n_experts)
    res["config"] = doc
    cfg = validate(doc, Path.cwd())
    assert cfg.whole is not None, "the file is not a whole model"
    res["backend"] = cfg.backend
    ceiling = h2d_ceiling() if cfg.backend != "reference" else None
    res["h2d_gb_s"] = ceiling
    t0 = time.perf_counter()
    with open_engine(cfg) as engine:
        res["open_s"] = time.perf_counter() - t0
        res["resident"] = int(engine.residency.count)
        res["experts_total"] = n_layers * n_experts
        res["chunk_tokens"] = int(engine.chunk_tokens)
        print(f"strata ({job['regime']}): opened {gguf.name} in {res['open_s']:.1f} s, "
              f"{res['resident']:,} of {n_layers * n_experts:,} experts resident", flush=True)
        _save(out, res)
        for prompt in cfg.prompts if job["prompts"] else ():
            res["prompts"].append(_prefill(engine, prompt, cfg, job, ceiling, time_prefill))
            _save(out, res)
        if job.get("decode_steps", 0) > 0:
            ids = Prompt(0, int(job["decode_prompt"])).token_ids(cfg.whole.vocab, cfg.seed)
            try:
                result, _ = run_regime(engine, ids, int(job["decode_steps"]),
                                       int(job["warmups"]))
                steps = result.step_wall_s
                res["decode"] = {"tokens_per_s": result.decode_tokens_per_s,
                                 "steps": len(steps), "prompt_tokens": result.prompt_tokens,
                                 "step_ms_median": statistics.median(steps) * 1e3
                                 if steps else None}
            except Exception as e:
                res["decode"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"strata ({job['regime']}): decode {res['decode']}", flush=True)


def _prefill(engine: Any, prompt: Any, cfg: Any, job: dict[str, Any], ceiling: float | None,
             time_prefill: Any) -> dict[str, Any]:
    """One prompt length: median time to first token and what it streamed."""
    ids = prompt.token_ids(cfg.whole.vocab, cfg.seed)
    try:
        walls, st = time_prefill(engine, ids, int(job["warmups"]), int(job["reps"]))
    except Exception as e:
        print(f"strata ({job['regime']}): {prompt.tokens} tokens failed: {e}", flush=True)
        return {"tokens": prompt.tokens, "error": f"{type(e).__name__}: {e}"}
    wall = statistics.median(walls)
    streamed = int(getattr(st, "bytes_streamed", 0) or 0)
    floor = None if not ceiling else streamed / (ceiling * 1e9)
    rec = {"tokens": prompt.tokens, "wall_s": walls, "ms": wall * 1e3,
           "bytes_streamed": streamed,
           "experts_streamed": int(getattr(st, "experts_streamed", 0) or 0),
           "pcie_gb_s": streamed / wall / 1e9, "floor_ms": None if floor is None else floor * 1e3,
           "pcie_share": None if floor is None else floor / wall}
    print(f"strata ({job['regime']}): {prompt.tokens:,} tokens in {wall * 1e3:,.1f} ms", flush=True)
    return rec


def run_child(script: Path, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs one job in a fresh interpreter (this script with --strata-child) -> its results;
    a child that died or ran past `timeout` is an error in them, never an exception."""
    out = Path(job["out"])
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        rc: int | None = subprocess.run([sys.executable, str(script), "--strata-child",
                                         json.dumps(job)], timeout=timeout, check=False,
                                        stdin=subprocess.DEVNULL).returncode
        why = None if rc == 0 else f"exit code {rc}"
    except subprocess.TimeoutExpired:
        rc, why = None, f"timed out after {timeout:g} s"
    res: dict[str, Any] = {"regime": job["regime"], "file": job["file"], "prompts": [],
                           "decode": None, "error": None}
    if out.is_file():
        try:
            res = json.loads(out.read_text())
        except json.JSONDecodeError:
            pass
    if why is not None and not res.get("error"):
        res["error"] = why
    res["child_seconds"] = time.perf_counter() - t0
    res["child_returncode"] = rc
    return res
