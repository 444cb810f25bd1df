"""Dense projections and the output head of Qwen3-MoE shapes: strata_rt's dense GEMM against
bf16 torch.matmul on the same shapes, in the same process.

    python bench/bench_dense.py [--tokens 512,2048,8192] [--head-tokens 1,8192]
                                [--impls cublas,own] [--reps 10] [--no-torch] [--json PATH]

Cases per model shape (Qwen3-30B-A3B: hidden 2048, q_dim 4096, kv_dim 512; Qwen3-235B-A22B:
hidden 4096, q_dim 8192, kv_dim 512) and chunk of T tokens:
  qkv   fp16 [T, hidden] . Wqkv^T, Wqkv [q_dim + 2 kv_dim, hidden] -> fp16 (as a layer runs it)
  o     fp16 [T, q_dim] . Wo^T, Wo [hidden, q_dim], added into the fp32 residual
  head  fp16 [T, hidden] . Wout^T, Wout [151936, hidden] -> fp32 logits (T = 1: the last
        position; T = 8192: every position)
Ours runs through DenseKernels (each --impls: "cublas" = cublasGemmEx, "own" = the
batch-invariant grouped fp16 GEMM); torch runs torch.matmul(a, w.t(), out=...) in bf16 with a
bf16 output. Time per call: CUDA events around `inner` back-to-back calls (enough for ~2 ms),
median of --reps after 2 warm-ups. TFLOPS = 2 T n k / time; ratio = torch time / our time
(the issue's target: >= 0.80).

torch runs first in its own (primary) context and frees its memory before the strata_rt
Runtime opens; torch is imported only here, never by strata_rt.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from mmq_common import median_ms, runtime_event_timer, tflops, torch_event_timer  # noqa: E402

from strata_rt.backends.cuda.dense.kernels import GEMM_IMPLS, DenseKernels, workspace_bytes  # noqa: E402

#: name -> (hidden, q_dim, kv_dim)
MODELS = {"30b": (2048, 4096, 512), "235b": (4096, 8192, 512)}
VOCAB = 151936
#: GPU time one timed sample aims for (short GEMMs repeat inside it so launch gaps vanish)
SAMPLE_MS = 2.0


def cases(tokens: list[int], head_tokens: list[int]) -> list[dict]:
    """Every GEMM timed: name, model, T, n (outputs per row), k, out ('f16', 'f32+=' or
    'f32')."""
    out = []
    for model, (hidden, q_dim, kv_dim) in MODELS.items():
        for t in tokens:
            out.append(dict(name="qkv", model=model, T=t, n=q_dim + 2 * kv_dim, k=hidden,
                            out="f16"))
            out.append(dict(name="o", model=model, T=t, n=hidden, k=q_dim, out="f32+="))
        for t in head_tokens:
            out.append(dict(name="head", model=model, T=t, n=VOCAB, k=hidden, out="f32"))
    return out


def _inner(once_ms: float) -> int:
    return max(1, min(200, int(SAMPLE_MS / max(once_ms, 1e-3))))


def _time(run, reps: int, timer) -> float:
    """ms per call: one timed call sizes the loop, then the median of loops of `inner`."""
    run()
    n = _inner(timer(run))

    def loop() -> None:
        for _ in range(n):
            run()

    return median_ms(loop, reps, timer) / n


# ------------------------------------------------------------------------------ torch side
def torch_phase(all_cases: list[dict], reps: int) -> dict:
    import torch

    dev = torch.device("cuda")
    timer = torch_event_timer(torch)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "ms": {}}
    for c in all_cases:
        a = torch.randn(c["T"], c["k"], device=dev, dtype=torch.bfloat16)
        w = torch.randn(c["n"], c["k"], device=dev, dtype=torch.bfloat16)
        out = torch.empty(c["T"], c["n"], device=dev, dtype=torch.bfloat16)
        wt = w.t()
        res["ms"][_key(c)] = _time(lambda a=a, wt=wt, out=out: torch.matmul(a, wt, out=out),
                                   reps, timer)
        del a, w, out, wt
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------ ours
def strata_phase(all_cases: list[dict], impls: list[str], reps: int,
                 rng: np.random.Generator) -> dict:
    from strata_rt.runtime import Runtime

    res: dict[str, Any] = {"ms": {impl: {} for impl in impls}}
    with Runtime.open() as rt:
        res["device"] = rt.name
        s = rt.stream("bench")
        timer = runtime_event_timer(rt, s)
        # the own GEMM's scratch holds the outputs that are not written directly (fp32 =)
        scratch = max((c["T"] * c["n"] for c in all_cases if c["out"] != "f32"), default=1)
        host: dict[tuple[int, int], np.ndarray] = {}

        def operand(rows: int, k: int, scale: float) -> np.ndarray:
            if (rows, k) not in host:  # one random matrix per shape, reused by every case
                host[rows, k] = (rng.standard_normal((rows, k), np.float32) * scale).astype(
                    np.float16)
            return host[rows, k]

        for impl in impls:
            ws = rt.alloc(workspace_bytes(impl, 1, scratch))
            dk = DenseKernels(rt, ws.ptr, ws.nbytes, gemm_impl=impl)
            if dk.cublas is not None:
                res["cublas"] = ".".join(map(str, dk.cublas.version))
            for c in all_cases:
                T, n, k = c["T"], c["n"], c["k"]
                x = rt.alloc(T * k * 2)
                w = rt.alloc(n * k * 2)
                out = rt.alloc(T * n * (2 if c["out"] == "f16" else 4))
                # content does not change the speed of a GEMM; finite values keep it honest
                rt.memcpy_htod(x.ptr, operand(T, k, 1.0), s)
                rt.memcpy_htod(w.ptr, operand(n, k, 0.02), s)
                rt.memset_d8(out.ptr, 0, out.nbytes, s)
                f32, acc = c["out"] != "f16", c["out"] == "f32+="
                run = functools.partial(dk.gemm, s, x.ptr, w.ptr, out.ptr, T, n, k, f32, acc)
                res["ms"][impl][_key(c)] = _time(run, reps, timer)
                s.synchronize()
                for b in (x, w, out):
                    b.free()
            s.synchronize()
            ws.free()
    return res


def _key(c: dict) -> str:
    return f"{c['model']}/{c['name']}/T={c['T']}"


def table(all_cases: list[dict], res: dict, impls: list[str]) -> str:
    lines = [f"device: {res['strata']['device']}   cuBLAS {res['strata'].get('cublas', '-')}"
             + (f"   torch {res['torch']['torch']}" if "torch" in res else "")]
    head = f"{'case':<22} {'n x k':>13}"
    for impl in impls:
        head += f" {impl + ' ms':>11} {'TFLOPS':>7}"
    if "torch" in res:
        head += f" {'torch ms':>9} {'TFLOPS':>7}" + "".join(f" {'ratio ' + i:>12}" for i in impls)
    lines.append(head)
    for c in all_cases:
        key = _key(c)
        row = f"{key:<22} {str(c['n']) + ' x ' + str(c['k']):>13}"
        for impl in impls:
            ms = res["strata"]["ms"][impl][key]
            row += f" {ms:>11.4f} {tflops(c['T'], c['n'], c['k'], ms):>7.1f}"
        if "torch" in res:
            tms = res["torch"]["ms"][key]
            row += f" {tms:>9.4f} {tflops(c['T'], c['n'], c['k'], tms):>7.1f}"
            row += "".join(f" {tms / res['strata']['ms'][i][key]:>12.2f}" for i in impls)
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--head-tokens", default="1,8192")
    ap.add_argument("--impls", default=",".join(GEMM_IMPLS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    impls = [i for i in a.impls.split(",") if i]
    bad = [i for i in impls if i not in GEMM_IMPLS]
    if bad or not impls:
        ap.error(f"unknown implementations {bad}; valid: {', '.join(GEMM_IMPLS)}")
    all_cases = cases([int(t) for t in a.tokens.split(",") if t],
                      [int(t) for t in a.head_tokens.split(",") if t])
    res: dict[str, Any] = {"command": " ".join(sys.argv), "cases": all_cases}
    if not a.no_torch:
        res["torch"] = torch_phase(all_cases, a.reps)
    res["strata"] = strata_phase(all_cases, impls, a.reps, np.random.default_rng(a.seed))
    print(table(all_cases, res, impls))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
