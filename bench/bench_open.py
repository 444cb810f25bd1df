"""How long a whole-model GGUF with a Qwen3-sized tokenizer (151,936 tokens, 151,387 merges)
takes to open, phase by phase.

    python bench/bench_open.py [--dir DIR] [--gguf-reader] [--json PATH]

Writes (once, kept in --dir, default a temporary folder) a one-layer Qwen3-MoE GGUF whose
vocabulary is strata_rt.text.large_vocab's (embedding of 151,936 rows, tied output, F16),
then measures in a fresh process, so no header is kept from the writing:

  header       open_reader: the header walk, the tensor list and key checks
  tokenizer arrays   TokenizerVocab.from_gguf on the header just opened (tokens, merges,
               token types decoded from one buffer each)
  tokenizer build    Tokenizer(vocab): the `tokenizers` BPE model and the added tokens
  model        read_qwen3_gguf (dense weights mapped and checked for NaN/Inf, experts loaded)
               on the same header
  engine       Engine.open on the reference backend plus engine.tokenizer() in the same
               process again, what `strata generate` does before its prefill (the header
               and the tokenizer are read once: the model's parse is the tokenizer's)

--gguf-reader also times the gguf package's GGUFReader on the file and the decoding of its
tokens and merges field by field (what a reader built on it pays).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf  # noqa: E402
from strata_rt.text.large_vocab import QWEN3_MERGES, QWEN3_TOKENS, large_vocab  # noqa: E402

SPEC = Qwen3Spec(n_layers=1, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64,
                 vocab=QWEN3_TOKENS, ffn=256, n_experts=4, top_k=2, context=512)
FILE = "qwen3-vocab-1layer.gguf"


def write_file(folder: Path) -> Path:
    path = folder / FILE
    if path.is_file():
        return path
    t0 = time.perf_counter()
    vocab = large_vocab(QWEN3_TOKENS, QWEN3_MERGES)
    model = Qwen3Model.synthetic(SPEC, 0, "fp16", tied=True, dense_type="F16")
    write_qwen3_gguf(path, model, tokenizer=vocab)
    print(f"wrote {path} ({path.stat().st_size / 2**20:,.1f} MiB) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def measure(path: Path, gguf_reader: bool) -> dict[str, float]:
    """The phases (module doc), seconds each; run in a fresh process."""
    from strata_rt.engine import Engine
    from strata_rt.models.qwen3 import read_qwen3_gguf
    from strata_rt.text.tokenizer import Tokenizer
    from strata_rt.text.tokenizer_vocab import TokenizerVocab
    from strata_rt.weights.gguf_file import gguf_io

    out: dict[str, float] = {}

    def phase(name: str, fn):
        t0 = time.perf_counter()
        value = fn()
        out[name] = time.perf_counter() - t0
        return value

    phase("header", lambda: gguf_io.open_reader(path))
    vocab = phase("tokenizer arrays", lambda: TokenizerVocab.from_gguf(path))
    tok = phase("tokenizer build", lambda: Tokenizer(vocab))
    assert len(tok) == QWEN3_TOKENS and len(vocab.merges) == QWEN3_MERGES
    phase("model", lambda: read_qwen3_gguf(path, "fp16"))
    out["header + tokenizer"] = sum(out[k] for k in ("header", "tokenizer arrays",
                                                     "tokenizer build"))
    gguf_io._OPENED.clear()  # the engine phase starts from the file, as a new process does

    def engine() -> None:
        with Engine.open({"model": {"gguf": str(path), "format": "fp16"},
                          "backend": "reference"}) as e:
            e.tokenizer().encode("The experts stream while the others compute.")

    phase("engine + tokenizer", engine)
    if gguf_reader:
        from gguf import GGUFReader

        reader = phase("gguf package: GGUFReader", lambda: GGUFReader(str(path)))

        def strings() -> None:
            for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
                f = reader.fields[key]
                [bytes(f.parts[i]).decode() for i in f.data]

        phase("gguf package: decode tokens and merges", strings)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="where the file is written (kept)")
    ap.add_argument("--gguf-reader", action="store_true", help="also time gguf's GGUFReader")
    ap.add_argument("--json", type=Path, help="write the phases here")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's part
    args = ap.parse_args()
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.gguf_reader)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        path = write_file(folder)
        child = subprocess.run([sys.executable, __file__, "--measure", str(path),
                                *(["--gguf-reader"] if args.gguf_reader else [])],
                               capture_output=True, text=True, check=False)
    if child.returncode != 0:
        print(child.stderr, file=sys.stderr)
        return 1
    phases = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{QWEN3_TOKENS:,} tokens, {QWEN3_MERGES:,} merges (one fresh process):")
    width = max(map(len, phases))
    for name, s in phases.items():
        print(f"  {name.ljust(width)}  {s:7.3f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({"tokens": QWEN3_TOKENS, "merges": QWEN3_MERGES,
                                         "seconds": phases}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
