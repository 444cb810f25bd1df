"""GGUF expert conversion and loading at the Qwen3-30B-A3B expert shape (hidden 2048, ffn 768):
experts per second converted to a format on every core, the minutes that makes for the whole
model (48 layers x 128 experts), and the peak host memory of loading a file whose experts are
already in the format.

    python bench/bench_convert.py [--sources f16,bf16,q8_0] [--format iq3_xxs]
                                  [--workers N] [--experts N] [--one-process]
                                  [--load-layers 4] [--json PATH]

Conversion: for each source type, a one-layer GGUF of `--experts` experts (default: two per
worker) is written with our writer, then loaded with Model.from_gguf(..., workers=N) and its
experts converted into an array the size of the store (`write_layers`, the call the expert
store makes). The rate counts the whole call: starting the workers, reading the memory map,
dequantizing (gguf package), quantizing (the format), copying the results. `--one-process`
also times the same conversion in this process (the speed-up of the workers).

CPU seconds (this process and the finished workers, from getrusage) per expert give the time
on free cores, which a machine shared with other work does not show in its wall time; the
16-core figure assumes the rate per core holds (each worker converts its own experts, so
nothing is shared but the memory map).

Load: a GGUF of `--load-layers` Qwen3-30B-shaped layers already in the format's GGUF type is
loaded into an ExpertStore in a fresh process; VmHWM (peak resident memory) is read from
/proc/self/status, reset just before the store is built, and compared with the store's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from strata_rt.report.eta import format_seconds  # noqa: E402
from strata_rt.weights.convert import default_workers  # noqa: E402
from strata_rt.weights.gguf_file.gguf_io import tensor_names, write_moe_gguf  # noqa: E402
from strata_rt.weights.model import QWEN3_30B_SPEC, Model, MoESpec  # noqa: E402

Q = GGMLQuantizationType
SOURCES = {"f16": None, "bf16": Q.BF16, "q8_0": Q.Q8_0, "f32": None}
MIB = 1 << 20

PEAK_SCRIPT = """
import json, sys
from strata_rt.weights.model import Model
from strata_rt.weights.store import ExpertStore

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

model = Model.from_gguf(sys.argv[1], sys.argv[2])
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
store = ExpertStore(model)
print(json.dumps({"base": base, "peak": status("VmHWM"), "store": store.nbytes,
                  "layer": model.spec.n_experts * model.layout.blob_bytes}))
"""


def source_file(path: Path, source: str, n_experts: int, seed: int = 0) -> Path:
    """One Qwen3-30B-shaped layer of `n_experts` experts in the source type."""
    H, F = QWEN3_30B_SPEC.hidden, QWEN3_30B_SPEC.ffn
    rng = np.random.default_rng(seed)
    spec = MoESpec(1, H, F, n_experts, min(QWEN3_30B_SPEC.top_k, n_experts))
    stub = SimpleNamespace(spec=spec,
                           router=rng.standard_normal((1, n_experts, H), np.float32) * 0.05,
                           norm=np.ones((1, H), np.float32))
    names = tensor_names(0)
    tensors = {}
    for part, (rows, cols) in (("gate", (F, H)), ("up", (F, H)), ("down", (H, F))):
        w = rng.standard_normal((n_experts, rows, cols), np.float32) * cols ** -0.5
        qt = SOURCES[source]
        if source == "f16":
            tensors[names[part]] = (w.astype(np.float16), None)
        elif source == "f32":
            tensors[names[part]] = (w, None)
        else:
            tensors[names[part]] = (gguf_quantize(w, qt), qt)
    return write_moe_gguf(path, stub, tensors=tensors)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def time_conversion(path: Path, fmt: str, workers: int) -> tuple[float, float]:
    """-> (wall seconds, CPU seconds) of converting the file's experts."""
    model = Model.from_gguf(path, fmt, workers=workers)
    grid = np.empty((1, model.spec.n_experts, model.layout.blob_bytes), np.uint8)
    c0, t0 = cpu_seconds(), time.perf_counter()
    model.write_layers(grid)  # returns after the pool has shut down: its CPU time is counted
    return time.perf_counter() - t0, cpu_seconds() - c0


