"""Q2 blob and FP16 MMQ throughput on the Qwen3-30B-A3B expert shapes, beside the PyTorch bf16
peer and the dense rates the same GPU reaches, all measured in one process.

    python bench/bench_formats.py [--formats q2_blob,fp16:f16_gemm,fp16:f16_fused]
                                  [--tokens 512,2048,8192] [--reps 10] [--no-torch] [--json PATH]

--formats names formats, or format:variant for one MMQ variant (STRATA_MMQ_KERNEL's names; a
bare format name runs its default variant); default: every variant of each format, so FP16's
grouped fp16 GEMM (f16_gemm) runs beside the GEMM that decodes blocks in its main loop
(f16_fused).

Same workload as bench_mmq.py (routing, shapes, timing, TFLOPS = 2 * rows * m * k / time):
each format's MMQ over the 8 groups of 16 experts for gate/up (1536 x 2048) and down
(2048 x 768); torch.bmm in bf16 on the weights dequantized from the same blobs; dense
torch.matmul fp16 and torch._int_mm int8 at 8192^3. The ratio column divides our rate by the
dense rate of the instruction family the format's kernel uses (fp16 tensor cores for fp16,
int8 for q2_blob). Gather: one launch per expert (FP16 could batch; Q2 blob cannot) against a
device-to-device copy of the same blob bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mmq_common import (  # noqa: E402
    EXPERTS,
    FFN,
    HIDDEN,
    PARTS,
    TOP_K,
    UNIQUE,
    median_ms,
    routing,
    runtime_event_timer,
    tflops,
    torch_event_timer,
)
from mmq_torch import bmm_phase  # noqa: E402

from strata_rt.errors import FormatError  # noqa: E402
from strata_rt.formats.activations import ActivationKernels  # noqa: E402
from strata_rt.formats.contract import MMQ_GROUP, QuantFormat  # noqa: E402
from strata_rt.quants.fp16 import FP16  # noqa: E402
from strata_rt.quants.q2_blob import Q2Blob  # noqa: E402

FORMATS: dict[str, type[QuantFormat]] = {"q2_blob": Q2Blob, "fp16": FP16}
DENSE_KEY = {"q2_blob": "dense_int8_tops", "fp16": "dense_fp16_tflops"}


def every_variant() -> list[str]:
    """format:variant for every MMQ variant of every format here (the bare name where a format
    has one variant)."""
    out = []
    for name, cls in FORMATS.items():
        variants = cls().mmq_variants()
        out += [name] if len(variants) == 1 else [f"{name}:{v}" for v in variants]
    return out


def format_of(label: str) -> QuantFormat:
    """The format object of a --formats entry (name or name:variant)."""
    name, _, variant = label.partition(":")
    return FORMATS[name]().for_variant(variant or None)


def torch_phase(blobs: dict[str, np.ndarray], counts_by_t: dict[int, np.ndarray],
                reps: int) -> dict:
    import torch

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "bmm": {}}

    timer = torch_event_timer(torch)

    n = 8192
    a16, b16 = (torch.randn(n, n, device=dev, dtype=torch.float16) for _ in range(2))
    res["dense_fp16_tflops"] = tflops(n, n, n, median_ms(lambda: a16 @ b16, reps, timer))
    a8, b8 = (torch.randint(-128, 127, (n, n), device=dev, dtype=torch.int8) for _ in range(2))
    res["dense_int8_tops"] = tflops(n, n, n, median_ms(lambda: torch._int_mm(a8, b8), reps,
                                                       timer))
    for name, bl in blobs.items():
        fmt = FORMATS[name]()
        mats = [fmt.unpack_expert(b, HIDDEN, FFN) for b in bl]
        pick = torch.arange(EXPERTS) % UNIQUE
        w = {"gate_up": torch.from_numpy(np.stack([np.vstack(m[:2]).T for m in mats])),
             "down": torch.from_numpy(np.stack([m[2].T for m in mats]))}
        w = {p: t.to(dev, torch.bfloat16)[pick].contiguous() for p, t in w.items()}
        res["bmm"][name] = bmm_phase(torch, w, counts_by_t, reps, timer)
        del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def strata_phase(label: str, blobs: np.ndarray, counts_by_t: dict[int, np.ndarray],
                 reps: int, rng: np.random.Generator) -> dict:
    from strata_rt.runtime import Runtime

    fmt = format_of(label)
    lay = fmt.layout(HIDDEN, FFN)
    rt = Runtime.open()
    s = rt.stream("bench")

    timer = runtime_event_timer(rt, s)

    res: dict = {"device": rt.name, "arch": rt.arch, "blob_bytes": lay.blob_bytes, "mmq": {},
                 "format": fmt.name, "variant": getattr(fmt, "variant", None)}
    kern = fmt.kernels(rt, lay)
    slots = rt.alloc(EXPERTS * lay.slot_bytes)
    for e in range(EXPERTS):
        rt.memcpy_htod(slots.ptr + e * lay.slot_bytes, blobs[e % UNIQUE], s)
    n_groups = EXPERTS // MMQ_GROUP
    gu_buf = rt.alloc(EXPERTS * lay.gate_up_image_bytes)
    dn_buf = rt.alloc(EXPERTS * lay.down_image_bytes)

    def gather_all() -> None:
        for e in range(EXPERTS):
            g, p = divmod(e, MMQ_GROUP)
            kern.gather(s, slots.ptr + e * lay.slot_bytes, p,
                        gu_buf.ptr + g * MMQ_GROUP * lay.gate_up_image_bytes,
                        dn_buf.ptr + g * MMQ_GROUP * lay.down_image_bytes)

    nbytes = EXPERTS * lay.blob_bytes
    dtod = rt.alloc(nbytes)
    res["gather"] = {"bytes": nbytes, "ms": median_ms(gather_all, reps, timer),
                     "dtod_ms": median_ms(lambda: rt.memcpy_dtod(dtod.ptr, slots.ptr, nbytes, s),
                                          reps, timer)}
    dtod.free()
    gather_all()

    pool_rows = 4096
    acts_k = ActivationKernels(rt)
    max_rows = max(int(c.sum()) for c in counts_by_t.values())
    xbuf = rt.alloc(pool_rows * HIDDEN * 4)
    rt.memcpy_htod(xbuf.ptr, rng.standard_normal((pool_rows, HIDDEN), dtype=np.float32), s)
    idx = rt.alloc(max_rows * 4)
    rt.memcpy_htod(idx.ptr, (np.arange(max_rows) % pool_rows).astype(np.int32), s)
    abuf = {part: rt.alloc(fmt.activation.nbytes(max_rows, k))
            for part, (_, k) in PARTS.items()}
    out = rt.alloc(max_rows * max(m for m, _ in PARTS.values()) * 4)
    bounds = rt.alloc((EXPERTS + 1) * 4)
    for t, counts in counts_by_t.items():
        rows = int(counts.sum())
        b = np.zeros(EXPERTS + 1, np.int32)
        b[1:] = np.cumsum(counts)
        rt.memcpy_htod(bounds.ptr, b, s)
        for part, (_, k) in PARTS.items():
            acts_k.launch(fmt.activation, s, xbuf.ptr, HIDDEN, idx.ptr, abuf[part].ptr, rows, k)
        row: dict = {"rows": rows, "rows_min": int(counts.min()), "rows_max": int(counts.max())}
        for part, (m, k) in PARTS.items():
            img = lay.gate_up_image_bytes if part == "gate_up" else lay.down_image_bytes
            base = gu_buf.ptr if part == "gate_up" else dn_buf.ptr

            def launch_all(m=m, k=k, img=img, base=base, part=part, counts=counts) -> None:
                for g in range(n_groups):
                    ids = tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP))
                    kern.mmq(s, base + g * MMQ_GROUP * img, ids, abuf[part].ptr, bounds.ptr,
                             out.ptr, m, k, int(counts[list(ids)].max()))

            ms = median_ms(launch_all, reps, timer)
            row[part] = {"ms": ms, "tflops": tflops(rows, m, k, ms)}
        res["mmq"][t] = row
    s.synchronize()
    rt.close()
    return res


def table(res: dict) -> str:
    tq = res.get("torch", {})
    lines = []
    for label, r in res["strata"].items():
        name = r["format"]
        dense = tq.get(DENSE_KEY[name])
        lines.append(f"## {label} on {r['device']} ({r['arch']}), {r['blob_bytes']} bytes per "
                     f"expert; dense {'int8' if name == 'q2_blob' else 'fp16'} rate "
                     + (f"{dense:.0f}" if dense else "-"))
        lines.append("tokens | rows/expert min-max | part | ours ms / TFLOPS | ours / dense | "
                     "torch.bmm bf16 ms / TFLOPS | ours / bmm")
        for t, row in r["mmq"].items():
            for part in PARTS:
                ours = row[part]
                bmm = tq.get("bmm", {}).get(name, {}).get(t, {}).get(part)
                lines.append(
                    f"{t} | {row['rows_min']}-{row['rows_max']} | {part} | {ours['ms']:.3f} / "
                    f"{ours['tflops']:.0f} | "
                    + (f"{ours['tflops'] / dense:.2f}" if dense else "-") + " | "
                    + (f"{bmm['ms']:.3f} / {bmm['tflops']:.0f} | {bmm['ms'] / ours['ms']:.2f}x"
                       if bmm else "- | -"))
        g = r["gather"]
        gb = g["bytes"] / 1e9
        lines.append(f"gather one per expert: {g['ms']:.3f} ms = {gb / g['ms'] * 1e3:.0f} GB/s; "
                     f"DtoD {g['dtod_ms']:.3f} ms = {gb / g['dtod_ms'] * 1e3:.0f} GB/s")
    if tq:
        lines.append(f"dense torch.matmul fp16 8192^3: {tq['dense_fp16_tflops']:.0f} TFLOPS; "
                     f"torch._int_mm int8: {tq['dense_int8_tops']:.0f} TOPS ({tq['device']}, "
                     f"torch {tq['torch']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(every_variant()))
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    labels = [f for f in a.formats.split(",") if f]
    for label in labels:
        name, _, variant = label.partition(":")
        if name not in FORMATS:
            ap.error(f"unknown format {name!r}; valid: {', '.join(FORMATS)}")
        try:
            format_of(label)
        except FormatError as e:
            ap.error(str(e))
    names = list(dict.fromkeys(label.partition(":")[0] for label in labels))
    rng = np.random.default_rng(a.seed)
    blobs = {n: np.stack([FORMATS[n]().random_expert(rng, HIDDEN, FFN) for _ in range(UNIQUE)])
             for n in names}
    counts = {int(t): routing(rng, int(t)) for t in a.tokens.split(",")}
    res: dict = {"command": " ".join(sys.argv), "shapes": PARTS, "experts": EXPERTS,
                 "top_k": TOP_K}
    if not a.no_torch:
        res["torch"] = torch_phase(blobs, counts, a.reps)
    res["strata"] = {label: strata_phase(label, blobs[label.partition(":")[0]], counts, a.reps,
                                         rng) for label in labels}
    print(table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
