"""Regenerates tests/fixtures/generate/: transformers' greedy continuations and perplexities for
the seeded tiny Qwen3-MoE models of make_qwen3_golden.py.

Each model is built and written with strata_rt exactly as make_qwen3_golden.py does (its case
list and its GGUF -> Qwen3MoeForCausalLM loader are imported, so both fixtures describe the same
weights), then transformers computes, in float32 on the CPU:

- `generate(do_sample=False, max_new_tokens=24)` after seeded prompts, with no EOS token set, so
  every continuation has 24 tokens (the runtime's greedy runs with eos_id=None to match), and
  each step's gap between the best and second-best logit (how far the argmax is from a tie:
  a gap far above a backend's logit error makes exact id equality a fair test there);
- the perplexity of a seeded token sequence over non-overlapping windows of `ctx` tokens, each
  window its own forward pass with `labels=` (transformers' mean cross-entropy over tokens
  1..n-1), and the total exp(sum of NLL / predicted tokens). The last, shorter window is kept
  when it has at least two tokens, as strata_rt.text.perplexity does.

Needs torch and transformers (CI has neither; the tests read the JSON):

    python tests/tools/make_generate_golden.py    # an environment with torch and transformers

Writes golden.json: per case the prompts, the generated ids, the per-step gaps, the perplexity
sequence and values, plus the date and the library versions.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
OUT = ROOT / "tests" / "fixtures" / "generate"

#: prompt lengths per case and the number of new tokens
PROMPT_TOKENS = (5, 12, 40)
NEW_TOKENS = 24
#: the perplexity sequence's length and the window sizes it is scored at
PPL_TOKENS = 150
PPL_CTX = (32, 64)


def prompts(case: dict) -> list[np.ndarray]:
    """Seeded prompts of PROMPT_TOKENS lengths (the tests rebuild them from the JSON)."""
    vocab = case["spec"]["vocab"]
    rng = np.random.default_rng(case["prompt_seed"] + 100)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in PROMPT_TOKENS]


def ppl_sequence(case: dict) -> np.ndarray:
    vocab = case["spec"]["vocab"]
    return np.random.default_rng(case["prompt_seed"] + 200).integers(0, vocab, PPL_TOKENS)


def hf_greedy(hf, prompt: np.ndarray) -> tuple[list[int], list[float]]:
    """transformers' greedy ids after `prompt` and each step's top-1 / top-2 logit gap."""
    import torch

    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf.generate(torch.from_numpy(prompt)[None], do_sample=False,
                          max_new_tokens=NEW_TOKENS, output_scores=True,
                          return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    if len(ids) != NEW_TOKENS:
        raise SystemExit(f"generate stopped after {len(ids)} tokens")
    gaps = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.scores]
    return ids, gaps


def hf_perplexity(hf, seq: np.ndarray, ctx: int) -> dict:
    """Per-window mean NLL from transformers' loss, and the total perplexity."""
    import torch

    windows = []
    for lo in range(0, len(seq), ctx):
        w = seq[lo: lo + ctx]
        if len(w) < 2:
            continue
        ids = torch.from_numpy(w.astype(np.int64))[None]
        with torch.no_grad():
            loss = float(hf(ids, labels=ids).loss)
        windows.append({"start": lo, "tokens": len(w), "mean_nll": loss})
    nll = sum(w["mean_nll"] * (w["tokens"] - 1) for w in windows)
    predicted = sum(w["tokens"] - 1 for w in windows)
    return {"ctx": ctx, "windows": windows, "perplexity": float(np.exp(nll / predicted))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch
    import transformers
    from make_qwen3_golden import CASES, build_case, hf_model_from_gguf

    from strata_rt.models.qwen3 import write_qwen3_gguf

    args.out.mkdir(parents=True, exist_ok=True)
    record = {"generated": datetime.date.today().isoformat(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "numpy": np.__version__, "gguf": metadata.version("gguf"),
                           "python": platform.python_version()},
              "new_tokens": NEW_TOKENS, "cases": {}}
    for name, case in CASES.items():
        model, _ = build_case(case)
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_model_from_gguf(write_qwen3_gguf(Path(tmp) / f"{name}.gguf", model))
        runs = []
        for p in prompts(case):
            ids, gaps = hf_greedy(hf, p)
            runs.append({"prompt": p.tolist(), "ids": ids, "top2_gaps": gaps})
            print(f"{name}: prompt of {len(p)} -> {ids[:8]}... (smallest gap {min(gaps):.2e})")
        seq = ppl_sequence(case)
        ppl = [hf_perplexity(hf, seq, ctx) for ctx in PPL_CTX]
        for p in ppl:
            print(f"{name}: perplexity at ctx {p['ctx']}: {p['perplexity']:.6f}")
        record["cases"][name] = {"weights_sha256": model.digest(), "generate": runs,
                                 "perplexity_sequence": seq.tolist(), "perplexity": ppl}
    (args.out / "golden.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'golden.json'}")


if __name__ == "__main__":
    main()
