"""Regenerates tests/fixtures/qwen3_tiny/: transformers' logits for seeded tiny Qwen3-MoE models.

For each case a seeded synthetic model is built with strata_rt (numpy), written with our GGUF
writer, and the file is then read *without strata_rt* (the plain gguf package: its reader, its
dequantizers and llama.cpp's HF -> GGUF tensor-name table) into a Hugging Face
`Qwen3MoeForCausalLM` that runs in float32 on the CPU. Its logits at every position are the
golden values. Because transformers sees exactly the weights the file holds (F16/BF16/Q8_0
dense tensors and FP16 or IQ3_XXS experts dequantized), the parity test compares arithmetic,
not conversion error, and confirms the file's conventions (names, dimension order, no q/k row
permutation, rotate-halves RoPE, q/k norm before RoPE, renormalised top-k).

Needs torch and transformers (CI has neither; the tests read the fixtures):

    python -m venv .oracle && .oracle/bin/pip install torch transformers numpy gguf pluggy pyyaml
    .oracle/bin/python tests/tools/make_qwen3_golden.py

It writes <case>.ids.npy (int32 prompt), <case>.logits.npy (float32 [tokens, vocab]) and
golden.json (the cases, the weights' SHA-256 and the library versions used).
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
OUT = ROOT / "tests" / "fixtures" / "qwen3_tiny"

#: the seeded tiny models (kept small: the fixtures are a few hundred KB in all)
CASES = {
    # untied head; F16 embedding and attention, F32 output head and norms; FP16 experts
    "fp16_experts": {
        "spec": {"n_layers": 3, "hidden": 256, "n_heads": 8, "n_kv_heads": 2, "head_dim": 64,
                 "vocab": 1000, "ffn": 256, "n_experts": 16, "top_k": 4,
                 "rope_theta": 1_000_000.0, "rms_eps": 1e-6, "context": 4096},
        "format": "fp16", "seed": 20, "tied": False, "tokens": 40, "prompt_seed": 7,
        "dense_types": {"token_embd": "F16", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                        "attn_output": "F16"},
    },
    # tied head; Q8_0 / BF16 dense tensors; IQ3_XXS experts; another rope base and epsilon
    "iq3_xxs_experts": {
        "spec": {"n_layers": 2, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
                 "vocab": 1000, "ffn": 256, "n_experts": 8, "top_k": 2,
                 "rope_theta": 10_000.0, "rms_eps": 1e-5, "context": 2048},
        "format": "iq3_xxs", "seed": 21, "tied": True, "tokens": 40, "prompt_seed": 8,
        "dense_types": {"token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "BF16",
                        "attn_v": "Q8_0", "attn_output": "BF16"},
    },
}


def build_case(case: dict):
    """The case's model and prompt (numpy only; the tests build them the same way)."""
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec

    spec = Qwen3Spec(**case["spec"])
    model = Qwen3Model.synthetic(spec, case["seed"], case["format"], tied=case["tied"])
    model = model.with_dense_types(case["dense_types"])
    ids = np.random.default_rng(case["prompt_seed"]).integers(0, spec.vocab, case["tokens"])
    return model, ids.astype(np.int32)


def _plain_tensors(path: Path) -> tuple[dict, dict]:
    """(key -> value, name -> float32 array [outermost first]) through the gguf package only."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))
    keys = {name: f.contents() for name, f in r.fields.items()}
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        tensors[t.name] = np.asarray(dequantize(t.data, t.tensor_type),
                                     dtype=np.float32).reshape(shape)
    return keys, tensors


def hf_model_from_gguf(path: Path):
    """A float32 Qwen3MoeForCausalLM holding exactly the file's (dequantized) weights."""
    import gguf
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys, tensors = _plain_tensors(path)
    a = keys["general.architecture"]
    n_layers = int(keys[f"{a}.block_count"])
    tied = "output.weight" not in tensors
    cfg = dict(vocab_size=tensors["token_embd.weight"].shape[0],
               hidden_size=int(keys[f"{a}.embedding_length"]),
               intermediate_size=int(keys[f"{a}.expert_feed_forward_length"]),
               num_hidden_layers=n_layers,
               num_attention_heads=int(keys[f"{a}.attention.head_count"]),
               num_key_value_heads=int(keys[f"{a}.attention.head_count_kv"]),
               head_dim=int(keys[f"{a}.attention.key_length"]),
               rms_norm_eps=float(np.float32(keys[f"{a}.attention.layer_norm_rms_epsilon"])),
               max_position_embeddings=int(keys[f"{a}.context_length"]),
               tie_word_embeddings=tied,
               moe_intermediate_size=int(keys[f"{a}.expert_feed_forward_length"]),
               num_experts=int(keys[f"{a}.expert_count"]),
               num_experts_per_tok=int(keys[f"{a}.expert_used_count"]),
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               attention_bias=False, use_sliding_window=False)
    theta = float(np.float32(keys[f"{a}.rope.freq_base"]))
    try:  # transformers >= 5 keeps RoPE settings in rope_parameters
        config = Qwen3MoeConfig(**cfg, rope_parameters={"rope_type": "default",
                                                         "rope_theta": theta})
    except TypeError:
        config = Qwen3MoeConfig(**cfg, rope_theta=theta)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()

    # llama.cpp's table of HF -> GGUF names (the gguf package ships it)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, n_layers)
    used: set[str] = set()
    for hf_name, param in model.named_parameters():
        if hf_name.endswith("experts.gate_up_proj"):  # transformers 5 fuses gate and up
            stem = name_map.get_name(hf_name.replace("gate_up_proj", "gate_proj"))
            up = stem.replace("ffn_gate_exps", "ffn_up_exps")
            value = np.concatenate([tensors[stem + ".weight"], tensors[up + ".weight"]], axis=1)
            used |= {stem + ".weight", up + ".weight"}
        else:
            base = hf_name.removesuffix(".weight")
            g = name_map.get_name(base)
            if g is None:
                raise SystemExit(f"no GGUF name for {hf_name}")
            value = tensors[g + ".weight"]
            used.add(g + ".weight")
        if tuple(value.shape) != tuple(param.shape):
            raise SystemExit(f"{hf_name}: GGUF gives {value.shape}, the model wants "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.array(value, dtype=np.float32)))
    left = set(tensors) - used
    if left:
        raise SystemExit(f"GGUF tensors transformers did not take: {sorted(left)}")
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("tie_word_embeddings did not tie lm_head to the embedding")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    import torch
    import transformers

    from strata_rt.models.qwen3 import write_qwen3_gguf

    torch.set_num_threads(max(1, torch.get_num_threads()))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"generated": datetime.date.today().isoformat(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "numpy": np.__version__, "gguf": metadata.version("gguf"),
                           "python": platform.python_version()},
              "cases": {}}
    for name, case in CASES.items():
        model, ids = build_case(case)
        with tempfile.TemporaryDirectory() as tmp:
            path = write_qwen3_gguf(Path(tmp) / f"{name}.gguf", model)
            hf = hf_model_from_gguf(path)
        with torch.no_grad():
            logits = hf(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]
        logits = logits.to(torch.float32).numpy()
        np.save(args.out / f"{name}.ids.npy", ids)
        np.save(args.out / f"{name}.logits.npy", logits)
        record["cases"][name] = {**case, "weights_sha256": model.digest(),
                                 "logits_shape": list(logits.shape)}
        print(f"{name}: {len(ids)} tokens, logits {logits.shape}, std {logits.std():.3f}")
    (args.out / "golden.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
