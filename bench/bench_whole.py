"""Whole-model prefill benchmark: tokens/s of a whole Qwen3-MoE config against the PCIe ceiling.

One engine from a run config (default configs/qwen3-30b-a3b-whole.yaml); the pinned
host-to-device rate is measured with torch in the same process (when torch is there). Every
prompt length runs `--warmups` times first (kernels, cuBLAS heuristics, the walk plan, then its
CUDA-graph trial), then `--reps` timed runs, each from an empty KV cache. Per prompt: the median time to
first token (host clock around the prefill call, logits included), tokens/s, bytes streamed,
the achieved PCIe GB/s and its share of the ceiling, and host time / wall.

The PCIe floor of a prompt is the bytes it must stream (non-resident experts, and the dense
layers when they stream) over the ceiling: `floor ms` in the table, and `PCIe share` = floor /
time. Results: <out>/whole-<config>-<time>.{json,md}.

    python bench/bench_whole.py                                       # the 30B shape, 1/4 resident
    python bench/bench_whole.py --config configs/qwen3-235b-a22b-whole.yaml --prompts 8179,30118
    python bench/bench_whole.py --prompts 254,1030 --streams walk,routed,routed_walk
    python bench/bench_whole.py --prompts 16000,30118 --orders chunks,layers

--streams runs every prompt once per prefill_stream setting on the same engine (the driver
reads it per chunk), one table row each: the streaming policies side by side in one run.
--orders does the same for prefill_order (chunks, layers: the layer pass of a prompt longer
than a chunk); the plan column then says layer_pass where the pass ran.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch_clock import pinned_h2d_gb_s  # noqa: E402

from strata_rt.cli.common import display_path, hardware_line, markdown_table, open_engine  # noqa: E402
from strata_rt.config.run.run_config import load_config  # noqa: E402
from strata_rt.runtime.memory import MIB  # noqa: E402


def h2d_ceiling() -> float | None:
    """Pinned host-to-device GB/s of 64 MiB copies (torch, CUDA events), None without torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return pinned_h2d_gb_s(torch, {"64mib": 64 * MIB})["64mib"]


def time_prefill(engine: Any, ids: Any, warmups: int, reps: int) -> tuple[list[float], Any]:
    """`warmups` untimed prefills of `ids`, then `reps` timed ones, each from an empty KV
    cache -> (host-clock seconds of each timed call, logits included; the last call's Stats)."""
    for _ in range(warmups):
        engine.reset()
        engine.prefill(ids)
    walls, last = [], None
    for _ in range(max(1, reps)):
        engine.reset()
        t = time.perf_counter()
        _, last = engine.prefill(ids)
        walls.append(time.perf_counter() - t)
    return walls, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3-30b-a3b-whole.yaml"))
    ap.add_argument("--prompts", help="comma-separated lengths (default: the config's)")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per prompt (default 2)")
    ap.add_argument("--warmups", type=int, default=3,
                    help="untimed runs per prompt first (default 3: plain launches, then the "
                         "CUDA-graph trial; a short prompt streaming its routed experts runs "
                         "the walk that measures its routing, the routed walk plainly, then "
                         "its capture)")
    ap.add_argument("--streams", help="comma-separated prefill_stream settings, each run per "
                    "prompt (default: the engine's own)")
    ap.add_argument("--orders", help="comma-separated prefill_order settings (chunks, layers, "
                    "auto), each run per prompt on the same engine (opened under auto, so it "
                    "holds the layer pass's residual)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    if args.orders:
        os.environ["STRATA_PREFILL_ORDER"] = "auto"
    cfg = load_config(args.config)
    if args.prompts:
        cfg = cfg.with_prompt_lengths([int(n) for n in args.prompts.split(",")])
    if cfg.whole is None:
        raise SystemExit(f"{display_path(args.config)}: not a whole model")
    ceiling = h2d_ceiling()
    t0 = time.perf_counter()
    rows, records = [], []
    with open_engine(cfg) as engine:
        opened = time.perf_counter() - t0
        backend = engine.backend
        print(f"{hardware_line()}\nopened {display_path(args.config)} in {opened:.1f} s: "
              f"{engine.residency.count} experts resident, dense "
              f"{'streamed' if getattr(backend, 'dense_ring', None) else 'resident'}, chunk "
              f"{engine.chunk_tokens}; pinned H2D ceiling "
              f"{'n/a' if ceiling is None else f'{ceiling:.1f} GB/s'}", flush=True)
        streams = args.streams.split(",") if args.streams else [None]
        orders = args.orders.split(",") if args.orders else [None]
        for prompt in cfg.prompts:
            ids = prompt.token_ids(cfg.whole.vocab, cfg.seed)
            for stream, order in itertools.product(streams, orders):
                if stream is not None:
                    engine.driver.cfg.prefill_stream = stream
                if order is not None:
                    engine.driver.cfg.prefill_order = order
                walls, last = time_prefill(engine, ids, args.warmups, args.reps)
                wall = statistics.median(walls)
                gbps = last.bytes_streamed / wall / 1e9
                floor = None if ceiling is None else last.bytes_streamed / (ceiling * 1e9)
                mode = engine.driver.last_plan.mode if engine.driver.last_plan else "-"
                rec = {"tokens": prompt.tokens, "stream": stream, "order": last.prefill_order,
                       "plan": mode, "wall_s": walls,
                       "median_s": wall, "tokens_per_s": prompt.tokens / wall,
                       "bytes_streamed": last.bytes_streamed, "pcie_gb_s": gbps,
                       "floor_s": floor, "host_s": last.host_s, "chunks": last.chunks}
                records.append(rec)
                rows.append([prompt.tokens, mode, f"{wall * 1e3:,.1f}",
                             f"{prompt.tokens / wall:,.0f}",
                             f"{last.bytes_streamed / MIB:,.0f}", f"{gbps:.1f}",
                             "-" if floor is None else f"{floor * 1e3:,.1f}",
                             "-" if floor is None else f"{floor / wall:.0%}",
                             f"{last.host_s / wall:.0%}", last.chunks])
                trials = {str(k): v for k, v in engine.driver.graph_trials.items()}
                rec["graph_trials"] = trials
                print(f"{prompt.tokens} tokens, {mode}: {wall * 1e3:,.1f} ms; graph trials "
                      f"{trials}", flush=True)
    table = markdown_table(["tokens", "plan", "TTFT ms", "tokens/s", "streamed MiB", "PCIe GB/s",
                            "floor ms", "PCIe share", "host/wall", "chunks"], rows)
    print(table)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"whole-{Path(args.config).stem}-{stamp}"
    doc = {"command": " ".join(sys.argv), "hardware": hardware_line(), "config": display_path(args.config),
           "h2d_gb_s": ceiling, "runs": records, "table": table}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(f"{doc['hardware']}\n\n`{doc['command']}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
