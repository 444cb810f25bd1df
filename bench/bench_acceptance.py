"""One gather launch per expert against one per group on a whole model: the A/B table of the
batched gather, with the greedy tokens after each prompt compared between the arms.

One engine from a run config (default configs/qwen3-30b-a3b-whole.yaml); STRATA_PREFILL_GATHER_ONE
is flipped between prefills (`one` = 1, `batch` = 0). Per prompt length (default 254, 1,030,
3,866, 8,179 and 30,118 tokens, seeded ids of their own): `--warmups` untimed runs of each arm
(the plain launches, then the CUDA-graph trial of that chunk size and gather mode), then the
timed runs in the order one, batch, one, batch (`--pairs` pairs), each from an empty KV cache,
timed by the host clock around engine.prefill (which returns the logits on the host, so the GPU
is done). After every timed run, outside its time, the `--greedy` tokens (default 24) that
follow the prompt; `agree` says whether all runs of both arms produced the same ids.

Table: prompt tokens, ms of each run per arm, change % = (median batch - median one) / median
one, tokens/s of the medians, greedy agreement. Results: <out>/acceptance-<config>-<time>.{json,md}.

    python bench/bench_acceptance.py                        # the 30B shape, 1/4 resident
    python bench/bench_acceptance.py --config configs/qwen3-235b-a22b-whole-16g.yaml
    python bench/bench_acceptance.py --config configs/tiny-qwen3moe.yaml --backend reference \\
        --prompts 60,300 --out /tmp/acceptance              # the procedure, without a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.cli.common import display_path, hardware_line, markdown_table, open_engine  # noqa: E402
from strata_rt.cli.run import set_switch  # noqa: E402
from strata_rt.config.run.run_config import load_config  # noqa: E402
from strata_rt.text.generate import EngineSession, greedy_after  # noqa: E402

SWITCH = "STRATA_PREFILL_GATHER_ONE"
#: arm name -> switch value, in the order each pair runs them
ARMS = {"one": "1", "batch": "0"}
DEFAULT_PROMPTS = "254,1030,3866,8179,30118"


def timed_prefill(engine: Any, ids: Any) -> tuple[Any, Any, float]:
    """(logits, stats, seconds) of one prefill from an empty cache."""
    engine.reset()
    t0 = time.perf_counter()
    logits, stats = engine.prefill(ids)
    return logits, stats, time.perf_counter() - t0


def run_prompt(engine: Any, ids: Any, pairs: int, warmups: int, greedy: int
               ) -> dict[str, Any]:
    """Warm-ups of both arms, then `pairs` x (one, batch) timed runs, each followed by its
    greedy tokens. -> the prompt's record."""
    for _ in range(warmups):
        for value in ARMS.values():
            set_switch(engine, SWITCH, value)
            timed_prefill(engine, ids)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    greedy_ids: dict[str, list[list[int]]] = {arm: [] for arm in ARMS}
    gathers: dict[str, int] = {}
    streamed = 0
    for _ in range(pairs):
        for arm, value in ARMS.items():
            set_switch(engine, SWITCH, value)
            logits, stats, wall = timed_prefill(engine, ids)
            times[arm].append(wall)
            gathers[arm] = int(stats.gathers_launched)
            streamed = int(stats.bytes_streamed)
            if greedy:
                result = greedy_after(EngineSession(engine), logits, greedy, None)
                greedy_ids[arm].append(list(result.ids))
    one, batch = (statistics.median(times[arm]) for arm in ARMS)
    runs = [ids_ for arm in ARMS for ids_ in greedy_ids[arm]]
    return {"tokens": len(ids), "one_s": times["one"], "batch_s": times["batch"],
            "one_median_s": one, "batch_median_s": batch,
            "change_pct": (batch - one) / one * 100,
            "one_tokens_per_s": len(ids) / one, "batch_tokens_per_s": len(ids) / batch,
            "gathers_launched": gathers, "bytes_streamed": streamed,
            "greedy_tokens": greedy, "greedy_ids": greedy_ids,
            "greedy_agree": None if not greedy else all(r == runs[0] for r in runs)}


def table_row(rec: dict[str, Any]) -> list[Any]:
    agree = rec["greedy_agree"]
    return [rec["tokens"], ", ".join(f"{t * 1e3:,.1f}" for t in rec["one_s"]),
            ", ".join(f"{t * 1e3:,.1f}" for t in rec["batch_s"]), f"{rec['change_pct']:+.1f}",
            f"{rec['one_tokens_per_s']:,.0f} / {rec['batch_tokens_per_s']:,.0f}",
            "-" if agree is None else ("yes" if agree else "NO")]


