"""Regenerates tests/fixtures/qwen3_routing/: transformers' answers for seeded random Qwen3-MoE
models whose routers are large enough that the routing decides the output.

The routing parity test (tests/test_routing_parity_gpu.py) runs each model on the CUDA backend
and needs, per case and prompt (7, 64 and 300 tokens, each from an empty KV cache): the float32
logits of `Qwen3MoeForCausalLM` at every position, the same model's float64 top-2 margin at
every position (argmax must agree wherever it exceeds 1e-3), the float64 run's routing gap at
every position (over the layers, the smallest gap between the k-th and k+1-th router logit,
relative to the token's router-logit RMS: where it is tiny, any upstream rounding may pick
another expert), and 24 greedy tokens after the 64-token prompt. The models come from our GGUF writer and are read back through the plain gguf
package, exactly as make_qwen3_golden.py does (its hf_model_from_gguf), so transformers sees
the file's weights.

Needs torch and transformers (CI has neither; the tests read the fixtures):

    python -m venv .oracle && .oracle/bin/pip install torch transformers numpy gguf pluggy pyyaml
    .oracle/bin/python tests/tools/make_routing_golden.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
OUT = ROOT / "tests" / "fixtures" / "qwen3_routing"

PROMPTS = (7, 64, 300)
GREEDY_PROMPT = 64
GREEDY_TOKENS = 24
_ATTN = {"rope_theta": 1_000_000.0, "rms_eps": 1e-6, "context": 1024}
#: shapes of the issue: hidden 256 / 1,024 / 2,048, ffn 512 / 768, 8 / 64 / 128 experts,
#: top-2 / top-8, F16 and IQ3_XXS experts (the widest with one layer, to stay small)
CASES = {
    "h256_e8_k2_iq3": {
        "spec": {"n_layers": 2, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
                 "vocab": 384, "ffn": 512, "n_experts": 8, "top_k": 2, **_ATTN},
        "format": "iq3_xxs", "seed": 31, "tied": False, "dense_type": "F16"},
    "h1024_e64_k8_fp16": {
        "spec": {"n_layers": 2, "hidden": 1024, "n_heads": 8, "n_kv_heads": 2, "head_dim": 128,
                 "vocab": 384, "ffn": 768, "n_experts": 64, "top_k": 8, **_ATTN},
        "format": "fp16", "seed": 32, "tied": False, "dense_type": "F16"},
    "h1024_e128_k8_iq3": {
        "spec": {"n_layers": 2, "hidden": 1024, "n_heads": 8, "n_kv_heads": 4, "head_dim": 128,
                 "vocab": 384, "ffn": 512, "n_experts": 128, "top_k": 8, **_ATTN},
        "format": "iq3_xxs", "seed": 33, "tied": True, "dense_type": "F16"},
    "h2048_e128_k8_fp16": {
        "spec": {"n_layers": 1, "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
                 "vocab": 384, "ffn": 768, "n_experts": 128, "top_k": 8, **_ATTN},
        "format": "fp16", "seed": 34, "tied": False, "dense_type": "F16"},
}


def build_case(case: dict):
    """The case's model (numpy only; the test builds it the same way)."""
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec

    spec = Qwen3Spec(**case["spec"])
    return Qwen3Model.synthetic(spec, case["seed"], case["format"], tied=case["tied"],
                                dense_type=case["dense_type"])


def prompt_ids(case: dict, tokens: int) -> np.ndarray:
    rng = np.random.default_rng([case["seed"], tokens])
    return rng.integers(0, case["spec"]["vocab"], tokens).astype(np.int32)


def record_router_logits(hf) -> list[np.ndarray]:
    """A list that every forward pass of `hf` appends its router logits to, layer by layer
    (clear it before a run)."""
    router_logits: list[np.ndarray] = []
    for layer in hf.model.layers:
        layer.mlp.gate.register_forward_hook(
            lambda _m, _i, out, sink=router_logits: sink.append(out[0].detach().numpy().copy()))
    return router_logits


def route_gap(router_logits: list[np.ndarray], k: int) -> np.ndarray:
    """Per position, the smallest over the layers of the gap between the k-th and k+1-th
    router logit relative to the token's router-logit RMS: where it is tiny, any upstream
    rounding may pick another expert."""
    gaps = []
    for rl in router_logits:
        srt = np.sort(rl, axis=-1)
        gaps.append((srt[:, -k] - srt[:, -k - 1]) / np.sqrt((rl * rl).mean(axis=-1)))
    return np.min(gaps, axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    import torch
    import transformers
    from make_qwen3_golden import hf_model_from_gguf

    from strata_rt.models.qwen3 import write_qwen3_gguf

    args.out.mkdir(parents=True, exist_ok=True)
    golden = args.out / "golden.json"
    record = json.loads(golden.read_text()) if golden.exists() else {"cases": {}}
    record.update(generated=datetime.date.today().isoformat(),
                  versions={"torch": torch.__version__, "transformers": transformers.__version__,
                            "numpy": np.__version__, "gguf": metadata.version("gguf"),
                            "python": platform.python_version()},
                  prompts=list(PROMPTS), greedy_prompt=GREEDY_PROMPT,
                  greedy_tokens=GREEDY_TOKENS)
    for name in args.cases.split(","):
        case = CASES[name]
        model = build_case(case)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_qwen3_gguf(Path(tmp) / f"{name}.gguf", model)
            hf = hf_model_from_gguf(path)
        hf.config._experts_implementation = "eager"  # the grouped kernels take no float64
        del model
        router_logits = record_router_logits(hf)
        k = case["spec"]["top_k"]
        for tokens in PROMPTS:
            ids = prompt_ids(case, tokens)
            with torch.no_grad():
                x = torch.from_numpy(ids.astype(np.int64))[None]
                logits = hf(x).logits[0].to(torch.float32).numpy()
                hf.to(torch.float64)
                router_logits.clear()
                l64 = hf(x).logits[0].numpy()
                hf.to(torch.float32)
            np.save(args.out / f"{name}.p{tokens}.route_gap.npy",
                    route_gap(router_logits, k).astype(np.float32))
            router_logits.clear()
            top2 = np.sort(l64, axis=-1)[:, -2:]
            np.save(args.out / f"{name}.p{tokens}.logits.npy", logits)
            np.save(args.out / f"{name}.p{tokens}.margin.npy",
                    (top2[:, 1] - top2[:, 0]).astype(np.float32))
            print(f"{name} p{tokens}: logits {logits.shape}, std {logits.std():.3f}", flush=True)
        ids = torch.from_numpy(prompt_ids(case, GREEDY_PROMPT).astype(np.int64))[None]
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0, min_new_tokens=GREEDY_TOKENS)
        greedy = out[0, GREEDY_PROMPT:].numpy().astype(np.int32)
        np.save(args.out / f"{name}.greedy.npy", greedy)
        record["cases"][name] = case
        print(f"{name}: greedy {greedy.tolist()}", flush=True)
        del hf
    golden.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