def load_peak(tmp: Path, fmt: str, layers: int) -> dict:
    spec = MoESpec(layers, QWEN3_30B_SPEC.hidden, QWEN3_30B_SPEC.ffn,
                   QWEN3_30B_SPEC.n_experts, QWEN3_30B_SPEC.top_k, format=fmt)
    path = write_moe_gguf(tmp / "load.gguf", Model.synthetic(spec, 0))
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), fmt],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    r = json.loads(done.stdout)
    r["layers"] = layers
    r["grown"] = r["peak"] - r["base"]
    path.unlink()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", default="f16,bf16,q8_0",
                    help=f"comma-separated source types: {', '.join(SOURCES)}")
    ap.add_argument("--format", default="iq3_xxs")
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per sample (default: two per worker)")
    ap.add_argument("--one-process", action="store_true",
                    help="also time the conversion in this process")
    ap.add_argument("--load-layers", type=int, default=4,
                    help="layers of the load-memory file (0: skip)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sources = [s for s in args.sources.split(",") if s]
    bad = [s for s in sources if s not in SOURCES]
    if bad:
        ap.error(f"--sources: unknown {', '.join(bad)}; allowed: {', '.join(SOURCES)}")
    n = args.experts or 2 * args.workers
    total = QWEN3_30B_SPEC.n_layers * QWEN3_30B_SPEC.n_experts
    doc: dict = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                 "workers": args.workers, "format": args.format, "experts_per_sample": n,
                 "model_experts": total, "conversion": [], "load": None}
    print(f"{doc['cpu']}, {doc['cores']} cores; {args.workers} workers; {n} experts of "
          f"{QWEN3_30B_SPEC.ffn}x{QWEN3_30B_SPEC.hidden} per sample; to {args.format}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for source in sources:
            path = source_file(tmp / f"{source}.gguf", source, n)
            secs, cpu = time_conversion(path, args.format, args.workers)
            rate = n / secs
            per_core = cpu / n  # CPU seconds per expert: what a free core would take
            rec = {"source": source, "seconds": secs, "cpu_seconds": cpu,
                   "experts_per_s": rate, "model_minutes": total / rate / 60,
                   "cpu_s_per_expert": per_core,
                   "model_minutes_per_core_count": {c: total * per_core / c / 60
                                                    for c in (args.workers, 16)}}
            if args.one_process:
                one, _ = time_conversion(path, args.format, 1)
                rec["one_process_experts_per_s"] = n / one
            doc["conversion"].append(rec)
            extra = (f"; one process {rec['one_process_experts_per_s']:.3f} experts/s"
                     if args.one_process else "")
            print(f"{source:>5} -> {args.format}: {n} experts in {secs:.1f} s = {rate:.3f} "
                  f"experts/s; {total:,} experts (Qwen3-30B-A3B) in "
                  f"{format_seconds(total / rate)}{extra}", flush=True)
            print(f"       {per_core:.1f} CPU s per expert: {total:,} experts on "
                  f"{args.workers} free cores {format_seconds(total * per_core / args.workers)}"
                  f", on 16 {format_seconds(total * per_core / 16)}", flush=True)
            path.unlink()
        if args.load_layers > 0:
            r = load_peak(tmp, args.format, args.load_layers)
            doc["load"] = r
            print(f"load of {r['layers']} Qwen3-30B-shaped {args.format} layers: store "
                  f"{r['store'] / MIB:,.1f} MiB, one layer {r['layer'] / MIB:,.1f} MiB, peak "
                  f"host memory grew {r['grown'] / MIB:,.1f} MiB (store + "
                  f"{(r['grown'] - r['store']) / MIB:,.1f} MiB)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
