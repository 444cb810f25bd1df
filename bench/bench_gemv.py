"""The decode step's expert products alone: one token's top_k routed experts per layer through
a GGML format's matrix-vector kernels (FormatKernels.gemv_routed: gate/up with SwiGLU, then
down; kernels/ggml/gemv.cuh), per format and expert geometry, so a kernel change is measured in
seconds, without a model.

    python bench/bench_gemv.py [--formats iq3_xxs,q4_k] [--shapes 30b,235b] [--layers 48]
                               [--reps 10] [--host] [--max-gib 16] [--json PATH]

Workload: `--layers` layers, each with its own top_k distinct experts (random valid blobs,
bench_ggml.expert_blobs), so a timed pass reads every layer's experts once and none from L2
(fewer layers where `--max-gib` would be exceeded); each layer's launches read a device table
of its experts' addresses, as the engine's decode plan does. Timing: CUDA events around one
pass over the layers, warm-ups then the median of --reps; per layer: microseconds, and the
rate at which the experts' bytes are read, against the device-to-device copy measured in the
same run (bytes read per second of a 1 GiB copy: the HBM ceiling proxy). --host adds the same
pass with every expert in pinned host memory read through its device-mapped address (the
quarter-resident regime's non-resident experts), against a pinned host-to-device copy of the
same bytes. The markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gemm import MODELS  # noqa: E402
from bench_ggml import choose_formats, expert_blobs, ggml_formats  # noqa: E402
from mmq_common import TOP_K, WARMUPS, median_ms, runtime_event_timer  # noqa: E402

#: bytes of the device-to-device copy that stands for the HBM ceiling
COPY_BYTES = 1 << 30
#: distinct random blobs per format and geometry (the layers cycle through rotations of them)
DISTINCT = 4
GIB = 1 << 30
__all__ = ["WARMUPS", "main", "parse", "table", "layers_within"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="", help="comma-separated GGML formats (iq3_xxs, the "
                   "baseline, is always measured first; default: iq3_xxs only)")
    p.add_argument("--shapes", default="30b", help=f"comma-separated of {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=48, help="layers of distinct experts a pass "
                   "reads (default 48, the 30B model's)")
    p.add_argument("--reps", type=int, default=10, help="timed passes (median; default 10)")
    p.add_argument("--host", action="store_true", help="also read the experts from pinned "
                   "host memory")
    p.add_argument("--max-gib", type=float, default=16.0, help="at most this many GiB of "
                   "experts per pass (fewer layers beyond; default 16)")
    p.add_argument("--json", type=Path, help="also write the results here")
    a = p.parse_args(argv)
    available = ggml_formats()
    try:
        a.formats = choose_formats(a.formats or "iq3_xxs", available)
    except ValueError as e:
        p.error(str(e))
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in a.shapes if s not in MODELS]
    if bad or not a.shapes:
        p.error(f"unknown shapes {bad}; valid: {', '.join(MODELS)}")
    if a.layers < 1 or a.reps < 1 or a.max_gib <= 0:
        p.error("--layers and --reps must be >= 1 and --max-gib > 0")
    return a


def layers_within(blob_bytes: int, layers: int, max_gib: float) -> int:
    """The layers of top_k experts that fit max_gib (at least one)."""
    return max(1, min(layers, int(max_gib * GIB) // (TOP_K * blob_bytes)))


class Pass:
    """One geometry's buffers for a format: the experts of `layers` layers (device or pinned
    host memory), each layer's address table, the routing of one token (pairs 0..top_k-1 to
    experts 0..top_k-1 of the layer's table, rows in that order) and the activations."""

    def __init__(self, rt: Any, s: Any, fmt: Any, hidden: int, ffn: int, layers: int,
                 on_host: bool, rng: np.random.Generator):
        from strata_rt.runtime.hostmap import host_device_pointer

        self.rt, self.owned, self.on_host = rt, [], on_host
        lay = fmt.layout(hidden, ffn)
        self.blob_bytes, self.layers = lay.blob_bytes, layers
        n = layers * TOP_K
        blobs = expert_blobs(fmt, rng, hidden, ffn, DISTINCT)
        if on_host:
            self.pinned = rt.pinned({"experts": n * lay.slot_bytes})
            store = self.pinned.view("experts").reshape(n, lay.slot_bytes)
            for e in range(n):
                store[e, : lay.blob_bytes] = blobs[e % len(blobs)]
            base = host_device_pointer(self.pinned.view("experts"))
        else:
            self.pinned = None
            slots = self._alloc(n * lay.slot_bytes)
            for i, blob in enumerate(blobs[:n]):
                rt.memcpy_htod(slots.ptr + i * lay.slot_bytes, blob, s)
            for e in range(len(blobs), n):
                rt.memcpy_dtod(slots.ptr + e * lay.slot_bytes,
                               slots.ptr + (e % len(blobs)) * lay.slot_bytes, lay.blob_bytes, s)
            base = slots.ptr
        table = np.array([base + e * lay.slot_bytes for e in range(n)], np.uint64)
        self.tables = self._upload(s, table)
        self.ids = self._upload(s, np.arange(TOP_K, dtype=np.int32))
        self.row_of = self._upload(s, np.arange(TOP_K, dtype=np.int32))
        x = (rng.standard_normal((TOP_K, hidden)) / np.sqrt(hidden)).astype(np.float16)
        self.acts = self._upload(s, x)
        self.mid = self._alloc(TOP_K * ffn * 2)
        self.out = self._alloc(TOP_K * hidden * 4)
        self.kern = fmt.kernels(rt, lay)
        s.synchronize()

    def _alloc(self, nbytes: int) -> Any:
        buf = self.rt.alloc(nbytes)
        self.owned.append(buf)
        return buf

    def _upload(self, s: Any, a: np.ndarray) -> Any:
        buf = self._alloc(a.nbytes)
        self.rt.memcpy_htod(buf.ptr, a, s)
        return buf

    def run(self, s: Any) -> None:
        """Every layer's two launches, as a decode step issues them."""
        for layer in range(self.layers):
            self.kern.gemv_routed(s, self.tables.ptr + layer * TOP_K * 8, self.ids.ptr,
                                  self.row_of.ptr, self.acts.ptr, self.mid.ptr, self.out.ptr,
                                  TOP_K, host_reads=self.on_host)

    def free(self) -> None:
        for buf in self.owned:
            buf.free()
        if self.pinned is not None:
            self.pinned.free()


