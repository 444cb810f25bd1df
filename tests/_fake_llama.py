"""A stand-in for llama.cpp's llama-bench, for the benchmarks' tests on any machine: the JSON
fields it writes, and a script that prints them for the tests its arguments name."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: llama-bench's JSON fields (tools/llama-bench: test::get_fields, then the samples)
FIELDS: dict[str, Any] = {
    "build_commit": "abc1234", "build_number": 6000, "cpu_info": "AMD EPYC",
    "gpu_info": "NVIDIA H200", "backends": "CUDA", "model_filename": "m.gguf",
    "model_type": "qwen3moe 30B.A3B IQ3_XXS - 3.0625 bpw", "model_size": 12000000000,
    "model_n_params": 30532122624, "n_batch": 8192, "n_ubatch": 512, "n_threads": 16,
    "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16",
    "n_gpu_layers": 99, "n_cpu_moe": 36, "split_mode": "layer", "main_gpu": 0,
    "no_kv_offload": False, "flash_attn": 1, "devices": "auto", "tensor_split": "0.00",
    "tensor_buft_overrides": "none", "load_mode": "none", "lazy_mode": "none",
    "embeddings": False, "no_op_offload": 0, "no_host": False, "repack": True,
    "fit_target": 0, "fit_min_ctx": 0, "n_prompt": 512, "n_gen": 0, "n_depth": 0,
    "test_time": "2026-12-01T10:00:00Z", "avg_ns": 0, "stddev_ns": 0, "avg_ts": 0.0,
    "stddev_ts": 0.0}



def fake_llama(folder: Path) -> Path:
    """A stand-in llama-bench: llama-bench's JSON for its -p/-n/-ub/-ncmoe, printed test by
    test (FAKE_LLAMA_MODE: ok; fail: one test, then exit 3; slow: one test, then a hang)."""
    path = folder / "llama-bench"
    path.write_text(f"""#!{sys.executable}
import json, os, sys, time
a = sys.argv[1:]
opt = lambda k, d: a[a.index(k) + 1] if k in a else d
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
template = json.loads({json.dumps(json.dumps(FIELDS))})
tests = [(int(p), 0, int(u)) for p in opt("-p", "0").split(",") if int(p)
         for u in opt("-ub", "512").split(",")]
tests += [(0, int(opt("-n", "0")), 512)] if int(opt("-n", "0")) else []
print("[")
for i, (p, g, u) in enumerate(tests):
    ts = (1000.0 + u) if p else 100.0
    ns = int((p + g) / ts * 1e9)
    rec = dict(template, n_prompt=p, n_gen=g, n_ubatch=u, n_cpu_moe=int(opt("-ncmoe", "0")),
               avg_ts=ts, avg_ns=ns, samples_ns=[ns], samples_ts=[ts])
    print((",\\n" if i else "") + json.dumps(rec, indent=2), end="", flush=True)
    if mode != "ok":
        print("ggml_cuda error: out of memory", file=sys.stderr, flush=True)
        if mode == "slow":
            time.sleep(60)
        sys.exit(3)
print("\\n]")
""")
    path.chmod(0o755)
    return path
