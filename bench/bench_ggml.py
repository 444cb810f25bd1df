"""Per GGML format, one MoE layer of the Qwen3-30B-A3B and Qwen3-235B-A22B expert geometries:
how fast each type's dequantizing gather and products run, beside IQ3_XXS f16_gemm measured
in the same process, so a format's cost is read against the format the engine was tuned on,
and its gather against the memory ceiling of the same device.

    python bench/bench_ggml.py [--formats q4_k,q6_k,...] [--shapes 30b,235b]
                               [--tokens COUNTS] [--reps N] [--no-fused]
                               [--max-seconds S] [--distinct N] [--json PATH] [--list]

--formats: registered GGML formats (default: every GGMLFormat the registry holds); iq3_xxs is
always measured first, as the baseline. --list prints the formats and the sizes of their
experts and exits (no GPU needed).

Workload (the routing, timing rule and TFLOPS of bench_mmq.py, from bench/mmq_common.py; the
geometries of bench_gemm.py): every expert of the layer, top-k routing with log-normal expert
popularity, rows sorted by expert, the experts in MMQ groups. Per format and geometry:
- slots: one random valid expert (fmt.random_expert) and, for the other --distinct ones, row
  rotations of it (still whole valid blocks; content does not change speed), tiled over the
  slots;
- gather: f16_gemm's batched dequantizing gather, one gather_batch launch per group into the
  group buffers; bandwidth = (blob bytes read + fp16 image bytes written) / time, and that as
  a fraction of the device-to-device copy rate measured at the start of the run (a large
  cuMemcpyDtoD, counted the same way: bytes read plus bytes written), the HBM ceiling proxy;
- products, per token count: the group launches of f16_gemm's mmq for gate/up (m = the gate
  and up rows, k = hidden) and for down (m = hidden, k = ffn) on fp16 activations, rows_hint =
  the group's busiest expert; TFLOPS counts a multiply-add as two flops over rows x m x k,
  summed over both parts; the same for f16_fused (group buffers holding the native blocks,
  filled by its own byte-copy gathers) unless --no-fused;
- layer: the gather and both products of f16_gemm, as TFLOPS of the whole layer, and its ratio
  to IQ3_XXS f16_gemm's at the same geometry and token count.
Not measured: the in-place products an engine runs on short chunks of resident experts.
Timing: CUDA events, warm-ups then the median of --reps. Each format's measurement is wrapped:
a failure prints one line, is recorded in the JSON, and the run goes on (a broken CUDA context
is reopened). Formats not started once --max-seconds of wall time have passed are listed as
skipped. The markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_gemm import MODELS, POOL_ROWS, layer_tflops, parts  # noqa: E402
from mmq_common import (  # noqa: E402
    EXPERTS,
    TOP_K,
    median_ms,
    routing,
    runtime_event_timer,
)

from strata_rt.config.settings import env  # noqa: E402
from strata_rt.formats.contract import MMQ_GROUP  # noqa: E402
from strata_rt.formats.ggml_format import F16_FUSED, F16_GEMM, GGMLFormat  # noqa: E402
from strata_rt.gemm.grouped_gemm import fp16_image_bytes  # noqa: E402

BASELINE = "iq3_xxs"
N_GROUPS = EXPERTS // MMQ_GROUP
#: bytes of the device-to-device copy that stands for the HBM ceiling (far beyond any L2)
COPY_BYTES = 1 << 30
#: the gather's goal, as a fraction of the copy rate (the table lists the rows below it)
GATHER_GOAL = 0.70


# ------------------------------------------------------------------------------ formats, sizes
def ggml_formats() -> dict[str, GGMLFormat]:
    """Every registered GGMLFormat by name, the baseline first, then in registry order."""
    from strata_rt.formats.registry import registry

    reg = registry()
    found = {n: reg[n] for n in reg.names() if isinstance(reg[n], GGMLFormat)}
    found = {n: f.for_variant(F16_GEMM) for n, f in found.items()}  # type: ignore[attr-defined]
    return dict(sorted(found.items(), key=lambda kv: kv[0] != BASELINE))


def choose_formats(arg: str | None, available: dict[str, GGMLFormat]) -> list[str]:
    """The names to measure: `arg` (comma-separated; None or "": all), the baseline always
    first. ValueError names unknown ones."""
    wanted = [n.strip() for n in (arg or "").split(",") if n.strip()] or list(available)
    bad = [n for n in wanted if n not in available]
    if bad:
        raise ValueError(f"unknown or non-GGML formats {bad}; valid: {', '.join(available)}")
    if BASELINE not in available:
        raise ValueError(f"the baseline {BASELINE} is not registered")
    return list(dict.fromkeys([BASELINE, *wanted]))


def has_fused(fmt: GGMLFormat) -> bool:
    """Whether the format offers the f16_fused variant (a down_typed layer does not)."""
    return F16_FUSED in fmt.mmq_variants() and fmt.down_gtype is fmt.gtype


def gather_bytes(fmt: GGMLFormat, hidden: int, ffn: int) -> tuple[int, int]:
    """(bytes read, bytes written) by f16_gemm's gather of every expert of the layer."""
    lay = fmt.for_variant(F16_GEMM).layout(hidden, ffn)
    return (EXPERTS * lay.blob_bytes,
            EXPERTS * (lay.gate_up_image_bytes + lay.down_image_bytes))


