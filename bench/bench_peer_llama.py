"""strata_rt against llama.cpp on the same GGUF files: time to first token and decode speed,
with a quarter of the experts resident and with all of them on the GPU.

One command does it all, file by file:

1. Writes the file once into --dir (kept and reused; written under a temporary name and
   renamed, so a file cut short is never reused), Qwen3-30B-A3B-shaped (the dims of --config,
   48 layers, 128 experts, vocabulary 151,936) with a full tokenizer section so llama.cpp
   loads it:
     iq3    the config's own synthetic model: IQ3_XXS experts, F16 dense (13.2 GiB)
     q4km   the Q4_K_M mix llama-quantize writes for qwen3moe, seeded random blocks (17.3 GiB);
            the rule is in bench/peer_llama/mixes.py
2. Runs llama.cpp's llama-bench (--llama-bench PATH) on it, each command under --timeout:
     prefill  -ngl 99 -lm none -fa 1 -ncmoe N -p 254,1030,3866,8179 -n 0 -b 8192
              -ub 512,2048,8192 -r REPS -o json, and per longer prompt -p 30118 -b 30720 -ub 8192
     decode   -ngl 99 -lm none -fa 1 -ncmoe N -p 0 -n 32 -r REPS -o json
   with N = 36 (3/4 of the layers' experts in host memory) and N = 0 (all on the GPU); the
   best micro-batch of each prompt length is kept, time to first token = n_prompt / tok/s.
3. Runs strata_rt on the same file, in a child process per regime: the config's settings
   (context 32768, prefill chunk 8192, ring 512 MiB) with expert_cache n_layers x n_experts
   / 4 (quarter) or all; warm-ups and timed prefills as bench_whole.py times them, then
   greedy decode steps as bench_decode.py times them.
4. Prints and writes <out>/peer-llama-<file>-<date>.{json,md}: time to first token per
   prompt length in both regimes with the ratio llama.cpp ms / strata ms (> 1: strata
   faster), decode tokens/s with strata / llama.cpp, and what strata streamed over PCIe.
   A command that fails or times out is a `failed: why` cell, never a traceback.

    python bench/bench_peer_llama.py --llama-bench path/to/llama-bench
    python bench/bench_peer_llama.py --dry-run                  # the plan and commands only
    python bench/bench_peer_llama.py --files q4km --regimes quarter --prompts 8179 \\
        --llama-bench path/to/llama-bench
    python bench/bench_peer_llama.py --shape tiny --backend reference --skip-llama  # CPU check

The 30B files take 30.5 GiB in --dir; writing them takes a few minutes, once (about 2.5 min
on two cores, 4.4 GB of memory at most).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from peer_llama import llama, report  # noqa: E402
from peer_llama.files import Shape, ensure_file, shape_of  # noqa: E402
from peer_llama.mixes import MIXES  # noqa: E402
from peer_llama.strata import REGIMES, regime_doc, run_child, run_job  # noqa: E402

DEFAULT_PROMPTS = (254, 1030, 3866, 8179, 30118)
DESCRIPTIONS = {"iq3": "IQ3_XXS experts, F16 dense: the synthetic model of the config",
                "q4km": "the Q4_K_M mix of llama-quantize (Q4_K, Q6_K on the head, on attn_v "
                        "and ffn_down_exps of half the layers), seeded random blocks"}


def _list(text: str, what: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x for x in text.replace(" ", "").split(",") if x]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"{what}: got {text!r}" + (f"; allowed: {', '.join(allowed)}" if allowed else ""))
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split(
        "\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", metavar="PATH",
                    help="llama.cpp's llama-bench program (needed unless --skip-llama)")
    ap.add_argument("--files", default=",".join(MIXES),
                    help=f"comma-separated files to run, of {', '.join(MIXES)} (default both)")
    ap.add_argument("--prompts", default=",".join(map(str, DEFAULT_PROMPTS)),
                    help="comma-separated prompt lengths (default %(default)s)")
    ap.add_argument("--regimes", default=",".join(REGIMES),
                    help="quarter (1/4 of the experts resident; llama.cpp -ncmoe 3/4 of the "
                         "layers), all (every expert on the GPU; -ncmoe 0) (default both)")
    ap.add_argument("--all-max-tokens", type=int, default=8192, metavar="N",
                    help="the `all` regime skips prompts longer than this (default %(default)s)")
    ap.add_argument("--skip-llama", action="store_true", help="run strata_rt only")
    ap.add_argument("--skip-strata", action="store_true", help="run llama-bench only")
    ap.add_argument("--reps", type=int, default=2,
                    help="timed runs per prompt, both programs (llama-bench -r) (default 2)")
    ap.add_argument("--warmups", type=int, default=3,
                    help="strata_rt's untimed runs per prompt first (default 3: a short prompt "
                         "with a quarter resident settles on its fourth run - the walk that "
                         "measures its routing, the routed walk's plain run, its capture)")
    ap.add_argument("--decode-steps", type=int, default=32,
                    help="greedy tokens timed (llama-bench -n) (default 32; 0: no decode)")
    ap.add_argument("--decode-prompt", type=int, default=16,
                    help="strata_rt's prompt before decoding (llama-bench's starts from an "
                         "empty context) (default 16)")
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "strata_rt" /
                    "peer-llama", help="where the GGUF files are written and kept (default "
                                       "~/.cache/strata_rt/peer-llama)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results",
                    help="folder of the results (default bench/results)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds each llama-bench command and each strata_rt regime may take "
                         "(default %(default)s)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen3-30b-a3b-whole.yaml",
                    help="the base run config: the files' dims and strata_rt's settings "
                         "(default configs/qwen3-30b-a3b-whole.yaml)")
    ap.add_argument("--backend", help="strata_rt backend instead of the config's (reference: "
                                      "on the CPU)")
    ap.add_argument("--shape", choices=("full", "tiny"), default="full",
                    help="tiny: a 2-layer model of the same kind, to check the pipeline")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and the exact commands; write and run nothing")
    ap.add_argument("--strata-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.file_list = _list(args.files, "--files", MIXES)
        args.regime_list = _list(args.regimes, "--regimes", REGIMES)
        args.prompt_list = [int(x) for x in _list(args.prompts, "--prompts")]
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    if any(p < 1 for p in args.prompt_list) or args.reps < 1 or args.warmups < 0 \
            or args.decode_steps < 0 or args.decode_prompt < 1 or args.timeout <= 0:
        ap.error("prompts, --reps and --decode-prompt must be >= 1, --warmups and "
                 "--decode-steps >= 0, --timeout > 0")
    if not (args.skip_llama or args.dry_run or args.strata_child or args.llama_bench):
        ap.error("give --llama-bench PATH (llama.cpp's built llama-bench), or --skip-llama")
    return args


def regime_prompts(args: argparse.Namespace, regime: str, context: int) -> list[int]:
    """The prompt lengths a regime runs: those the KV cache holds (with the first generated
    token); `all` also at most --all-max-tokens."""
    cap = context - 1 if regime == "quarter" else min(context - 1, args.all_max_tokens)
    return [p for p in args.prompt_list if p <= cap]


def llama_plan(args: argparse.Namespace, exe: str, path: Path, regime: str, prompts: list[int],
               n_layers: int) -> list[tuple[list[str], list[int]]]:
    """(command, the prompt lengths it measures; [] for decode) of one regime."""
    n = llama.n_cpu_moe(regime, n_layers)
    cmds = []
    for cmd in llama.prefill_commands(exe, path, n, prompts, args.reps):
        covered = [int(x) for x in cmd[cmd.index("-p") + 1].split(",")]
        cmds.append((cmd, covered))
    if args.decode_steps:
        cmds.append((llama.decode_command(exe, path, n, args.decode_steps, args.reps), []))
    return cmds


def run_llama(args: argparse.Namespace, plan: list[tuple[list[str], list[int]]]
              ) -> dict[str, Any]:
    res: dict[str, Any] = {"prefill": {}, "errors": {}, "decode": None, "decode_error": None,
                           "invocations": []}
    for cmd, covered in plan:
        inv = llama.run(cmd, args.timeout)
        rec = inv.to_json()
        rec["command"] = llama.shown(cmd)
        res["invocations"].append(rec)
        if covered:
            for n, best in llama.best_prefill(inv.records).items():
                res["prefill"][n] = {"ms": best.ms, "tokens_per_s": best.tokens_per_s,
                                     "n_ubatch": best.n_ubatch, "stddev_ts": best.stddev_ts,
                                     "by_ubatch": best.by_ubatch}
            for n in covered:
                if n not in res["prefill"]:
                    res["errors"][n] = inv.error or "no result for this length"
        else:
            res["decode"] = llama.decode_rate(inv.records)
            if res["decode"] is None:
                res["decode_error"] = inv.error or "no generation result"
    return res


def build_info(llama_res: dict[str, Any]) -> str | None:
    for inv in llama_res.get("invocations", []):
        for rec in inv["records"]:
            return (f"llama.cpp build {rec.get('build_commit', '?')} "
                    f"({rec.get('build_number', '?')}), {rec.get('gpu_info', '?')}, backends "
                    f"{rec.get('backends', '?')}")
    return None


def print_plan(args: argparse.Namespace, shape: Shape, context: int) -> None:
    exe = args.llama_bench or "llama-bench"
    spec = shape.spec
    print(f"shape {shape.name}: {spec.n_layers} layers, hidden {spec.hidden}, ffn {spec.ffn}, "
          f"{spec.n_experts} experts (top-{spec.top_k}), {spec.n_heads} query heads, "
          f"{spec.n_kv_heads} KV heads of {spec.head_dim}, vocabulary {spec.vocab:,}, context "
          f"{spec.context:,}; seed {shape.seed}; KV cache {context:,} positions")
    for mix in args.file_list:
        path = args.dir / shape.file_name(mix)
        state = "present (reused if complete)" if path.is_file() else "to be written"
        print(f"\nfile {mix}: {path} ({shape.data_bytes(mix) / 2**30:,.2f} GiB of tensors, "
              f"{state}); {DESCRIPTIONS[mix]}")
        for regime in args.regime_list:
            prompts = regime_prompts(args, regime, context)
            print(f"  regime {regime}: prompts {prompts}")
            if not args.skip_llama:
                for cmd, _ in llama_plan(args, exe, path, regime, prompts, spec.n_layers):
                    print("    $ " + " ".join(cmd))
            if not args.skip_strata:
                doc = regime_doc(args.config, path, regime, prompts, args.backend,
                                 spec.n_layers, spec.n_experts)
                print(f"    strata_rt config: {json.dumps(doc)}; {args.warmups} warm-ups, "
                      f"{args.reps} timed runs per prompt, decode {args.decode_steps} steps "
                      f"after {args.decode_prompt} tokens")
    stamp = "<date>"
    print(f"\nresults: {args.out}/peer-llama-<file>-{stamp}.{{json,md}}")


def run_file(args: argparse.Namespace, shape: Shape, mix: str, context: int, hardware: str,
             stamp: str) -> bool:
    """One file's runs, tables and results -> whether every part ran."""
    from strata_rt.cli.common import write_json

    n_layers = shape.spec.n_layers
    try:
        written = ensure_file(args.dir, shape, mix)
    except Exception as e:  # no space, no permission: reported, the next file still runs
        print(f"file {mix}: cannot write it: {type(e).__name__}: {e}", flush=True)
        return False
    ok = True
    regimes: dict[str, dict[str, Any]] = {}
    commands: list[str] = []
    configs: dict[str, Any] = {}
    for regime in args.regime_list:
        prompts = regime_prompts(args, regime, context)
        reg: dict[str, Any] = {"prompts": prompts, "strata": None, "llama": None,
                               "n_cpu_moe": llama.n_cpu_moe(regime, n_layers)}
        if not args.skip_llama:
            plan = llama_plan(args, args.llama_bench, written.path, regime, prompts, n_layers)
            commands += [llama.shown(c) for c, _ in plan]
            reg["llama"] = run_llama(args, plan)
            ok &= not reg["llama"]["errors"] and not reg["llama"]["decode_error"]
        regimes[regime] = reg
    scratch = tempfile.mkdtemp(prefix="strata-peer-")  # the children's results
    for regime in args.regime_list if not args.skip_strata else ():
        reg = regimes[regime]
        job = {"file": str(written.path), "regime": regime, "prompts": reg["prompts"],
               "reps": args.reps, "warmups": args.warmups, "decode_steps": args.decode_steps,
               "decode_prompt": args.decode_prompt, "backend": args.backend,
               "config": str(args.config.resolve()),
               "out": str(Path(scratch) / f"strata-{mix}-{regime}.json")}
        res = run_child(Path(__file__).resolve(), job, args.timeout)
        res["file"] = written.path.name
        if isinstance(res.get("config"), dict):
            res["config"]["model"] = {"gguf": written.path.name}
            configs[regime] = json.dumps(res["config"])
        reg["strata"] = res
        ok &= not res.get("error") and all("error" not in p for p in res.get("prompts", []))
    shutil.rmtree(scratch, ignore_errors=True)
    notes = ["strata: median of the timed runs (host clock around the prefill call, logits "
             "included); llama.cpp: avg_ts of llama-bench's repetitions, best micro-batch"]
    info = next((i for r in regimes.values() if r["llama"] and (i := build_info(r["llama"]))),
                None)
    if info:
        notes.append(info)
    if written.note:
        notes.append(written.note)
    doc = {"command": " ".join(["python", "bench/bench_peer_llama.py", *sys.argv[1:]]),
           "hardware": hardware, "date": stamp,
           "file": {"name": written.path.name, "mix": mix, "bytes": written.bytes,
                    "reused": written.reused, "write_s": written.seconds,
                    "description": DESCRIPTIONS[mix]},
           "n_cpu_moe": llama.n_cpu_moe("quarter", n_layers), "llama_commands": commands,
           "strata_configs": configs, "regimes": regimes, "notes": notes,
           "decode_steps": args.decode_steps}
    md = report.markdown(doc)
    print("\n" + md, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.shape == "full" else f"{args.shape}-"
    stem = args.out / f"peer-llama-{tag}{mix}-{stamp}"
    write_json(stem.with_suffix(".json"), doc)
    stem.with_suffix(".md").write_text(md)
    print(f"wrote {stem}.json and .md", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.strata_child:
        return run_job(json.loads(args.strata_child))
    from strata_rt.cli.common import hardware_line
    from strata_rt.config.run.run_config import load_config
    from strata_rt.errors import StrataError

    try:
        cfg = load_config(args.config)
        shape = shape_of(cfg, args.shape == "tiny")
    except (StrataError, ValueError) as e:
        print(f"--config {args.config}: {e}", file=sys.stderr)
        return 2
    context = cfg.context or shape.spec.context
    if args.dry_run:
        print_plan(args, shape, context)
        return 0
    hardware = hardware_line()
    print(hardware, flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    ok = True
    for mix in args.file_list:
        ok &= run_file(args, shape, mix, context, hardware, stamp)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
