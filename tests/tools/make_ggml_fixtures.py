"""Regenerates tests/fixtures/ggml_mixes/: a tiny Qwen3-MoE checkpoint in the GGUF mixes people
download, made by llama.cpp's own converter and quantizer, and transformers' answers for each.

Why: the engine's readers for llama.cpp's block formats must be checked on files the real tools
wrote (their per-tensor type choices, their imatrix-weighted rounding, their keys), not only on
files our own writer made. The checkpoint is small (2 layers, hidden 256, 4 x 64 query / 2 x 64
KV heads, 4 experts top-2, expert ffn 256, a 512-token byte-level BPE vocabulary) but every
row is a multiple of 256, so llama-quantize uses the K- and I-quants it would use on a real
model instead of falling back to Q5_0/Q8_0 for rows the 256-wide super-blocks cannot tile.

Two steps, two environments:

1. `files` needs a llama.cpp source tree with llama-quantize, llama-imatrix and
   llama-perplexity built (CPU is enough), and a Python with torch, transformers, numpy and
   gguf (the converter takes its own gguf-py from the tree):

       cmake -B build -DGGML_CUDA=OFF && cmake --build build -j2 \\
           --target llama-quantize llama-imatrix llama-perplexity      # in the llama.cpp tree
       LLAMA_CPP=/path/to/llama.cpp python tests/tools/make_ggml_fixtures.py files

   It makes a seeded random model (strata_rt's synthetic Qwen3 weights, put into transformers'
   Qwen3MoeForCausalLM by make_qwen3_golden.hf_model_from_gguf and saved with save_pretrained,
   so the checkpoint is a plain Hugging Face folder), converts it with convert_hf_to_gguf.py to
   F16 and BF16, makes an importance matrix with llama-imatrix on calibration.txt, runs
   llama-quantize from F16 for every mix in MIXES (the ones it refuses are recorded with its
   reason; --extra adds CONVERTED_EXTRA and MIXES_EXTRA), runs llama-perplexity on eval.txt for
   every file, and writes manifest.json: per file how it was made, its size and SHA-256, the
   type of every tensor (read with the gguf package) and llama-perplexity's estimate.

2. `goldens` needs torch, transformers, accelerate and gguf (no llama.cpp):

       python tests/tools/make_ggml_fixtures.py goldens

   For every file of the manifest it loads Qwen3MoeForCausalLM with
   `from_pretrained(folder, gguf_file=...)` (transformers dequantizes with the gguf package),
   runs it in float32 on the CPU and writes <file>.npz: per prompt the ids, the logits at every
   position and the float64 run's argmax, top-2 margin and routing gap (make_routing_golden's
   route_gap); 24 greedy tokens after the 64-token prompt with the float64 run's argmax and
   margin along them; the perplexity of eval.txt in llama-perplexity's scheme. tests/tools/ggml_fixture_checks.py says how an engine's output is
   compared with them.

The converter identifies a BPE pre-tokenizer by hashing the ids it gives a fixed text; a
vocabulary this small gives ids no published model has, so the converter is run through a shim
(`convert`, below) that answers "qwen2" (what it writes for every Qwen2/Qwen3 checkpoint)
when, and only when, its own table has no entry.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))
OUT = ROOT / "tests" / "fixtures" / "ggml_mixes"
MANIFEST = "manifest.json"

SEED = 50
MODEL_NAME = "strata-tiny-qwen3moe"
#: the model; hidden and ffn are multiples of 256 so K/I-quant super-blocks tile every row
SPEC = {"n_layers": 2, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
        "vocab": 512, "ffn": 256, "n_experts": 4, "top_k": 2, "rope_theta": 1_000_000.0,
        "rms_eps": 1e-6, "context": 4096}
THREADS = "2"
PPL_CTX = 128
IMATRIX_CTX = 128

#: made by convert_hf_to_gguf.py --outtype
CONVERTED = {"F16": "f16", "BF16": "bf16"}
#: made only with --extra: the same tensor types as a default file, so they test no reader the
#: default set does not, and the folder must stay small. The converter's q8_0 differs from
#: llama-quantize's Q8_0 only in the rounding of the tensors it quantizes from the float32
#: checkpoint rather than from F16 (measured); the imatrix ones differ from their plain twins
#: only in their values (K-quants made with the imatrix are in the default set through the
#: community mix, I-quants through IQ3_XXS / IQ2_M).
CONVERTED_EXTRA = {"Q8_0-convert": "q8_0"}


def _mix(qtype: str, imatrix: bool = False, *flags: str, source: str = "F16.gguf") -> dict:
    return {"type": qtype, "imatrix": imatrix, "flags": flags, "from": source}


#: made by llama-quantize: file stem -> its type, whether it uses the imatrix, extra flags and
#: the file it starts from
MIXES: dict[str, dict[str, Any]] = {
    "Q8_0": _mix("Q8_0"),
    "Q6_K": _mix("Q6_K"),
    "Q5_K_M": _mix("Q5_K_M"),
    "Q4_K_M": _mix("Q4_K_M"),
    "Q3_K_M": _mix("Q3_K_M"),
    "Q2_K": _mix("Q2_K"),
    "IQ4_XS": _mix("IQ4_XS"),
    "IQ3_XXS": _mix("IQ3_XXS"),  # llama-quantize wants an imatrix: recorded as refused
    "IQ3_XXS-imatrix": _mix("IQ3_XXS", True),
    "IQ2_M": _mix("IQ2_M"),      # likewise
    "IQ2_M-imatrix": _mix("IQ2_M", True),
    "MXFP4_MOE": _mix("MXFP4_MOE"),
    # a community-style mix: every tensor Q4_K, the experts' down projections Q6_K, embedding
    # and output head Q8_0 (as the "_L" uploads do)
    "Q4_K-down_exps_Q6_K": _mix("Q4_K_M", True, "--pure", "--tensor-type", "ffn_down_exps=q6_k",
                                "--token-embedding-type", "q8_0", "--output-tensor-type",
                                "q8_0"),
    # what people try on a downloaded Q8_0: refused without --allow-requantize (recorded)
    "Q4_K_M-from-Q8_0": _mix("Q4_K_M", source="Q8_0.gguf"),
}
MIXES_EXTRA = {"Q4_K_M-imatrix": _mix("Q4_K_M", True), "Q2_K-imatrix": _mix("Q2_K", True),
               "IQ4_XS-imatrix": _mix("IQ4_XS", True)}

#: name -> (text, tokens kept); p7 starts with a control token, p64 is the start of eval.txt
PROMPTS = {
    "p7": ("<|im_start|>user\nWhy are the experts kept in host memory?<|im_end|>\n", 7),
    "p64": (None, 64),
}
GREEDY_PROMPT = "p64"
GREEDY_TOKENS = 24

EVAL_TEXT = """\
The engine reads a model from a single file. The file begins with a short header: a magic \
number, a version, the number of tensors and the number of keys. Each key has a name, a type \
and a value, and together the keys say what the model is: how many layers it has, how wide \
its hidden state is, how many experts each layer holds and how many of them a token uses.