def expert_blobs(fmt: GGMLFormat, rng: np.random.Generator, hidden: int, ffn: int,
                 distinct: int) -> list[np.ndarray]:
    """One random valid blob, then the rest of `distinct` as copies with the rows of each part
    rotated (whole rows of whole blocks, so still valid; cheaper than drawing more)."""
    lay = fmt.layout(hidden, ffn)
    first = np.ascontiguousarray(fmt.random_expert(rng, hidden, ffn), dtype=np.uint8)
    if first.size != lay.blob_bytes:
        raise ValueError(f"{fmt.name}: random_expert gave {first.size} bytes, the layout "
                         f"{lay.blob_bytes}")
    out = [first]
    ranges = [(lay.gate_up_offset, lay.gate_up_bytes, 2 * ffn),
              (lay.down_offset, lay.down_bytes, hidden)]
    for i in range(1, max(1, distinct)):
        b = first.copy()
        for off, n, rows in ranges:
            if n % rows == 0:
                seg = first[off: off + n].reshape(rows, -1)
                b[off: off + n] = np.roll(seg, i * max(1, rows // distinct), axis=0).reshape(-1)
        out.append(b)
    return out


def format_list(formats: dict[str, GGMLFormat], shapes: list[str]) -> str:
    """--list: each format's type, fused variant and expert bytes per geometry."""
    lines = ["format | type | f16_fused | " + " | ".join(
        f"{s} blob MB (gather read + written MB)" for s in shapes)]
    for name, fmt in formats.items():
        cells = []
        for s in shapes:
            _, h, f = MODELS[s]
            try:
                r, w = gather_bytes(fmt, h, f)
                cells.append(f"{r / EXPERTS / 1e6:.2f} ({r / 1e6:.0f} + {w / 1e6:.0f})")
            except Exception as e:  # a geometry the format refuses
                cells.append(f"- ({type(e).__name__})")
        lines.append(f"{name} | {fmt.gtype.name} | {'yes' if has_fused(fmt) else 'no'} | "
                     + " | ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ device side
class ShapeBuffers:
    """What every format shares at one geometry: fp16 activations for the largest token count,
    the float32 output, the bounds, and every group's fp16 image buffers."""

    def __init__(self, rt, s, shape: str, max_rows: int, rng: np.random.Generator):
        _, self.hidden, self.ffn = MODELS[shape]
        self.rt, self.s = rt, s
        self.parts = parts(self.hidden, self.ffn)
        gu, dn = fp16_image_bytes(self.hidden, self.ffn)
        self.img = {"gate_up": gu, "down": dn}
        self.bufs: list[Any] = []
        self.images = {p: self._alloc(EXPERTS * n) for p, n in self.img.items()}
        self.acts = {}
        for part, (_, k) in self.parts.items():
            pool = rng.standard_normal((POOL_ROWS, k), dtype=np.float32).astype(np.float16)
            buf = self.acts[part] = self._alloc(max_rows * k * 2)
            rt.memcpy_htod(buf.ptr, pool[:max_rows], s)
            for r0 in range(POOL_ROWS, max_rows, POOL_ROWS):
                rt.memcpy_dtod(buf.ptr + r0 * k * 2, buf.ptr,
                               min(POOL_ROWS, max_rows - r0) * k * 2, s)
        self.out = self._alloc(max_rows * max(m for m, _ in self.parts.values()) * 4)
        self.bounds = self._alloc((EXPERTS + 1) * 4)
        s.synchronize()

    def _alloc(self, nbytes: int):
        buf = self.rt.alloc(nbytes)
        self.bufs.append(buf)
        return buf

    def set_routing(self, counts: np.ndarray) -> None:
        b = np.zeros(EXPERTS + 1, np.int32)
        b[1:] = np.cumsum(counts)
        self.rt.memcpy_htod(self.bounds.ptr, b, self.s)
        self.s.synchronize()

    def free(self) -> None:
        for buf in self.bufs:
            buf.free()


class Bench:
    """The runtime, its stream and timer, and the per-geometry buffers; reopened whole when a
    failure leaves the CUDA context unusable."""

    def __init__(self, shapes: list[str], max_rows: int, seed: int):
        self.shapes, self.max_rows, self.seed = shapes, max_rows, seed
        self.open()

    def open(self) -> None:
        from strata_rt.runtime import Runtime

        self.rt = Runtime.open()
        # the grouped fp16 GEMM's policy as an engine sets it from its config (auto: CUTLASS
        # for large launches on sm_90)
        self.rt.f16_gemm = env.choice("STRATA_F16_GEMM", "auto")
        self.s = self.rt.stream("bench")
        self.timer = runtime_event_timer(self.rt, self.s)
        rng = np.random.default_rng(self.seed)
        self.buffers = {sh: ShapeBuffers(self.rt, self.s, sh, self.max_rows, rng)
                        for sh in self.shapes}

    def recover(self) -> bool:
        """True when the context still works; else it is closed and a fresh one opened."""
        try:
            self.rt.synchronize()
            return True
        except Exception:
            pass
        try:
            self.rt.close()
        except Exception:
            pass
        self.open()
        return False

    def copy_rate(self, reps: int) -> dict:
        """The device-to-device copy of COPY_BYTES: ms and GB/s of bytes read plus written."""
        src, dst = self.rt.alloc(COPY_BYTES), self.rt.alloc(COPY_BYTES)
        try:
            ms = median_ms(lambda: self.rt.memcpy_dtod(dst.ptr, src.ptr, COPY_BYTES, self.s),
                           reps, self.timer)
        finally:
            self.s.synchronize()
            src.free()
            dst.free()
        return {"bytes": COPY_BYTES, "ms": ms, "gbps": 2 * COPY_BYTES / ms / 1e6}

    def close(self) -> None:
        try:
            for sb in self.buffers.values():
                sb.free()
            self.rt.close()
        except Exception as e:
            print(f"closing the runtime: {type(e).__name__}: {e}", flush=True)


def _groups(srcs: list[int]) -> list[list[int]]:
    return [srcs[g * MMQ_GROUP: (g + 1) * MMQ_GROUP] for g in range(N_GROUPS)]


def _products(b: Bench, sb: ShapeBuffers, kern, base: dict[str, int], img: dict[str, int],
              counts: np.ndarray, reps: int) -> dict:
    """Every group's launch of each part: ms per part, and TFLOPS of both together."""
    rows = int(counts.sum())
    hints = [max(1, int(counts[g * MMQ_GROUP: (g + 1) * MMQ_GROUP].max()))
             for g in range(N_GROUPS)]
    cell: dict = {}
    for part, (m, k) in sb.parts.items():
        def run(part=part, m=m, k=k) -> None:
            for g in range(N_GROUPS):
                kern.mmq(b.s, base[part] + g * MMQ_GROUP * img[part],
                         tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP)),
                         sb.acts[part].ptr, sb.bounds.ptr, sb.out.ptr, m, k, hints[g])

        cell[f"{part}_ms"] = median_ms(run, reps, b.timer)
    cell["ms"] = cell["gate_up_ms"] + cell["down_ms"]
    cell["tflops"] = layer_tflops(rows, sb.hidden, sb.ffn, cell["ms"])
    return cell


def _fail(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def bench_format(b: Bench, fmt: GGMLFormat, shape: str, counts: dict[int, np.ndarray],
                 reps: int, fused: bool, distinct: int, rng: np.random.Generator,
                 copy_gbps: float) -> dict:
    """One format at one geometry (see the module doc); the f16_fused part fails alone."""
    sb = b.buffers[shape]
    hidden, ffn = sb.hidden, sb.ffn
    t0 = time.perf_counter()
    lay = fmt.layout(hidden, ffn)
    for part, n in (("gate_up", lay.gate_up_image_bytes), ("down", lay.down_image_bytes)):
        if n > sb.img[part]:
            raise ValueError(f"{part} image of {n} bytes exceeds the fp16 image buffers")
    host = expert_blobs(fmt, rng, hidden, ffn, distinct)
    res: dict = {"blob_bytes": lay.blob_bytes, "tokens": {}}
    owned: list[Any] = []
    try:
        slots = b.rt.alloc(EXPERTS * lay.slot_bytes)
        owned.append(slots)
        srcs = [slots.ptr + e * lay.slot_bytes for e in range(EXPERTS)]
        for i, blob in enumerate(host):
            b.rt.memcpy_htod(srcs[i], blob, b.s)
        for e in range(len(host), EXPERTS):
            b.rt.memcpy_dtod(srcs[e], srcs[e % len(host)], lay.blob_bytes, b.s)
        kern = fmt.kernels(b.rt, lay)
        b.s.synchronize()
        del host
        res["prep_s"] = time.perf_counter() - t0
        img = {"gate_up": lay.gate_up_image_bytes, "down": lay.down_image_bytes}
        base = {p: sb.images[p].ptr for p in img}

        def gather() -> None:
            for g, group in enumerate(_groups(srcs)):
                kern.gather_batch(b.s, group, 0, base["gate_up"] + g * MMQ_GROUP * img["gate_up"],
                                  base["down"] + g * MMQ_GROUP * img["down"])

        read, written = EXPERTS * lay.blob_bytes, EXPERTS * (img["gate_up"] + img["down"])
        ms = median_ms(gather, reps, b.timer)
        gbps = (read + written) / ms / 1e6
        res["gather"] = {"read_bytes": read, "written_bytes": written, "ms": ms, "gbps": gbps,
                         "of_copy": gbps / copy_gbps if copy_gbps else None}
        gather()

        fz: dict | None = None
        if fused and has_fused(fmt):
            try:
                fz = _fused_setup(b, fmt.for_variant(F16_FUSED), hidden, ffn, srcs, reps, owned)
                res["fused_gather"] = fz["gather"]
            except Exception as e:
                res["fused_error"] = _fail(e)
                fz = None
                if not b.recover():
                    raise RuntimeError("the CUDA context broke in f16_fused's setup") from e
        for t, cnt in counts.items():
            sb.set_routing(cnt)
            row: dict = {"rows": int(cnt.sum()), "rows_min": int(cnt.min()),
                         "rows_max": int(cnt.max())}
            row[F16_GEMM] = _products(b, sb, kern, base, img, cnt, reps)
            row["layer_ms"] = res["gather"]["ms"] + row[F16_GEMM]["ms"]
            row["layer_tflops"] = layer_tflops(row["rows"], hidden, ffn, row["layer_ms"])
            if fz is not None:
                try:
                    row[F16_FUSED] = _products(b, sb, fz["kern"], fz["base"], fz["img"], cnt,
                                               reps)
                    row["fused_layer_ms"] = fz["gather"]["ms"] + row[F16_FUSED]["ms"]
                    row["fused_layer_tflops"] = layer_tflops(row["rows"], hidden, ffn,
                                                             row["fused_layer_ms"])
                except Exception as e:
                    res["fused_error"] = _fail(e)
                    fz = None
                    if not b.recover():
                        raise RuntimeError("the CUDA context broke in f16_fused's products") from e
            res["tokens"][t] = row
        res["seconds"] = time.perf_counter() - t0
        return res
    finally:
        try:
            b.s.synchronize()
            for buf in owned:
                buf.free()
        except Exception:
            pass  # the caller recovers the context


def _fused_setup(b: Bench, ffmt: GGMLFormat, hidden: int, ffn: int, srcs: list[int],
                 reps: int, owned: list[Any]) -> dict:
    """f16_fused's kernels, group buffers of native blocks filled by its batched byte-copy
    gather (timed), for _products."""
    lay = ffmt.layout(hidden, ffn)
    kern = ffmt.kernels(b.rt, lay)
    img = {"gate_up": lay.gate_up_image_bytes, "down": lay.down_image_bytes}
    bufs = {p: b.rt.alloc(EXPERTS * n) for p, n in img.items()}
    owned.extend(bufs.values())
    base = {p: buf.ptr for p, buf in bufs.items()}

    def gather() -> None:
        for g, group in enumerate(_groups(srcs)):
            kern.gather_batch(b.s, group, 0, base["gate_up"] + g * MMQ_GROUP * img["gate_up"],
                              base["down"] + g * MMQ_GROUP * img["down"])

    ms = median_ms(gather, reps, b.timer)
    nbytes = EXPERTS * lay.blob_bytes
    gather()
    return {"kern": kern, "img": img, "base": base,
            "gather": {"bytes_copied": nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6,
                       "fallbacks": getattr(kern, "fallbacks", None)}}


# ------------------------------------------------------------------------------ report
def add_ratios(res: dict) -> None:
    """vs_baseline on every token row: its layer TFLOPS over the baseline's at the same
    geometry and token count (None where either is missing)."""
    for by_fmt in res.get("runs", {}).values():
        base = by_fmt.get(BASELINE, {}).get("tokens", {})
        for r in by_fmt.values():
            for t, row in r.get("tokens", {}).items():
                ref = base.get(t, {}).get("layer_tflops")
                row["vs_baseline"] = row["layer_tflops"] / ref if ref else None


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def table(res: dict) -> str:
    """The markdown table of a result dict (as main builds it, or read back from its JSON)."""
    copy = res.get("copy", {})
    lines = [f"## GGML formats, one MoE layer ({EXPERTS} experts, top-{TOP_K}), "
             f"{res.get('device', '?')} ({res.get('arch', '?')}); device-to-device copy "
             f"{_num(copy.get('gbps'), '.0f')} GB/s (read + written); median of "
             f"{res.get('reps', '?')}; fp16 GEMM policy {res.get('f16_gemm_policy', '?')}", "",
             "layer = f16_gemm's dequantizing gather + gate/up + down products; TFLOPS = "
             "2 * rows * 3 * hidden * ffn / time; vs IQ3_XXS = layer TFLOPS / IQ3_XXS "
             "f16_gemm's", "",
             "| format | shape | tokens | gather ms | gather GB/s (% of copy) | f16_gemm TFLOPS "
             "| f16_fused TFLOPS | layer TFLOPS | vs IQ3_XXS |",
             "|---|---|---|---|---|---|---|---|---|"]
    below = []
    for shape, by_fmt in res.get("runs", {}).items():
        base = by_fmt.get(BASELINE, {}).get("tokens", {})
        for name, r in by_fmt.items():
            if "error" in r or "skipped" in r:
                why = r.get("error") or f"skipped: {r['skipped']}"
                lines.append(f"| {name} | {shape} | - | {why} | | | | | |")
                continue
            g = r["gather"]
            of = g.get("of_copy")
            if of is not None and of < GATHER_GOAL:
                below.append(f"{name} {shape} ({of:.0%})")
            gcell = f"{g['gbps']:.0f} ({_num(None if of is None else 100 * of, '.0f')}%)"
            for t, row in r["tokens"].items():
                ref = base.get(t, {}).get("layer_tflops")
                ratio = row["layer_tflops"] / ref if ref else None
                fz = row.get(F16_FUSED, {}).get("tflops")
                lines.append(
                    f"| {name} | {shape} | {t} | {g['ms']:.3f} | {gcell} | "
                    f"{row[F16_GEMM]['tflops']:.0f} | "
                    + (_num(fz, ".0f") if fz is not None else
                       ("failed" if "fused_error" in r else "-"))
                    + f" | {row['layer_tflops']:.0f} | {_num(ratio, '.2f')} |")
    if below:
        lines += ["", f"gathers under {GATHER_GOAL:.0%} of the copy rate: " + ", ".join(below)]
    fused_errors = [f"{n} {s}: {r['fused_error']}" for s, by in res.get("runs", {}).items()
                    for n, r in by.items() if "fused_error" in r]
    if fused_errors:
        lines += ["", "f16_fused failed: " + "; ".join(fused_errors)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="", help="comma-separated GGML formats (default: all)")
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--tokens", default="512,2048,8192", help="comma-separated token counts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--distinct", type=int, default=2, help="distinct expert blobs per format")
    ap.add_argument("--no-fused", action="store_true", help="skip the f16_fused products")
    ap.add_argument("--max-seconds", type=float, default=130.0,
                    help="start no format after this much wall time (0: no limit)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--list", action="store_true", help="list the formats and sizes, then exit")
    return ap


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, GGMLFormat]]:
    """Arguments checked (unknown formats or shapes, bad token counts and reps refused) and
    a.formats / a.shapes / a.tokens turned into lists; with the registered formats."""
    ap = build_parser()
    a = ap.parse_args(argv)
    available = ggml_formats()
    try:
        a.formats = choose_formats(a.formats, available)
    except ValueError as e:
        ap.error(str(e))
    a.shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in a.shapes if s not in MODELS]
    if bad or not a.shapes:
        ap.error(f"unknown shapes {bad}; valid: {', '.join(MODELS)}")
    try:
        a.tokens = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        ap.error(f"--tokens wants comma-separated integers, got {a.tokens!r}")
    if not a.tokens or min(a.tokens) < 1:
        ap.error("--tokens wants positive token counts")
    if a.reps < 1 or a.distinct < 1:
        ap.error("--reps and --distinct must be at least 1")
    return a, available


