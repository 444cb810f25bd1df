"""How long opening a config takes, phase by phase, and how fast the expert store fills
against a plain parallel copy of the same bytes measured in the same run.

    python bench/bench_open_store.py --config configs/qwen3-235b-a22b-whole-16g.yaml
    python bench/bench_open_store.py --config configs/qwen3-235b-a22b-whole-16g.yaml \\
        --backend reference --layers 8          # the 235B shape cut to 8 layers, no GPU
    python bench/bench_open_store.py --config configs/tiny-qwen3moe.yaml --backend reference

One process, one open per `--store-memory` setting (alloc, register: both by default, in that
order; each builds the model, then Engine.open runs on it):

  model        load_model: a synthetic model's generation (router, norms, the pool of
               distinct expert blobs, dense weights) or a GGUF's header and dense weights
  store alloc  the store's host memory asked for (cuda alloc: cuMemHostAlloc of the whole
               store, pages locked at once; cuda register: an anonymous mapping, no page yet;
               reference: numpy)
  store fill   every expert blob written into it on the host threads; on cuda this write is
               also each page's allocation under register
  store pin    page-locking the filled store (cuda register: cuMemHostRegister; otherwise
               nothing)
  backend      the rest of Engine.open: device arena, resident experts, dense weights (their
               upload, or their host store when they stream), kernels
  total        model + Engine.open

The fill's ceiling is host_copy.copy_into (the same thread pool) of `--ceiling-gib` bytes
(default: the store's size, at most 4 GiB) into fresh memory, first touch included, run after
the engine closed; "touched" copies again into the same memory (bandwidth alone). The fill's
share of the fresh ceiling says how much of the copy rate the fill reaches. The pair is also
measured once before the open (4 GiB, or --ceiling-gib): where the first growth of a process
costs more than later ones, the two fresh figures differ and bracket the fill's. Results:
a Markdown table on stdout and <out>/open-<config>-<time>.json.

`--layers N` changes the synthetic model's layer count (every other dimension kept), so the
235B shape's per-layer costs can be measured on a machine without its RAM; a GGUF config
cannot be cut.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.cli.common import (  # noqa: E402
    display_path,
    hardware_line,
    markdown_table,
    write_json,
)
from strata_rt.config.run.run_config import load_config  # noqa: E402
from strata_rt.config.settings.engine_config import STORE_MEMORIES  # noqa: E402
from strata_rt.engine import Engine, load_model  # noqa: E402
from strata_rt.host import host_copy  # noqa: E402

GIB = 1 << 30
PHASES = ("model", "store alloc", "store fill", "store pin", "backend", "total")


def config_path(path: str, layers: int | None, tmp: Path) -> Path:
    """The config, or a copy of it whose synthetic model has `layers` layers."""
    if layers is None:
        return Path(path)
    doc = yaml.safe_load(Path(path).read_text())
    synthetic = (doc.get("model") or {}).get("synthetic")
    if not isinstance(synthetic, dict):
        raise SystemExit(f"--layers: {path} has no synthetic model to cut")
    synthetic["n_layers"] = layers
    if "pool_layers" in synthetic:
        synthetic["pool_layers"] = min(synthetic["pool_layers"], layers)
    out = tmp / f"{Path(path).stem}-{layers}layers.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def the_store(engine: Engine) -> Any:
    backend: Any = engine.backend
    return backend.store if hasattr(backend, "store") else backend.backends[0].store


def copy_ceiling(nbytes: int) -> dict[str, float]:
    """GB/s of copy_into of `nbytes` into fresh memory (first touch) and into the same memory
    again (warm)."""
    src = np.ones(nbytes, np.uint8)  # touched: the source is not what is measured
    dst = np.empty(nbytes, np.uint8)  # fresh pages: large arrays are fresh mappings
    t0 = time.perf_counter()
    host_copy.copy_into(dst, src)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    host_copy.copy_into(dst, src)
    warm = time.perf_counter() - t0
    assert dst[-1] == 1
    return {"bytes": nbytes, "fresh_gb_s": nbytes / fresh / 1e9, "warm_gb_s": nbytes / warm / 1e9}


def measure(path: Path, backend: str | None, store_memory: str) -> dict[str, Any]:
    cfg = load_config(str(path))
    if backend:
        cfg = cfg.with_backend(backend)
    base = dataclasses.replace(cfg.engine_config(), store_memory=store_memory)
    t0 = time.perf_counter()
    model, whole = load_model(base.model)
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    with Engine.open(dataclasses.replace(base, model=whole or model)) as engine:
        opened = time.perf_counter() - t1
        store = the_store(engine)
        name = engine.config.backend
        nbytes, timings = store.nbytes, dict(store.timings)
    store_s = sum(timings.values())
    seconds = {"model": built, "store alloc": timings["alloc_s"],
               "store fill": timings["fill_s"], "store pin": timings["pin_s"],
               "backend": opened - store_s, "total": built + opened}
    spec = model.spec
    return {"backend": name, "store_memory": store_memory, "store_bytes": nbytes,
            "seconds": seconds,
            "layers": spec.n_layers, "experts": spec.n_experts,
            "slot_bytes": model.layout.slot_bytes,
            "fill_gb_s": nbytes / max(timings["fill_s"], 1e-9) / 1e9,
            "pin_gb_s": (nbytes / timings["pin_s"] / 1e9) if timings["pin_s"] > 1e-3 else None,
            "threads": host_copy._workers()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--config", required=True, help="the config to open (a YAML file)")
    ap.add_argument("--backend", choices=("cuda", "reference"),
                    help="override the config's backend")
    ap.add_argument("--layers", type=int, help="a synthetic model cut to this many layers")
    ap.add_argument("--ceiling-gib", type=float,
                    help="bytes of the copy ceiling (default: the store's, at most 4 GiB)")
    ap.add_argument("--store-memory", default="alloc,register",
                    help="the CUDA store's page-locking settings to open with, one open each, "
                         "in this order (alloc, register; default: both)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="directory of the dated .json result ('' for none)")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers {args.layers}: a model has at least one layer")
    settings = [m.strip() for m in args.store_memory.split(",") if m.strip()]
    bad = [m for m in settings if m not in STORE_MEMORIES]
    if bad or not settings:
        ap.error(f"--store-memory {args.store_memory!r}: give one or more of "
                 f"{', '.join(STORE_MEMORIES)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = config_path(args.config, args.layers, Path(tmp))
        before = copy_ceiling(max(int((args.ceiling_gib or 4) * GIB), 1 << 20))
        runs = [measure(path, args.backend, settings[0])]
        if runs[0]["backend"] == "cuda":  # the reference backend locks nothing: one open
            runs += [measure(path, args.backend, m) for m in settings[1:]]
    rec = runs[0]
    size = int(args.ceiling_gib * GIB) if args.ceiling_gib else min(rec["store_bytes"], 4 * GIB)
    ceiling = copy_ceiling(max(size, 1 << 20))
    for r in runs:
        r["fill_share_of_ceiling"] = r["fill_gb_s"] / ceiling["fresh_gb_s"]
    rows = [[p, *(f"{r['seconds'][p]:.2f}" for r in runs)] for p in PHASES]
    table = markdown_table(["phase", *(f"s ({r['store_memory']})" for r in runs)], rows)
    notes = [f"store {rec['store_bytes'] / GIB:.2f} GiB ({rec['layers']} layers x "
             f"{rec['experts']} experts x {rec['slot_bytes']:,} B), {rec['threads']} host "
             f"threads, backend {rec['backend']}",
             f"a parallel copy into fresh memory: {ceiling['fresh_gb_s']:.2f} GB/s (into "
             f"touched memory {ceiling['warm_gb_s']:.2f} GB/s; {ceiling['bytes'] / GIB:.2f} "
             f"GiB each; before the opens: fresh {before['fresh_gb_s']:.2f}, touched "
             f"{before['warm_gb_s']:.2f} GB/s)"]
    for r in runs:
        pin = f"{r['pin_gb_s']:.1f} GB/s" if r["pin_gb_s"] else "nothing pinned after the fill"
        notes.append(f"{r['store_memory']}: fill {r['fill_gb_s']:.2f} GB/s = "
                     f"{r['fill_share_of_ceiling']:.0%} of that copy; pin: {pin}")
    rec = {"runs": runs, "ceiling": ceiling, "ceiling_before_open": before,
           "store_bytes": rec["store_bytes"], "backend": rec["backend"]}
    print(f"{hardware_line()}\n{display_path(args.config)}"
          + (f" cut to {args.layers} layers" if args.layers else "") + "\n\n" + table + "\n"
          + "\n".join(f"- {n}" for n in notes))
    doc = {"command": " ".join(sys.argv), "hardware": hardware_line(),
           "config": display_path(args.config), "layers_override": args.layers, **rec,
           "table": table, "notes": notes}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"open-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        write_json(out / f"{stem}.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