After the keys comes the list of tensors. Every entry gives a name, the number of dimensions, \
the size of each dimension, a type and an offset. The type says how the numbers are stored. \
Some files keep every weight as a sixteen-bit float; most of the files people download keep \
the large matrices in blocks of a few bits each, with a scale for every block, and only the \
small vectors in full precision.

A block format trades accuracy for size. Eight bits per weight lose almost nothing; four bits \
lose a little, and the loss depends on how the scales are chosen. Two or three bits lose more, \
so the tools that make such files measure which inputs matter most, on a sample of text, and \
spend their precision there. That measurement is called an importance matrix.

When the engine runs, it turns the prompt into tokens, looks up a vector for each token, and \
passes the vectors through every layer. In each layer, attention mixes information between \
positions, and then a router picks two experts for every token. Each expert is a small feed \
forward network; the outputs of the chosen experts are weighted and added back to the hidden \
state. At the end, a final norm and the output head turn the hidden state into one score for \
every token of the vocabulary.

To check an engine, one runs the same file through an independent implementation and compares \
the scores. The scores will not be identical, because the two programs add numbers in \
different orders, but they should agree to a few parts in a million. Where the two best \
scores are nearly equal, either answer is acceptable; everywhere else, the chosen token must \
be the same, and a long run of greedy choices must not drift apart.