def copy_rates(rt: Any, s: Any, timer: Any, reps: int, host_bytes: int) -> dict[str, float]:
    """GB/s read by a 1 GiB device-to-device copy, and by a pinned host-to-device copy of
    host_bytes (0: not measured)."""
    src, dst = rt.alloc(COPY_BYTES), rt.alloc(COPY_BYTES)
    try:
        ms = median_ms(lambda: rt.memcpy_dtod(dst.ptr, src.ptr, COPY_BYTES, s), reps, timer)
        out = {"d2d_read_gbps": COPY_BYTES / ms / 1e6}
        if host_bytes:
            n = min(host_bytes, COPY_BYTES)
            pinned = rt.pinned({"h": n})
            try:
                h = pinned.view("h")
                ms = median_ms(lambda: rt.memcpy_htod(dst.ptr, h, s), reps, timer)
                out["h2d_gbps"] = n / ms / 1e6
            finally:
                s.synchronize()
                pinned.free()
    finally:
        s.synchronize()
        src.free()
        dst.free()
    return out


def measure(a: argparse.Namespace) -> dict:
    from strata_rt.runtime import Runtime

    rt = Runtime.open()
    # a format's kernels hold a grouped fp16 GEMM this benchmark never runs: the own kernels,
    # so no CUTLASS library is built for it
    rt.f16_gemm = "own"
    s = rt.stream("bench")
    timer = runtime_event_timer(rt, s)
    rng = np.random.default_rng(0)
    res: dict = {"device": getattr(rt, "name", "?"), "reps": a.reps, "runs": []}
    formats = ggml_formats()
    try:
        res["copy"] = copy_rates(rt, s, timer, a.reps, 256 << 20 if a.host else 0)
        for shape in a.shapes:
            _, hidden, ffn = MODELS[shape]
            for name in a.formats:
                fmt = formats[name]
                for on_host in ((False, True) if a.host else (False,)):
                    row = {"format": name, "shape": shape, "where": "host" if on_host
                           else "device"}
                    try:
                        blob = fmt.layout(hidden, ffn).blob_bytes
                        layers = layers_within(blob, a.layers, a.max_gib)
                        ps = Pass(rt, s, fmt, hidden, ffn, layers, on_host, rng)
                        try:
                            ms = median_ms(lambda ps=ps: ps.run(s), a.reps, timer)
                        finally:
                            s.synchronize()
                            ps.free()
                        us = 1e3 * ms / layers
                        gbps = TOP_K * blob / (us * 1e-6) / 1e9
                        ceiling = res["copy"]["h2d_gbps" if on_host else "d2d_read_gbps"]
                        row.update(layers=layers, blob_bytes=blob, us_per_layer=us, gbps=gbps,
                                   of_ceiling=gbps / ceiling)
                    except Exception as e:  # one line, and the run goes on
                        row["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
                    print(json.dumps(row), flush=True)
                    res["runs"].append(row)
    finally:
        rt.close()
    return res


def table(res: dict) -> str:
    copy = res.get("copy", {})
    lines = [f"{res.get('device', '?')}: device-to-device copy reads "
             f"{copy.get('d2d_read_gbps', 0):.0f} GB/s"
             + (f", pinned host-to-device {copy['h2d_gbps']:.1f} GB/s" if "h2d_gbps" in copy
                else ""), "",
             "| format | shape | experts in | layers | us / layer (gate/up + down) | GB/s read "
             "| of the copy rate |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| {r['format']} | {r['shape']} | {r['where']} | - | {r['error']} "
                         "| | |")
            continue
        lines.append(f"| {r['format']} | {r['shape']} | {r['where']} | {r['layers']} | "
                     f"{r['us_per_layer']:.1f} | {r['gbps']:.0f} | {r['of_ceiling']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    res = measure(a)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0 if all("error" not in r for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
