"""Prefill benchmark on a GPU: strata_rt against its ceilings and two PyTorch peers, one process.

For each regime (streaming: a quarter of the experts resident; resident: all of them; cached:
all of them, with the image cache holding every group's images, `image_cache_mib: all`) and
each prompt length: our engine with batched gathers (A) and one gather per expert (B,
STRATA_PREFILL_GATHER_ONE=1), interleaved A, B, A, B; then the PyTorch peers (bench/peers) on
the same inputs, each twice, interleaved: the bmm arm (torch.bmm over per-expert batches padded
to the busiest expert) and the grouped arm (one torch._grouped_mm per product over the ragged
per-expert rows, sharing the bmm arm's weights; when torch cannot run it, its cells say n/a
and the reason is printed under the table). Ceilings measured in the same run: pinned
host-to-device GB/s (copies of 8 MiB and more), the int8 rate (torch._int_mm) and the bf16
rate (torch.mm) of large dense products. Ratios: PCIe achieved / ceiling, ours / each peer,
host time / wall, MoE TFLOPS / int8.

Times are host clocks around each whole prefill call (numpy in, numpy out, synchronised), after
a warm-up of every arm on every prompt (twice: the engine times plain launches against a
captured graph on its first two chunks of a size). Results: bench/results/prefill-<model>-<time>.{json,md}.

    python bench/bench_prefill.py                               # Qwen3-30B-A3B shape, 48 layers
    python bench/bench_prefill.py --model small --prompts 254,1030
    python bench/bench_prefill.py --layers 8 --prompts 1030,8179  # fewer layers, a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "peers")]

from torch_clock import cuda_seconds, pinned_h2d_gb_s  # noqa: E402

from strata_rt.cli.common import hardware_line, markdown_table  # noqa: E402
from strata_rt.cli.run import set_switch  # noqa: E402
from strata_rt.config.run.run_config import Prompt, validate  # noqa: E402
from strata_rt.engine import Engine  # noqa: E402
from strata_rt.formats.numerics import nmse  # noqa: E402
from strata_rt.runtime.memory import MIB  # noqa: E402
from strata_rt.weights.model import Model, MoESpec  # noqa: E402

MODELS = {
    "small": MoESpec(n_layers=4, hidden=512, ffn=256, n_experts=32, top_k=4),
    "qwen3-30b": MoESpec(n_layers=48, hidden=2048, ffn=768, n_experts=128, top_k=8),
}
SWITCH = "STRATA_PREFILL_GATHER_ONE"


def ceilings(torch) -> dict[str, float]:
    """Pinned H2D GB/s per copy size, and dense int8 / bf16 TFLOPS, timed with CUDA events."""
    out: dict[str, float] = {}

    def timed(fn, reps: int) -> float:
        return cuda_seconds(torch, fn, reps)

    rates = pinned_h2d_gb_s(torch, {f"{mib}mib": mib * MIB for mib in (2, 8, 64, 256)})
    out.update({f"h2d_{label}_gb_s": v for label, v in rates.items()})
    out["h2d_gb_s"] = max(v for k, v in out.items() if not k.startswith("h2d_2mib"))
    n = 8192
    a = torch.randint(-127, 127, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 127, (n, n), dtype=torch.int8, device="cuda")
    out["int8_tops"] = 2 * n ** 3 / timed(lambda: torch._int_mm(a, b.t()), 10) / 1e12
    x = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    out["bf16_tflops"] = 2 * n ** 3 / timed(lambda: x @ x, 10) / 1e12
    return out


def update_nmse(a: np.ndarray, b: np.ndarray, h: np.ndarray) -> float:
    """Of the MoE update (output minus input), so the residual does not hide differences."""
    return nmse(a.astype(np.float64) - h, b.astype(np.float64) - h)


def run_ours(model: Model, regime: str, prompts, inputs, args) -> tuple[dict, dict]:
    spec = model.spec
    doc = {"model": {"synthetic": {k: getattr(spec, k) for k in (
               "n_layers", "hidden", "ffn", "n_experts", "top_k")}},
           "format": spec.format, "backend": "cuda",
           "prefill": args.prefill if args.prefill == "auto" else int(args.prefill),
           "expert_cache": spec.total_experts // (4 if regime == "streaming" else 1),
           "prompts": [p.tokens for p in prompts], "ring_mib": args.ring_mib}
    if regime == "cached":
        doc["image_cache_mib"] = "all"
    ecfg = validate(doc, ROOT).engine_config(backend="cuda")
    ecfg.model = model  # the peer reads the same Model object
    rows: dict[int, dict] = {}
    with Engine.open(ecfg) as engine:
        mask = engine.residency.mask()

        def once(h, value: str):
            set_switch(engine, SWITCH, value)
            t0 = time.perf_counter()
            out, stats = engine.prefill(h)
            return out, stats, time.perf_counter() - t0

        # every prompt, both arms, twice: module compile, first allocations and the engine's
        # two trials per chunk size (plain launches, then graph capture) stay out of the timing
        for h in inputs:
            for value in ("0", "1"):
                for _ in range(2):
                    once(h, value)
        for p, h in zip(prompts, inputs):
            r = rows[p.tokens] = {"A_s": [], "B_s": [], "A_stats": [], "B_stats": []}
            for _ in range(args.pairs):
                for arm, value in (("A", "0"), ("B", "1")):
                    out, stats, wall = once(h, value)
                    r[f"{arm}_s"].append(wall)
                    r[f"{arm}_stats"].append(stats.as_dict())
            r["out"] = out
            launched = r["A_stats"][-1]["gathers_launched"]
            if launched and launched == r["B_stats"][-1]["gathers_launched"]:
                print(f"WARNING: {regime} {p.tokens}: A and B launched the same number of "
                      "gathers; the backend did not take the switch between prefills",
                      file=sys.stderr)
            print(f"ours {regime} {p.tokens}: A {[round(t * 1e3, 1) for t in r['A_s']]} ms, "
                  f"B {[round(t * 1e3, 1) for t in r['B_s']]} ms", file=sys.stderr)
    return rows, {"resident_mask": mask, "resident": int(mask.sum())}


def run_peers(model: Model, regime: str, prompts, inputs, mask, ours, torch) -> tuple[dict, dict]:
    """Both PyTorch peers on the same inputs: the bmm arm (torch_moe) and the grouped-GEMM arm
    (torch_grouped) over the bmm arm's weights (one copy in VRAM). Every arm is warmed up on
    every prompt, then timed twice per prompt, interleaved. Returns per-prompt times and
    NMSEs, and what the grouped arm ran (its path, or why it could not run)."""
    from torch_grouped import GroupedMMUnavailable, GroupedMoE
    from torch_moe import TorchMoE

    spec = model.spec
    bmm = TorchMoE(router=model.router, norm=model.norm,
                   blobs=lambda layer: np.stack([model.expert_blob(layer, e)
                                                 for e in range(spec.n_experts)]),
                   hidden=spec.hidden, ffn=spec.ffn, top_k=spec.top_k, rms_eps=spec.rms_eps,
                   regime="streamed" if regime == "streaming" else "resident",
                   resident=mask)
    arms = {"bmm": bmm}
    info: dict = {}
    try:
        arms["grouped"] = GroupedMoE.alongside(bmm)
        info["grouped_path"] = arms["grouped"].path
    except GroupedMMUnavailable as e:
        info["grouped_unavailable"] = str(e)
        print(f"grouped peer not run ({regime}): {e}", file=sys.stderr)

    def once(arm, h):
        t0 = time.perf_counter()
        out = arm.prefill(h).cpu().numpy()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    for h in inputs:
        for arm in arms.values():
            once(arm, h)
    res: dict[int, dict] = {}
    for p, h in zip(prompts, inputs):
        r = res[p.tokens] = {f"{name}_s": [] for name in arms}
        outs = {}
        for _ in range(2):
            for name, arm in arms.items():
                outs[name], wall = once(arm, h)
                r[f"{name}_s"].append(wall)
        for name, out in outs.items():
            r[f"{name}_nmse_vs_ours"] = update_nmse(out, ours[p.tokens]["out"], h)
        if "grouped" in outs:
            r["grouped_nmse_vs_bmm"] = update_nmse(outs["grouped"], outs["bmm"], h)
        print(f"peers {regime} {p.tokens}: " + ", ".join(
            f"{name} {[round(t * 1e3, 1) for t in r[f'{name}_s']]} ms" for name in arms),
            file=sys.stderr)
    return res, info


def ms_list(times: list[float] | None) -> str:
    return ", ".join(f"{t * 1e3:.1f}" for t in times) if times else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b")
    ap.add_argument("--layers", type=int, help="cut the model to this many layers")
    ap.add_argument("--prompts", default="254,1030,3866,8179,30118")
    ap.add_argument("--regimes", default="streaming,resident,cached")
    ap.add_argument("--pairs", type=int, default=2, help="A, B pairs per prompt")
    ap.add_argument("--ring-mib", type=float, default=512)
    ap.add_argument("--prefill", default="auto",
                    help="chunk size in tokens, or auto (the config key `prefill`)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()

    import torch

    spec = MODELS[args.model]
    if args.layers:
        spec = replace(spec, n_layers=args.layers)
    lengths = [int(x) for x in args.prompts.split(",")]
    prompts = [Prompt(i, n) for i, n in enumerate(lengths)]
    inputs = [p.hidden_states(spec.hidden, args.seed) for p in prompts]  # distinct per prompt
    t0 = time.perf_counter()
    model = Model.synthetic(spec, seed=1)
    print(f"model {spec} built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    hw = (f"{hardware_line()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"{torch.cuda.get_device_name()}")
    ceil = ceilings(torch)
    torch.cuda.empty_cache()  # the ceiling buffers are gone with the call
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in ceil.items()})}", file=sys.stderr)

    flops_per_token = spec.top_k * spec.n_layers * 6 * spec.hidden * spec.ffn
    table, records, peer_lines = [], [], []
    peers_by_residency: dict[str, tuple[dict, dict]] = {}
    for regime in args.regimes.split(","):
        if regime not in ("streaming", "resident", "cached"):
            raise SystemExit(f"--regimes: unknown regime {regime!r} (streaming, resident, "
                             "cached)")
        ours, info = run_ours(model, regime, prompts, inputs, args)
        # cached and resident hold the same experts: the peers run once for both
        residency = "streaming" if regime == "streaming" else "resident"
        if not args.no_peer and residency not in peers_by_residency:
            peers_by_residency[residency] = run_peers(
                model, regime, prompts, inputs, info["resident_mask"], ours, torch)
        peer, pinfo = peers_by_residency.get(residency, ({}, {}))
        torch.cuda.empty_cache()  # the peers' weights are gone with the call
        if "grouped_unavailable" in pinfo:
            peer_lines.append(f"{regime}: grouped peer not run: {pinfo['grouped_unavailable']}")
        elif "grouped_path" in pinfo:
            peer_lines.append(f"{regime}: grouped peer ran {pinfo['grouped_path']}")
        for p in prompts:
            r = ours[p.tokens]
            a, b = statistics.median(r["A_s"]), statistics.median(r["B_s"])
            st = r["A_stats"][-1]
            gbps = st["bytes_streamed"] / a / 1e9
            host = statistics.median(s["host_s"] / s["wall_s"] for s in r["A_stats"])
            tflops = flops_per_token * p.tokens / a / 1e12
            pr = peer.get(p.tokens, {})
            ratio = {arm: statistics.median(pr[f"{arm}_s"]) / a if f"{arm}_s" in pr else None
                     for arm in ("bmm", "grouped")}
            rec = {"regime": regime, "tokens": p.tokens, "a_s": r["A_s"], "b_s": r["B_s"],
                   "a_median_s": a, "b_median_s": b, "change_pct": (b - a) / a * 100,
                   "tokens_per_s": p.tokens / a, "bytes_streamed": st["bytes_streamed"],
                   "experts_streamed": st["experts_streamed"],
                   "gathers_launched": {"A": st["gathers_launched"],
                                        "B": r["B_stats"][-1]["gathers_launched"]},
                   "pcie_gb_s": gbps, "pcie_over_ceiling": gbps / ceil["h2d_gb_s"],
                   "host_over_wall": host, "moe_tflops": tflops,
                   "tflops_over_int8": tflops / ceil["int8_tops"],
                   "peer_s": pr.get("bmm_s"),
                   "ours_speedup_over_peer": ratio["bmm"],
                   "nmse_vs_peer": pr.get("bmm_nmse_vs_ours"),
                   "grouped_s": pr.get("grouped_s"),
                   "ours_speedup_over_grouped": ratio["grouped"],
                   "nmse_vs_grouped": pr.get("grouped_nmse_vs_ours"),
                   "nmse_grouped_vs_bmm": pr.get("grouped_nmse_vs_bmm"),
                   "grouped_path": pinfo.get("grouped_path"),
                   "grouped_unavailable": pinfo.get("grouped_unavailable"),
                   "resident_experts": info["resident"]}
            records.append(rec)
            grouped_cells = (["n/a", "n/a"] if "grouped_unavailable" in pinfo else
                             [ms_list(pr.get("grouped_s")),
                              f"{ratio['grouped']:.2f}x" if ratio["grouped"] else "-"])
            table.append([
                regime, p.tokens, ms_list(r["A_s"]), ms_list(r["B_s"]),
                f"{rec['change_pct']:+.1f}", f"{p.tokens / a:,.0f}",
                ms_list(pr.get("bmm_s")), f"{ratio['bmm']:.2f}x" if ratio["bmm"] else "-",
                *grouped_cells,
                f"{gbps:.1f} ({rec['pcie_over_ceiling']:.0%})" if st["bytes_streamed"] else "-",
                f"{host:.0%}", f"{tflops:.0f} ({rec['tflops_over_int8']:.0%})"])
            if pr:
                print(f"ratios {regime} {p.tokens}: ours / bmm peer "
                      + (f"{ratio['bmm']:.2f}x" if ratio["bmm"] else "-")
                      + ", ours / grouped peer "
                      + (f"{ratio['grouped']:.2f}x" if ratio["grouped"] else "n/a"),
                      file=sys.stderr)

    headers = ["regime", "prompt tokens", "A ms (batched)", "B ms (gather one)", "B vs A %",
               "tokens/s (A)", "bmm peer ms", "ours / bmm", "grouped peer ms",
               "ours / grouped", "PCIe GB/s (of ceiling)", "host / wall",
               "MoE TFLOPS (of int8)"]
    md_table = markdown_table(headers, table)
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    md = "\n".join([
        f"# Prefill benchmark: {args.model}" + (f", {spec.n_layers} layers" if args.layers
                                               else ""),
        "", f"command: `{command}`", f"hardware: {hw}",
        f"model: {spec}; streaming regime = a quarter of the experts resident, ring "
        f"{args.ring_mib:g} MiB; resident = all; cached = all, with every group's images "
        "kept on the device (image_cache_mib: all)", "",
        "ceilings (same run): " + ", ".join(
            f"{k} {v:.1f}" for k, v in ceil.items()), "",
        md_table, "", *peer_lines, "",
        "Times: host clock around each whole prefill call (numpy in and out), after warm-up "
        "runs of each arm on each prompt (ours twice, each peer once); "
        "A = batched gathers, B = STRATA_PREFILL_GATHER_ONE=1, run A, B, A, B. Peers "
        "(bench/peers, same IQ3_XXS blocks, torch.compile'd dequantization to bf16): bmm = "
        "torch.bmm over batches padded to the busiest expert, grouped = one torch._grouped_mm "
        "per product over the ragged per-expert rows; both run twice per prompt, interleaved. "
        "ours / X = X's median over our median A. PCIe GB/s = bytes streamed / our median A time. "
        "host / wall = engine host time over wall time. MoE TFLOPS counts "
        "top_k x 3 matrices x 2 x hidden x ffn per token per layer, against torch._int_mm.",
    ])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"prefill-{args.model}-{stamp}"
    base.with_suffix(".md").write_text(md + "\n")
    base.with_suffix(".json").write_text(json.dumps(
        {"command": command, "hardware": hw, "model": asdict(spec), "ceilings": ceil,
         "rows": records}, indent=2, default=str) + "\n")
    print(md)
    print(f"wrote {base}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