Memory decides what a large model costs to run. The experts hold almost all of the weights, \
yet each token needs only a few of them, so an engine may keep the experts in host memory and \
copy to the device only those that a batch of tokens has chosen. The copies overlap with the \
work on the previous layer, and a cache keeps the experts that are chosen again and again.
"""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions(*names: str) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def calibration_text() -> str:
    """What llama-imatrix measures activations on: the tokenizer fixtures' corpus (every kind
    of text a pre-tokenizer or BPE gets wrong: code, CJK, emoji, whitespace runs) twice, so
    every expert of every layer is routed some tokens. Kept apart from eval.txt so the
    perplexity is not measured on the imatrix's own text."""
    from make_tokenizer_fixtures import CORPUS

    return "\n".join(CORPUS * 2) + "\n"


# ---------------------------------------------------------------------------- step 1: files
def build_checkpoint(dest: Path) -> None:
    """A Hugging Face folder as Qwen publishes them: config, float32 safetensors with one
    tensor per expert, tokenizer.json beside vocab.json and merges.txt. The weights are
    strata_rt's seeded synthetic Qwen3 weights (their scales give logits and router scores of
    order one, where transformers' default init gives near-uniform ones whose argmax any
    rounding flips); hf_model_from_gguf puts them into a Qwen3MoeForCausalLM exactly as the
    make_qwen3_golden fixtures do. The vocabulary is strata_rt's synthetic byte-level BPE one
    (Qwen's special tokens, no BOS) at the model's size, written by make_tokenizer_fixtures;
    transformers saves it back so the folder has the tokenizer.json the converter takes the
    special tokens' ids from."""
    from make_qwen3_golden import hf_model_from_gguf
    from make_tokenizer_fixtures import write_hf_tokenizer
    from transformers import AutoTokenizer

    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf
    from strata_rt.text.tokenizer_vocab import synthetic_vocab

    model = Qwen3Model.synthetic(Qwen3Spec(**SPEC), SEED, "fp16", tied=False, dense_type="F32")
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model_from_gguf(write_qwen3_gguf(Path(tmp) / "synthetic.gguf", model))
        write_hf_tokenizer(synthetic_vocab(SPEC["vocab"]), Path(tmp) / "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp) / "tokenizer")
        hf.config.eos_token_id = tokenizer.eos_token_id
        hf.config.pad_token_id = tokenizer.pad_token_id
        hf.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
        for f in ("vocab.json", "merges.txt"):
            shutil.copy(Path(tmp) / "tokenizer" / f, dest / f)


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> tuple[int, float, str]:
    """Runs a tool in `cwd` with its output into `log`; (exit status, seconds, output). The
    llama.cpp tools run in the fixtures folder with file names relative to it: llama-quantize
    stores the imatrix's path as given (quantize.imatrix.file) and llama-imatrix the text's
    (imatrix.datasets), and no machine's paths belong in the fixtures."""
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd).returncode
    return rc, time.monotonic() - t0, log.read_text(errors="replace")


def _refusal(output: str) -> str:
    """The lines of a tool's output that say why it stopped (from the first word that does,
    as llama.cpp's progress lines may run into them)."""
    why = re.compile(r"ERROR|error|\w+: failed|refus|requires|invalid|exception|what\(\)")
    keep = []
    for ln in output.splitlines():
        m = why.search(ln)
        if m and "====" not in ln:
            start = ln.rfind(", ", 0, m.start())
            keep.append(ln[start + 2 if start >= 0 else 0:].strip())
    return " | ".join(dict.fromkeys(keep)) or output.strip().splitlines()[-1]