def write_results(out: Path, config: str, doc: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"acceptance-{Path(config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(
        f"{doc['hardware']}\n\n`{doc['command']}`\n\n{doc['setup']}\n\n{doc['table']}\n\n"
        f"{doc['legend']}\n")
    return stem


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples:\n" + __doc__.split("\n\n")[-1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3-30b-a3b-whole.yaml"),
                    help="a whole-model run config (default: %(default)s)")
    ap.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS,
                    help="comma-separated prompt lengths (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=2,
                    help="timed (one, batch) pairs per prompt (default 2: one, batch, one, "
                         "batch)")
    ap.add_argument("--warmups", type=int, default=2,
                    help="untimed runs of each arm per prompt first (default 2: plain "
                         "launches, then the CUDA-graph trial)")
    ap.add_argument("--greedy", type=int, default=24,
                    help="greedy tokens after each timed run, compared between the arms "
                         "(default 24; 0: none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="folder of the .json and .md results (default: %(default)s)")
    args = ap.parse_args(argv)
    for name in ("pairs", "warmups", "greedy"):
        low = 1 if name == "pairs" else 0
        if getattr(args, name) < low:
            ap.error(f"--{name}: got {getattr(args, name)}; expected >= {low}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config)
    if cfg.whole is None:
        raise SystemExit(f"{display_path(args.config)}: not a whole model (the greedy tokens need logits)")
    cfg = cfg.with_prompt_lengths([int(n) for n in args.prompts.split(",")])
    if args.backend:
        cfg = cfg.with_backend(args.backend)
    records: list[dict[str, Any]] = []
    given = sys.argv[1:] if argv is None else argv
    doc: dict[str, Any] = {"command": " ".join(["bench/bench_acceptance.py", *given]),
                           "hardware": hardware_line(), "config": display_path(args.config),
                           "switch": SWITCH, "arms": ARMS, "order": "one, batch per pair",
                           "pairs": args.pairs, "warmups": args.warmups}
    t0 = time.perf_counter()
    try:
        with open_engine(cfg) as engine:
            need = max(p.tokens for p in cfg.prompts) + args.greedy
            if engine.context_tokens < need:
                raise SystemExit(f"{display_path(args.config)}: the KV cache holds {engine.context_tokens} "
                                 f"positions; the longest prompt and --greedy need {need}")
            dense = "streamed" if getattr(engine.backend, "dense_ring", None) else "resident"
            doc["setup"] = (f"backend {engine.config.backend}; {engine.residency.count} of "
                            f"{cfg.spec.total_experts} experts resident; dense weights "
                            f"{dense}; chunk {engine.chunk_tokens} tokens; opened in "
                            f"{time.perf_counter() - t0:.1f} s")
            print(f"{doc['hardware']}\n{display_path(args.config)}: {doc['setup']}", flush=True)
            for prompt in cfg.prompts:
                ids = prompt.token_ids(cfg.whole.vocab, cfg.seed)
                rec = run_prompt(engine, ids, args.pairs, args.warmups, args.greedy)
                records.append(rec)
                print(f"{rec['tokens']} tokens: one {rec['one_median_s'] * 1e3:,.1f} ms, "
                      f"batch {rec['batch_median_s'] * 1e3:,.1f} ms "
                      f"({rec['change_pct']:+.1f}%), gathers {rec['gathers_launched']}, "
                      f"greedy agree: {rec['greedy_agree']}", flush=True)
    except KeyboardInterrupt:
        if not records:
            raise
        doc["interrupted"] = True
    doc["table"] = markdown_table(["prompt tokens", "one ms (each run)", "batch ms (each run)",
                                   "change %", "tokens/s (one / batch)",
                                   f"greedy {args.greedy} agree"],
                                  [table_row(r) for r in records])
    doc["legend"] = (f"one: {SWITCH}=1 (a gather launch per expert), batch: =0 (one per "
                     "group); runs in the order one, batch, one, batch after "
                     f"{args.warmups} untimed run(s) of each; time: host clock around "
                     "engine.prefill from an empty KV cache (logits on the host); change % = "
                     "(median batch - median one) / median one; agree: the greedy tokens after "
                     "every timed run of both arms are the same ids")
    doc["runs"] = records
    print(doc["table"])
    print(doc["legend"])
    stem = write_results(Path(args.out), args.config, doc)
    print(f"wrote {stem}.json and .md")
    disagree = [r["tokens"] for r in records if r["greedy_agree"] is False]
    if disagree:
        print(f"the greedy tokens differ between the arms at {disagree} tokens",
              file=sys.stderr)
        return 1
    return 130 if doc.get("interrupted") else 0


if __name__ == "__main__":
    raise SystemExit(main())
