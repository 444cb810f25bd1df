"""Causal prefill attention: our kernels (kernels/model/attention.cu's mma.sync attend and,
on sm_90 devices, attention_sm90.cu's wgmma attend) against PyTorch's
scaled_dot_product_attention (flash and cuDNN backends, where torch is installed), in the same
process, on the Qwen3-30B-A3B (32 query heads, 4 KV heads) and Qwen3-235B-A22B (64 / 4) head
layouts, head dim 128.

    python bench/bench_attention.py [--rows 8192:0,32768:0,2048:6144] [--layouts 32x4,64x4]
        [--kernels mma,wgmma] [--peers flash,cudnn] [--reps 10] [--json PATH]

A row T:start attends T queries at positions start..start+T-1 over start+T cached positions
(start=6144 with T=2048 is a later chunk against an 8K cache). Ours: fp16 q/k/v, the cache
already filled, `attend` alone (and `qk_norm_rope` timed beside it); PyTorch: bf16, the named
backend forced (torch.nn.attention.sdpa_kernel), GQA through enable_gqa or, where that is
refused, K/V repeated to every query head outside the timing. For start > 0 PyTorch gets a
lower-right causal mask (torch.nn.attention.bias.causal_lower_right), the same mask as ours.
Each time is the median of `reps` timed launches after two warm-ups.

FLOPs: 4 * hd * n_heads * (T * start + T * T / 2) (q.k and p.v over the causal half; for
start = 0 the usual 2*2*T*T/2*hd*n_heads). Printed beside each time: TFLOPS, the share of the
device's dense fp16 tensor-core peak (PEAK_TFLOPS by device name), each kernel's speed over
the first kernel's, and each peer's time over ours (the issue asks wgmma >= cuDNN). Outputs are
compared with the first kernel's (NMSE).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.backends.cuda.attention.kernels import (  # noqa: E402
    AttentionKernels,
    wgmma_runs,
)
from strata_rt.formats.numerics import nmse  # noqa: E402

HD = 128
#: dense fp16 tensor-core peak by device name (SXM parts), TFLOPS
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_of(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops(T: int, start: int, n_heads: int) -> float:
    return 4.0 * HD * n_heads * (T * start + T * T / 2)


def make_inputs(T: int, start: int, n_heads: int, n_kv: int,
                seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = start + T
    return {"q": rng.standard_normal((T, n_heads, HD)).astype(np.float16),
            "k": rng.standard_normal((n, n_kv, HD)).astype(np.float16),
            "v": rng.standard_normal((n, n_kv, HD)).astype(np.float16),
            "qkv": rng.standard_normal((T, (n_heads + 2 * n_kv) * HD)).astype(np.float16)}


def bench_ours(rt, kernel: str, T: int, start: int, n_heads: int, n_kv: int, reps: int,
               x: dict[str, np.ndarray]) -> dict:
    s = rt.stream("bench attention")
    n = start + T
    kern = AttentionKernels(rt, n_heads, n_kv, HD, context=n, kernel=kernel)
    bufs = {}
    for name in ("q", "k", "v", "qkv"):
        bufs[name] = rt.alloc(x[name].nbytes)
        rt.memcpy_htod(bufs[name].ptr, x[name], s)
    out = rt.alloc(T * n_heads * HD * 2)
    q_tmp = rt.alloc(T * n_heads * HD * 2)
    k_tmp, v_tmp = rt.alloc(n * n_kv * HD * 2), rt.alloc(n * n_kv * HD * 2)
    norms = np.ones(HD, np.float32)
    tables = np.ones((n, HD // 2), np.float32)
    dn, dt = rt.alloc(norms.nbytes), rt.alloc(tables.nbytes)
    rt.memcpy_htod(dn.ptr, norms, s)
    rt.memcpy_htod(dt.ptr, tables, s)
    ev0, ev1 = rt.event("t0", timing=True), rt.event("t1", timing=True)

    def attend():
        kern.attend(s, bufs["q"].ptr, bufs["k"].ptr, bufs["v"].ptr, start, T, out.ptr)

    def norm_rope():
        kern.qk_norm_rope(s, bufs["qkv"].ptr, T, start, dn.ptr, dn.ptr, dt.ptr, dt.ptr,
                          1e-6, q_tmp.ptr, k_tmp.ptr, v_tmp.ptr)

    def timed(fn):
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            ev0.record(s)
            fn()
            ev1.record(s)
            times.append(ev0.elapsed_ms(ev1))
        return statistics.median(times)

    ms = timed(attend)
    ms_rope = timed(norm_rope)
    host = np.empty((T, n_heads * HD), np.float16)
    rt.memcpy_dtoh(host, out.ptr, s)
    s.synchronize()
    for b in (*bufs.values(), out, q_tmp, k_tmp, v_tmp, dn, dt):
        b.free()
    return {"ms": ms, "qk_norm_rope_ms": ms_rope, "out": host, "kernel": kern.kernel}


def bench_torch(backend: str, T: int, start: int, n_heads: int, n_kv: int, reps: int,
                x: dict[str, np.ndarray]) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    dev = torch.device("cuda")
    # [1, heads, L, hd] views of [1, L, heads, hd] storage, the layout the flash kernel reads
    q = torch.from_numpy(x["q"]).to(dev, torch.bfloat16)[None].transpose(1, 2)
    k = torch.from_numpy(x["k"]).to(dev, torch.bfloat16)[None].transpose(1, 2)
    v = torch.from_numpy(x["v"]).to(dev, torch.bfloat16)[None].transpose(1, 2)
    if start:
        from torch.nn.attention.bias import causal_lower_right
        mask_kw = {"attn_mask": causal_lower_right(T, start + T)}
    else:
        mask_kw = {"is_causal": True}

    def run_gqa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask_kw)

    kr = k.repeat_interleave(n_heads // n_kv, dim=1)
    vr = v.repeat_interleave(n_heads // n_kv, dim=1)

    def run_repeat():
        return F.scaled_dot_product_attention(q, kr, vr, **mask_kw)

    with sdpa_kernel(which):
        try:
            fn, gqa = run_gqa, "enable_gqa"
            fn()
        except (RuntimeError, TypeError):
            fn, gqa = run_repeat, "repeat_interleave"
            try:
                fn()
            except RuntimeError as e:  # the backend refused this shape or mask
                return {"ms": float("nan"), "gqa": f"refused: {str(e).splitlines()[0][:60]}",
                        "out": None}
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            e0.record()
            o = fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
    out = o.transpose(1, 2).reshape(T, n_heads * HD).float().cpu().numpy()
    return {"ms": statistics.median(times), "gqa": gqa, "out": out}


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8192:0,32768:0,2048:6144",
                    help="comma-separated T:start pairs")
    ap.add_argument("--layouts", default="32x4,64x4",
                    help="comma-separated query heads x KV heads (head dim 128)")
    ap.add_argument("--kernels", default="mma,wgmma",
                    help="our attend kernels (kernels.PREFILL_ATTENTIONS), the first the base; "
                         "one the device cannot run is left out with a note")
    ap.add_argument("--peers", default="flash,cudnn",
                    help="PyTorch SDPA backends timed beside ours where torch is installed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from strata_rt.runtime import Runtime

    rows = [tuple(int(v) for v in r.split(":")) for r in args.rows.split(",")]
    layouts = [tuple(int(v) for v in lay.split("x")) for lay in args.layouts.split(",")]
    rt = Runtime.open()
    kernels = [k for k in args.kernels.split(",")
               if k != "wgmma" or wgmma_runs(rt.arch, HD)]
    if len(kernels) < len(args.kernels.split(",")):
        print(f"note: the wgmma attend does not run on {rt.arch}: left out")
    tv = torch_version()
    peers = [p for p in args.peers.split(",") if p] if tv else []
    if not tv:
        print("note: torch with CUDA is not installed here: no PyTorch columns")
    peak = peak_of(rt.name)
    print(f"device {rt.name} ({rt.arch}); tensor-core peak "
          f"{f'{peak:.0f} TFLOPS' if peak else 'unknown'}; torch {tv or '-'}")
    results = []
    try:
        for nh, nkv in layouts:
            for T, start in rows:
                x = make_inputs(T, start, nh, nkv)
                f = flops(T, start, nh)
                base, mine = None, []
                for kernel in kernels:
                    r = bench_ours(rt, kernel, T, start, nh, nkv, args.reps, x)
                    base = base or r
                    rec = {"layout": f"{nh}x{nkv}", "T": T, "start": start, "kernel": kernel,
                           "ms": r["ms"], "tflops": f / r["ms"] / 1e9,
                           "of_peak": f / r["ms"] / 1e9 / peak if peak else None,
                           "speedup_vs_first": base["ms"] / r["ms"],
                           "nmse_vs_first": nmse(r["out"], base["out"]),
                           "qk_norm_rope_ms": r["qk_norm_rope_ms"], "device": rt.name}
                    results.append(rec)
                    mine.append(rec)
                    print(f"{nh}x{nkv} T={T:>6} start={start:>5} {kernel:>6}: {r['ms']:8.3f} ms "
                          f"{rec['tflops']:6.1f} TFLOPS"
                          + (f" ({rec['of_peak']:.0%} of peak)" if peak else "")
                          + f", x{rec['speedup_vs_first']:.2f} of {kernels[0]}, NMSE vs it "
                          f"{rec['nmse_vs_first']:.1e}")
                for peer in peers:
                    t = bench_torch(peer, T, start, nh, nkv, args.reps, x)
                    rec = {"layout": f"{nh}x{nkv}", "T": T, "start": start,
                           "kernel": f"torch-{peer}", "ms": t["ms"],
                           "tflops": f / t["ms"] / 1e9, "torch_gqa": t["gqa"], "torch": tv,
                           "ours_over_peer": {k["kernel"]: t["ms"] / k["ms"] for k in mine},
                           "device": rt.name}
                    results.append(rec)
                    print(f"{nh}x{nkv} T={T:>6} start={start:>5} torch-{peer}: {t['ms']:8.3f} ms "
                          f"{rec['tflops']:6.1f} TFLOPS ({t['gqa']}); ours / it: "
                          + ", ".join(f"{k} x{v:.2f}" for k, v in rec["ours_over_peer"].items()))
    finally:
        rt.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