def tensor_types(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """(tensor name -> GGML type name, a few keys) through the gguf package's reader, which
    shares no code with strata_rt's: the test checks our reader against it."""
    from gguf import GGMLQuantizationType, GGUFReader

    r = GGUFReader(str(path))
    types = {t.name: GGMLQuantizationType(int(t.tensor_type)).name for t in r.tensors}
    keys = {}
    for k in ("general.file_type", "general.quantization_version", "tokenizer.ggml.pre",
              "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"):
        if k in r.fields:
            v = r.fields[k].contents()
            keys[k] = v.item() if hasattr(v, "item") else v
    return types, keys


def _perplexity(bin_dir: Path, gguf: Path, eval_txt: Path, logs: Path) -> dict[str, Any]:
    """llama-perplexity's estimate for one file. Its log is written by a thread that the
    process does not always wait for at exit (exit status 0, the last lines missing: seen in
    about half the runs), so a run without the final estimate is repeated, up to 8 times."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", gguf.name, "-f", eval_txt.name, "-c",
           str(PPL_CTX), "-b", str(PPL_CTX), "-t", THREADS]
    runs = 0
    while True:
        runs += 1
        rc, secs, out = _run(cmd, logs / f"{gguf.stem}.perplexity.log", gguf.parent)
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
        if rc != 0 or m is not None or runs == 8:
            break
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if rc != 0 or m is None:
        return {"error": _refusal(out).replace(str(gguf.parent) + os.sep, ""),
                "seconds": round(secs, 1)}
    return {"ppl": float(m.group(1)), "plus_minus": float(m.group(2)), "ctx": PPL_CTX,
            "chunks": int(chunks.group(1)) if chunks else None, "seconds": round(secs, 1),
            "runs": runs}


def make_files(src: Path, bin_dir: Path, out: Path, work: Path, only: set[str] | None,
               extra: bool) -> None:
    for tool in ("llama-quantize", "llama-imatrix", "llama-perplexity"):
        if not (bin_dir / tool).is_file():
            raise SystemExit(f"{bin_dir / tool} is missing: build it in the llama.cpp tree "
                             "(see this script's doc)")
    converter = src / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise SystemExit(f"{converter} is missing: --llama-cpp must name a llama.cpp tree")
    out.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    files: dict[str, Any] = dict(old.get("files", {})) if only else {}
    refused: dict[str, Any] = dict(old.get("refused", {})) if only else {}
    timings: dict[str, float] = {}

    if not only:  # a whole run: no file of an earlier one may stay behind unlisted
        for stale in [*out.glob("*.gguf"), *out.glob("*.npz")]:
            stale.unlink()
    (out / "eval.txt").write_text(EVAL_TEXT, encoding="utf-8")
    (out / "calibration.txt").write_text(calibration_text(), encoding="utf-8")
    version = subprocess.run([str(bin_dir / "llama-perplexity"), "--version"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace").stdout.strip().splitlines()[-2:]

    t0 = time.monotonic()
    hf_dir = work / "hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    build_checkpoint(hf_dir)
    timings["checkpoint (save_pretrained)"] = round(time.monotonic() - t0, 1)

    def record(name: str, how: dict[str, Any]) -> None:
        path = out / f"{name}.gguf"
        types, keys = tensor_types(path)
        counts: dict[str, int] = {}
        for t in types.values():
            counts[t] = counts.get(t, 0) + 1
        files[name + ".gguf"] = {**how, "bytes": path.stat().st_size, "sha256": _sha256(path),
                                 "keys": keys, "type_counts": dict(sorted(counts.items())),
                                 "tensor_types": types}
        print(f"{name}.gguf: {path.stat().st_size / 1e6:.2f} MB, {counts}", flush=True)

    for name, outtype in {**CONVERTED, **(CONVERTED_EXTRA if extra else {})}.items():
        if only and name not in only and name != "F16":
            continue
        args = ["--outtype", outtype, "--outfile", str(out / f"{name}.gguf"), "--model-name",
                MODEL_NAME]
        rc, secs, text = _run([sys.executable, __file__, "convert", str(src), str(hf_dir),
                               *args], logs / f"{name}.convert.log")
        if rc != 0:
            raise SystemExit(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{text[-3000:]}")
        timings[f"convert {name}"] = round(secs, 1)
        record(name, {"made_by": "convert_hf_to_gguf.py",
                      "args": ["--outtype", outtype, "--model-name", MODEL_NAME],
                      "imatrix": False, "seconds": round(secs, 1)})

    imatrix = out / "imatrix.gguf"
    rc, secs, text = _run([str(bin_dir / "llama-imatrix"), "-m", "F16.gguf", "-f",
                           "calibration.txt", "-o", imatrix.name, "-c",
                           str(IMATRIX_CTX), "-b", str(IMATRIX_CTX), "-t", THREADS],
                          logs / "imatrix.log", out)
    if rc != 0:
        raise SystemExit(f"llama-imatrix failed:\n{text[-3000:]}")
    timings["llama-imatrix"] = round(secs, 1)

    for name, mix in {**MIXES, **(MIXES_EXTRA if extra else {})}.items():
        if only and name not in only:
            continue
        target = out / f"{name}.gguf"
        target.unlink(missing_ok=True)
        args = [*(["--imatrix", "imatrix.gguf"] if mix["imatrix"] else []), *mix["flags"]]
        cmd = [str(bin_dir / "llama-quantize"),
               *args, mix["from"], target.name, mix["type"], THREADS]
        rc, secs, text = _run(cmd, logs / f"{name}.quantize.log", out)
        how = {"made_by": "llama-quantize", "from": mix["from"],
               "args": [*args, mix["from"], f"{name}.gguf", mix["type"]],
               "imatrix": mix["imatrix"], "seconds": round(secs, 1)}
        if rc != 0 or not target.is_file():
            target.unlink(missing_ok=True)
            reason = _refusal(text).replace(f"{out}{os.sep}", "").replace(str(bin_dir), "bin")
            refused[name] = {**how, "reason": reason}
            files.pop(name + ".gguf", None)
            print(f"{name}: refused: {refused[name]['reason']}", flush=True)
            continue
        refused.pop(name, None)
        timings[f"quantize {name}"] = round(secs, 1)
        record(name, how)

    for fname, entry in files.items():
        if only and Path(fname).stem not in only and "llama_perplexity" in entry:
            continue
        entry["llama_perplexity"] = _perplexity(bin_dir, out / fname, out / "eval.txt", logs)
        timings[f"perplexity {fname}"] = entry["llama_perplexity"]["seconds"]

    manifest = {
        "generated": datetime.date.today().isoformat(),
        "how": "tests/tools/make_ggml_fixtures.py files (see its doc)",
        "llama.cpp": version, "versions": _versions("torch", "transformers", "numpy", "gguf"),
        "model": {"spec": SPEC, "seed": SEED, "weights": "strata_rt Qwen3Model.synthetic, fp16 "
                  "experts, float32 dense (saved as float32 safetensors)",
                  "tokenizer": f"strata_rt synthetic_vocab({SPEC['vocab']})"},
        "imatrix": {"file": "imatrix.gguf", "text": "calibration.txt", "ctx": IMATRIX_CTX,
                    "bytes": imatrix.stat().st_size, "sha256": _sha256(imatrix)},
        "perplexity": {"text": "eval.txt", "ctx": PPL_CTX, "batch": PPL_CTX},
        "files": dict(sorted(files.items())), "refused": dict(sorted(refused.items())),
        "timings_s": {**old.get("timings_s", {}), **timings} if only else timings,
        "goldens": old.get("goldens", {}),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {manifest_path}: {len(files)} files, {len(refused)} refused; the folder "
          f"holds {total / 1e6:.1f} MB")


def convert_shim(src: Path, argv: list[str]) -> None:
    """Runs convert_hf_to_gguf.py in this process after wrapping its pre-tokenizer lookup: the
    lookup's own answer stands; only where it finds no entry (our vocabulary's hash is in no
    table) does it answer "qwen2", the name the converter gives Qwen2/Qwen3 tokenizers, so
    llama.cpp and the engine apply Qwen's pre-tokenizer regex."""
    import runpy

    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import conversion.base as base  # llama.cpp's converter package

    own = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return own(self, tokenizer)
        except NotImplementedError:
            return "qwen2"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