def main(argv: list[str] | None = None) -> int:
    a, available = parse(argv)
    if a.list:
        print(format_list({n: available[n] for n in a.formats}, a.shapes))
        return 0
    start = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    counts = {t: routing(rng, t) for t in a.tokens}
    res: dict = {"command": " ".join(sys.argv), "reps": a.reps, "distinct": a.distinct,
                 "experts": EXPERTS, "top_k": TOP_K, "formats": a.formats,
                 "shapes": {s: MODELS[s] for s in a.shapes},
                 "rows_per_expert": {t: c.tolist() for t, c in counts.items()}, "runs": {}}
    try:
        b = Bench(a.shapes, max(int(c.sum()) for c in counts.values()), a.seed)
    except Exception as e:
        print(f"no device to measure on: {_fail(e)}", flush=True)
        return 1
    res.update(device=b.rt.name, arch=b.rt.arch, f16_gemm_policy=b.rt.f16_gemm)
    try:
        res["copy"] = b.copy_rate(a.reps)
    except Exception as e:
        res["copy"] = {"error": _fail(e)}
        print(f"device-to-device copy failed: {_fail(e)}", flush=True)
        b.recover()
    copy_gbps = res["copy"].get("gbps") or 0.0
    print(f"{res['device']} ({res['arch']}): device-to-device copy "
          f"{_num(copy_gbps or None, '.0f')} GB/s; {len(a.formats)} formats x "
          f"{len(a.shapes)} shapes x {len(a.tokens)} token counts", flush=True)
    for shape in a.shapes:
        res["runs"][shape] = {}
    try:
        for i, name in enumerate(a.formats):
            fmt = available[name]
            elapsed = time.perf_counter() - start
            for shape in a.shapes:
                tag = f"[{i + 1}/{len(a.formats)}] {name} {shape}"
                if a.max_seconds and elapsed > a.max_seconds:
                    res["runs"][shape][name] = {"skipped": f"past --max-seconds {a.max_seconds:g}"}
                    print(f"{tag}: skipped (past --max-seconds)", flush=True)
                    continue
                try:
                    r = bench_format(b, fmt, shape, counts, a.reps, not a.no_fused, a.distinct,
                                     np.random.default_rng([a.seed, i]), copy_gbps)
                    res["runs"][shape][name] = r
                    g = r["gather"]
                    layer = " ".join(f"{t}:{row['layer_tflops']:.0f}"
                                     for t, row in r["tokens"].items())
                    fused = ("fused " + " ".join(f"{t}:{row[F16_FUSED]['tflops']:.0f}"
                                                 for t, row in r["tokens"].items()
                                                 if F16_FUSED in row)
                             if "fused_error" not in r else "fused FAILED")
                    print(f"{tag}: gather {g['ms']:.3f} ms {g['gbps']:.0f} GB/s "
                          f"({_num(None if g['of_copy'] is None else 100 * g['of_copy'], '.0f')}%"
                          f" of copy); layer TFLOPS {layer}; {fused}; prep {r['prep_s']:.1f} s, "
                          f"total {r['seconds']:.1f} s", flush=True)
                except Exception as e:
                    res["runs"][shape][name] = {"error": _fail(e)}
                    print(f"{tag}: FAILED {_fail(e)}", flush=True)
                    try:
                        if not b.recover():
                            print("  (CUDA context reopened)", flush=True)
                    except Exception as e2:
                        print(f"  the CUDA context could not be reopened: {_fail(e2)}",
                              flush=True)
                        raise SystemExit(2) from e2
    finally:
        b.close()
        add_ratios(res)
        res["seconds"] = time.perf_counter() - start
        if a.json:
            try:
                a.json.write_text(json.dumps(res, indent=1, default=str))
            except OSError as e:
                print(f"writing {a.json}: {e}", flush=True)
        print()
        print(table(res))
        print(f"\n(run took {res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
