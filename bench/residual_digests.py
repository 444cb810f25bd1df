"""Fingerprints of the engine's output on the standard prompt set, so two versions of the code
can be compared byte for byte: a refactor must change no byte.

    python bench/residual_digests.py --out digests.json [--shapes small,30b] [--backend cuda]

For each shape (the small demo MoE and the Qwen3-30B-A3B MoE shape, a quarter of the experts
resident) and each gather mode (one launch per expert, one per group), it prefills seeded
hidden states of 128, 256, 512, 1,024, 2,048, 4,096, 8,192 and 9,200 tokens and records the
SHA-256 of every prompt's final hidden states and of the STRATA_PREFILL_DUMP_R file. Compare two
runs with `--compare OLD.json NEW.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from strata_rt.engine import Engine, EngineConfig
from strata_rt.weights.model import MoESpec

PROMPTS = (128, 256, 512, 1024, 2048, 4096, 8192, 9200)
SHAPES = {
    # (spec, resident experts, ring bytes)
    "small": (MoESpec(n_layers=4, hidden=512, ffn=256, n_experts=32, top_k=4), 32, 8 << 20),
    "30b": (MoESpec(n_layers=48, hidden=2048, ffn=768, n_experts=128, top_k=8), 1536,
            512 << 20),
}


def hidden_states(tokens: int, hidden: int) -> np.ndarray:
    return np.random.default_rng(1000 + tokens).standard_normal((tokens, hidden),
                                                                dtype=np.float32)


def run_shape(name: str, backend: str, gather_one: bool, prompts: tuple[int, ...],
              workdir: Path) -> dict:
    spec, cache, ring = SHAPES[name]
    dump = workdir / f"{name}-g{int(gather_one)}.dump"
    cfg = EngineConfig(model={"spec": spec, "seed": 1}, backend=backend, expert_cache=cache,
                       ring_bytes=ring, gather_one=gather_one, dump_r=str(dump))
    out: dict = {"prompts": {}}
    with Engine.open(cfg) as eng:
        for n in prompts:
            t0 = time.perf_counter()
            h, _ = eng.prefill(hidden_states(n, spec.hidden))
            out["prompts"][str(n)] = hashlib.sha256(np.ascontiguousarray(h).tobytes()).hexdigest()
            print(f"{name} gather_one={int(gather_one)} {n:5d} tokens "
                  f"{(time.perf_counter() - t0) * 1e3:8.1f} ms  {out['prompts'][str(n)][:16]}",
                  flush=True)
    out["dump"] = hashlib.sha256(dump.read_bytes()).hexdigest()
    out["dump_bytes"] = dump.stat().st_size
    return out


def compare(old_path: str, new_path: str) -> int:
    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    diffs = 0
    for key, run in old["runs"].items():
        other = new["runs"].get(key)
        if other is None:
            print(f"{key}: missing from {new_path}")
            diffs += 1
            continue
        for n, digest in run["prompts"].items():
            same = other["prompts"].get(n) == digest
            diffs += not same
            print(f"{key} {n:>5} tokens: {'same' if same else 'DIFFERENT'}")
        same = other["dump"] == run["dump"]
        diffs += not same
        print(f"{key} dump: {'same' if same else 'DIFFERENT'}")
    print(f"{diffs} difference(s)")
    return 1 if diffs else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the digests here (JSON)")
    ap.add_argument("--shapes", default="small,30b")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "reference"))
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--compare-to", metavar="OLD",
                    help="after the run, compare its digests with OLD (exit 1 on a difference)")
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        ap.error("--out is required unless --compare is given")
    prompts = tuple(int(x) for x in args.prompts.split(","))
    result: dict = {"backend": args.backend, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            for gather_one in (True, False):
                result["runs"][f"{name}/gather_one={int(gather_one)}"] = run_shape(
                    name, args.backend, gather_one, prompts, Path(tmp))
    Path(args.out).write_text(json.dumps(result, indent=1))
    same = all(result["runs"][f"{n}/gather_one=1"]["dump"] ==
               result["runs"][f"{n}/gather_one=0"]["dump"] for n in args.shapes.split(","))
    print(f"gather modes byte-identical: {same}")
    if args.compare_to:
        sys.exit(compare(args.compare_to, args.out))


if __name__ == "__main__":
    main()