# ---------------------------------------------------------------------------- step 2: goldens
def load_transformers(folder: Path, fname: str):
    """transformers' model and tokenizer for one fixture, built by its GGUF loader. Its key
    table for qwen3_moe has no entry for expert_feed_forward_length, so the config it builds
    keeps Qwen3MoeConfig's default moe_intermediate_size (768) and the load stops on a shape
    mismatch; the config is therefore read first, that one value set from the file's key, and
    passed back in. Every weight still comes from the file, dequantized by the gguf package."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, Qwen3MoeForCausalLM

    r = GGUFReader(str(folder / fname))
    ffn = int(r.fields["qwen3moe.expert_feed_forward_length"].contents())
    del r
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    config.moe_intermediate_size = ffn
    model = Qwen3MoeForCausalLM.from_pretrained(folder, gguf_file=fname, config=config,
                                                dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # the grouped kernels take no float64
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=fname)


def prompt_ids(tokenizer) -> dict[str, np.ndarray]:
    out = {}
    for name, (text, n) in PROMPTS.items():
        ids = tokenizer.encode(EVAL_TEXT if text is None else text, add_special_tokens=False)
        if n is not None:
            if len(ids) < n:
                raise SystemExit(f"prompt {name} gives {len(ids)} tokens, fewer than {n}")
            ids = ids[:n]
        out[name] = np.asarray(ids, np.int32)
    return out


def _margins(l64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    top2 = np.sort(l64, axis=-1)[:, -2:]
    return np.argmax(l64, axis=-1).astype(np.int32), top2[:, 1] - top2[:, 0]


def perplexity_nll(model, ids: np.ndarray, ctx: int) -> np.ndarray:
    """Per chunk, the summed negative log-likelihood in llama-perplexity's scheme: the text's
    ids cut into whole chunks of `ctx` (the rest dropped), each chunk run alone from an empty
    cache, and the tokens after the first half predicted: positions ctx/2 .. ctx-2 predict
    ctx/2+1 .. ctx-1. Qwen's vocabulary adds no BOS, so no token is replaced. Float32 logits,
    float64 log-softmax."""
    import torch

    first = ctx // 2
    out = []
    for c in range(len(ids) // ctx):
        chunk = torch.from_numpy(ids[c * ctx:(c + 1) * ctx].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(chunk).logits[0].to(torch.float64)
        lp = torch.log_softmax(logits[first:ctx - 1], dim=-1)
        target = chunk[0, first + 1:ctx]
        out.append(-float(lp.gather(1, target[:, None]).sum()))
    return np.asarray(out, np.float64)


def golden_arrays(model, ids: dict[str, np.ndarray], ppl_ids: np.ndarray) -> dict[str, Any]:
    """Everything a comparison needs for one file (see the module doc), as npz entries."""
    import torch
    from make_routing_golden import record_router_logits, route_gap

    router_logits = record_router_logits(model)
    arrays: dict[str, Any] = {}
    for name, p in ids.items():
        x = torch.from_numpy(p.astype(np.int64))[None]
        with torch.no_grad():
            logits = model(x).logits[0].to(torch.float32).numpy()
            model.to(torch.float64)
            router_logits.clear()
            l64 = model(x).logits[0].numpy()
            model.to(torch.float32)
        arrays[f"ids_{name}"] = p
        arrays[f"logits_{name}"] = logits
        arrays[f"argmax64_{name}"], arrays[f"margin64_{name}"] = _margins(l64)
        arrays[f"route_gap64_{name}"] = route_gap(router_logits, model.config.num_experts_per_tok)
        router_logits.clear()
    prompt = torch.from_numpy(ids[GREEDY_PROMPT].astype(np.int64))[None]
    with torch.no_grad():
        gen = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                             min_new_tokens=GREEDY_TOKENS, eos_token_id=None, pad_token_id=0)
        n = prompt.shape[1]
        model.to(torch.float64)
        l64 = model(gen[:, :-1]).logits[0, n - 1:].numpy()
        model.to(torch.float32)
    arrays["greedy"] = gen[0, n:].numpy().astype(np.int32)
    arrays["greedy_argmax64"], arrays["greedy_margin64"] = _margins(l64)
    nll = perplexity_nll(model, ppl_ids, PPL_CTX)
    arrays["ppl_ids"] = ppl_ids
    arrays["ppl_nll"] = nll
    arrays["ppl"] = np.float64(np.exp(nll.sum() / (len(nll) * (PPL_CTX - PPL_CTX // 2 - 1))))
    return arrays


def make_goldens(out: Path, only: set[str] | None) -> None:
    import torch

    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    goldens = dict(manifest.get("goldens", {})) if only else {}
    reference: dict[str, np.ndarray] | None = None
    for fname in manifest["files"]:
        stem = Path(fname).stem
        if only and stem not in only:
            continue
        t0 = time.monotonic()
        try:
            model, tok = load_transformers(out, fname)
        except Exception as e:  # a type transformers or the gguf package cannot read
            goldens[fname] = {"loaded": False, "reason": f"{type(e).__name__}: {e}"[:2000]}
            (out / f"{stem}.npz").unlink(missing_ok=True)
            print(f"{fname}: transformers cannot load it: {goldens[fname]['reason']}")
            continue
        ids = prompt_ids(tok)
        if reference is None:
            reference = ids
        for k, v in ids.items():  # one tokenizer for all files: the same ids
            if not np.array_equal(v, reference[k]):
                raise SystemExit(f"{fname}: prompt {k} tokenizes differently from the first "
                                 f"file: {v.tolist()} vs {reference[k].tolist()}")
        ppl_ids = np.asarray(tok.encode(EVAL_TEXT, add_special_tokens=True), np.int32)
        arrays = golden_arrays(model, ids, ppl_ids)
        np.savez_compressed(out / f"{stem}.npz", **arrays)
        secs = time.monotonic() - t0
        llama_ppl = manifest["files"][fname].get("llama_perplexity", {}).get("ppl")
        goldens[fname] = {"loaded": True, "npz": f"{stem}.npz", "ppl": float(arrays["ppl"]),
                          "llama_perplexity_ppl": llama_ppl, "seconds": round(secs, 1),
                          "greedy_min_margin64": float(arrays["greedy_margin64"].min())}
        print(f"{fname}: ppl {float(arrays['ppl']):.4f} (llama-perplexity {llama_ppl}), "
              f"greedy {arrays['greedy'].tolist()}, {secs:.1f} s", flush=True)
        del model
    manifest["goldens"] = dict(sorted(goldens.items()))
    manifest["golden_versions"] = {**_versions("torch", "transformers", "numpy", "gguf",
                                               "accelerate"),
                                   "torch_threads": torch.get_num_threads()}
    manifest["golden_notes"] = (
        "Qwen3MoeForCausalLM.from_pretrained(folder, gguf_file=...) in float32 on the CPU, with "
        "one config value set from the file (transformers' GGUF key table for qwen3_moe does not "
        "map expert_feed_forward_length, so moe_intermediate_size would stay at its default 768)")
    manifest["golden_prompts"] = {k: {"text": "eval.txt" if t is None else t, "tokens": n}
                                  for k, (t, n) in PROMPTS.items()}
    manifest["greedy"] = {"prompt": GREEDY_PROMPT, "tokens": GREEDY_TOKENS}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote goldens for {sum(g['loaded'] for g in goldens.values())} of {len(goldens)} "
          "files")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "convert":  # the converter shim, in a child
        convert_shim(Path(sys.argv[2]), sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("files", "goldens", "all"))
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP"),
                    help="a llama.cpp source tree (default: $LLAMA_CPP)")
    ap.add_argument("--bin", type=Path, default=None,
                    help="where its built tools are (default: LLAMA_CPP/build/bin)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch folder for the checkpoint and the tools' logs "
                         "(default: a temporary one)")
    ap.add_argument("--only", default=None, help="comma-separated file stems to redo")
    ap.add_argument("--extra", action="store_true",
                    help="files: also the mixes of CONVERTED_EXTRA and MIXES_EXTRA")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    args.out = args.out.resolve()
    if args.step in ("files", "all"):
        if args.llama_cpp is None:
            raise SystemExit("files: give --llama-cpp DIR or set LLAMA_CPP to a llama.cpp tree")
        src = args.llama_cpp.resolve()
        bin_dir = (args.bin or src / "build" / "bin").resolve()
        if args.work is not None:
            args.work.mkdir(parents=True, exist_ok=True)
            make_files(src, bin_dir, args.out, args.work.resolve(), only, args.extra)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                make_files(src, bin_dir, args.out, Path(tmp), only, args.extra)
    if args.step in ("goldens", "all"):
        make_goldens(args.out, only)


if __name__ == "__main__":
    main()
