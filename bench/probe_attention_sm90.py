"""The wgmma attend's first GPU check (kernels/model/attention_sm90.cu): which build of its p.v
gives the float64 twin's result, then the two schedules' speed.

    python bench/probe_attention_sm90.py [--layouts 32x4,64x4] [--tokens 8192]

Why: p.v reads V MN-major (head dim contiguous) through a shared-memory descriptor whose two
byte offsets mean different strides for MN-major operands than for K-major ones; the source
sets the leading offset to the 16 KiB between 64-wide head-dim panels and the stride offset to
the 1024 bytes between 8-key groups. Two build switches give the other readings, so one run
on an sm_90 device settles it: ATTN_V_DESC_SWAP (the two offsets exchanged) and ATTN_PV_N64
(one 64-wide instruction per panel, where the leading offset is not used), alone and together.
Each build is compiled from a copy of the source with its #defines prepended, run on fresh
random inputs (T=300 queries after 5 cached positions, outputs poisoned) and compared with
attention_reference by NMSE (the bound the tests assert: 1e-5). The source as written should
pass; if only another build does, its switches are the fix to make in the source.
Then both schedules (two stages; three, pipelined) are timed at `--tokens` with the source
as written: TFLOPS over the causal half, as bench_attention.py counts them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.backends.cuda.attention import kernels as ak  # noqa: E402
from strata_rt.formats.numerics import nmse  # noqa: E402

BUILDS = {"as written": "", "ATTN_V_DESC_SWAP": "#define ATTN_V_DESC_SWAP\n",
          "ATTN_PV_N64": "#define ATTN_PV_N64\n",
          "ATTN_PV_N64 + ATTN_V_DESC_SWAP": "#define ATTN_PV_N64\n#define ATTN_V_DESC_SWAP\n"}
BOUND = 1e-5


def check(rt, source: Path, stages: int, layout: tuple[int, int]) -> float:
    """NMSE of the wgmma attend built from `source` against the float64 twin."""
    n_heads, n_kv = layout
    T, start, hd = 300, 5, 128
    ak.ATTENTION_SM90_SOURCE, ak.WGMMA_STAGES = source, stages
    kern = ak.AttentionKernels(rt, n_heads, n_kv, hd, context=start + T, kernel="wgmma")
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((T, n_heads, hd)) * 1.5).astype(np.float16)
    k = (rng.standard_normal((start + T, n_kv, hd)) * 1.5).astype(np.float16)
    v = rng.standard_normal((start + T, n_kv, hd)).astype(np.float16)
    s = rt.stream("probe")
    bufs = []
    for a in (q, k, v):
        b = rt.alloc(a.nbytes)
        rt.memcpy_htod(b.ptr, a, s)
        bufs.append(b)
    out = rt.alloc(q.nbytes)
    rt.memset_d8(out.ptr, 0xFF, q.nbytes, s)  # unwritten halves read as NaN
    kern.attend(s, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, start, T, out.ptr)
    got = np.empty((T, n_heads * hd), np.float16)
    rt.memcpy_dtoh(got, out.ptr, s)
    s.synchronize()
    for b in (*bufs, out):
        b.free()
    return float(nmse(got, ak.attention_reference(q, k, v, start)))


def timed(rt, stages: int, layout: tuple[int, int], T: int, reps: int = 5) -> float:
    """Median ms of the wgmma attend (source as written) over T queries from position 0."""
    n_heads, n_kv = layout
    hd = 128
    ak.WGMMA_STAGES = stages
    kern = ak.AttentionKernels(rt, n_heads, n_kv, hd, context=T, kernel="wgmma")
    rng = np.random.default_rng(0)
    s = rt.stream("probe timing")
    bufs = []
    for shape in ((T, n_heads, hd), (T, n_kv, hd), (T, n_kv, hd)):
        a = rng.standard_normal(shape).astype(np.float16)
        b = rt.alloc(a.nbytes)
        rt.memcpy_htod(b.ptr, a, s)
        bufs.append(b)
    out = rt.alloc(T * n_heads * hd * 2)
    e0, e1 = rt.event("t0", timing=True), rt.event("t1", timing=True)
    times = []
    for i in range(reps + 2):
        e0.record(s)
        kern.attend(s, bufs[0].ptr, bufs[1].ptr, bufs[2].ptr, 0, T, out.ptr)
        e1.record(s)
        s.synchronize()
        if i >= 2:
            times.append(e0.elapsed_ms(e1))
    for b in (*bufs, out):
        b.free()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="32x4,64x4", help="query heads x KV heads, head dim 128")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    from strata_rt.runtime import Runtime

    layouts = [tuple(int(v) for v in lay.split("x")) for lay in args.layouts.split(",")]
    written = ak.ATTENTION_SM90_SOURCE
    rt = Runtime.open()
    try:
        if not ak.wgmma_runs(rt.arch, 128):
            print(f"the wgmma attend does not run on {rt.arch}: nothing to probe")
            return 2
        text = written.read_text()
        with tempfile.TemporaryDirectory(dir=written.parent) as tmp:
            passing = []
            for i, (name, defines) in enumerate(BUILDS.items()):
                src = Path(tmp) / f"attention_sm90_build{i}.cu"
                src.write_text(defines + text)
                for stages in sorted(ak.WGMMA_NAMES):
                    try:
                        err = check(rt, src, stages, layouts[0])
                        ok = err <= BOUND
                        print(f"{name:>32}, {stages} stages: NMSE {err:.2e} "
                              f"({'ok' if ok else 'WRONG'})", flush=True)
                    except Exception as e:  # noqa: BLE001 - a build that fails is reported
                        ok = False
                        print(f"{name:>32}, {stages} stages: {type(e).__name__}: {e}", flush=True)
                    if ok and stages == max(ak.WGMMA_NAMES):
                        passing.append(name)
        ak.ATTENTION_SM90_SOURCE = written
        print("builds that pass:", ", ".join(passing) or "none")
        if "as written" not in passing:
            return 1
        for layout in layouts:
            flop = 4 * 128 * layout[0] * args.tokens * args.tokens / 2
            for stages in sorted(ak.WGMMA_NAMES):
                ms = timed(rt, stages, layout, args.tokens)
                print(f"{layout[0]}x{layout[1]} T={args.tokens} {stages} stages: {ms:.3f} ms "
                      f"{flop / ms / 1e9:.1f} TFLOPS", flush=True)
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
