"""The walk against the routed plan on short prompts, in one process on one engine.

Opens a whole-model run config once (default configs/qwen3-30b-a3b-whole.yaml, 1/4 of the
experts resident) and, per prompt length, runs each prefill stream (`EngineConfig.
prefill_stream`, read on every chunk): "walk" (every non-resident expert copied beside the
compute), "routed" (the gathers read only the routed non-resident experts from pinned host
memory) and "auto" (the rule of strata_rt/schedule/prefill_stream.py, after the other two
have measured that length). Each arm: `--warmups` runs (kernels, the plan and its CUDA-graph
trial), then `--reps` timed runs from an empty KV cache. The table gives the median time to
first token, the bytes each streamed, the share of the walk's bytes the routed plan moves,
and which plan auto took. Results: <out>/stream-<config>-<time>.{json,md}.

    python bench/bench_stream.py --prompts 254,1030,3866
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_whole import time_prefill  # noqa: E402

from strata_rt.cli.common import display_path, hardware_line, markdown_table, open_engine  # noqa: E402
from strata_rt.config.run.run_config import load_config  # noqa: E402
from strata_rt.runtime.memory import MIB  # noqa: E402

ARMS = ("walk", "routed", "auto")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3-30b-a3b-whole.yaml"))
    ap.add_argument("--prompts", default="254,1030,3866", help="comma-separated lengths")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per arm (default 3)")
    ap.add_argument("--warmups", type=int, default=2, help="untimed runs per arm (default 2)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    cfg = load_config(args.config).with_prompt_lengths(
        [int(n) for n in args.prompts.split(",")])
    if cfg.whole is None:
        raise SystemExit(f"{display_path(args.config)}: not a whole model")
    rows, records = [], []
    with open_engine(cfg) as engine:
        print(f"{hardware_line()}\n{display_path(args.config)}: {engine.residency.count} "
              f"experts resident, chunk {engine.chunk_tokens}", flush=True)
        for prompt in cfg.prompts:
            ids = prompt.token_ids(cfg.whole.vocab, cfg.seed)
            rec: dict = {"tokens": prompt.tokens}
            for arm in ARMS:
                engine.config.prefill_stream = arm
                walls, st = time_prefill(engine, ids, args.warmups, args.reps)
                nbytes = st.bytes_streamed
                mode = engine.driver.last_plan.mode if engine.driver.last_plan else "-"
                rec[arm] = {"wall_s": walls, "median_s": statistics.median(walls),
                            "bytes_streamed": nbytes, "mode": mode}
                print(f"{prompt.tokens} tokens, {arm}: {rec[arm]['median_s'] * 1e3:,.1f} ms, "
                      f"{nbytes / MIB:,.0f} MiB ({mode})", flush=True)
            records.append(rec)
            w, r, a = (rec[k] for k in ARMS)
            rows.append([prompt.tokens, f"{w['median_s'] * 1e3:,.1f}",
                         f"{r['median_s'] * 1e3:,.1f}", f"{w['median_s'] / r['median_s']:.2f}x",
                         f"{w['bytes_streamed'] / MIB:,.0f}", f"{r['bytes_streamed'] / MIB:,.0f}",
                         f"{r['bytes_streamed'] / max(w['bytes_streamed'], 1):.0%}",
                         f"{a['median_s'] * 1e3:,.1f} ({a['mode']})"])
    table = markdown_table(["tokens", "walk ms", "routed ms", "walk / routed", "walk MiB",
                            "routed MiB", "routed share", "auto ms (plan)"], rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"stream-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = {"command": " ".join(sys.argv), "hardware": hardware_line(),
           "config": display_path(args.config), "runs": records, "table": table}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"{doc['hardware']}\n\n`{doc['command']}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
