"""Regenerates tests/fixtures/tokenizer/: Hugging Face's token ids for strata_rt's synthetic
vocabulary on a corpus of awkward text.

Two steps, in two environments, so the expected ids come from code that shares nothing with
strata_rt:

1. `vocab` (the repository's environment) writes the synthetic vocabulary of
   strata_rt.text.tokenizer_vocab.synthetic_vocab(1024) as a Hugging Face tokenizer folder
   (hf/vocab.json, hf/merges.txt, hf/tokenizer_config.json with the added tokens at their ids)
   and as a tokenizer-only GGUF (tokenizer.gguf):

       .venv/bin/python tests/tools/make_tokenizer_fixtures.py vocab

2. `ids` (a separate environment with transformers, no strata_rt) encodes the corpus with
   every Qwen2 tokenizer transformers offers: with transformers 4.x the pure-Python
   `Qwen2Tokenizer` (the `regex` module and a Python BPE loop; no `tokenizers` code) and
   `Qwen2TokenizerFast`, with 5.x its `Qwen2Tokenizer`; and, where transformers' GGUF loading
   takes the file (it needs torch and gguf), the tokenizer it builds from tokenizer.gguf. All
   must agree; their ids are written to expected.json and the library versions to
   versions.json:

       python3 -m venv /tmp/tokenv && /tmp/tokenv/bin/pip install 'transformers<5' gguf
       /tmp/tokenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
       /tmp/tokenv/bin/python tests/tools/make_tokenizer_fixtures.py ids
       # another version against the stored ids, writing nothing:
       /tmp/tokenv5/bin/python tests/tools/make_tokenizer_fixtures.py ids --check
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizer"
N_VOCAB = 1024

#: what the ids are compared on: every kind of text a pre-tokenizer or BPE can get wrong
CORPUS = [
    "",
    "Hello world",
    "Hello, World! How are you today?",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'LL we've they'RE she's it'd you'm",
    "ALL CAPS and MiXeD cAsE words",
    "   three leading spaces",
    "two  spaces   three    four",
    "tabs\there\t\tand\t\t\tmore",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    " \n \t \r\n  mixed whitespace runs \t\n",
    "\n\n\n",
    "    ",
    "1234567890",
    "Prompts of 128, 256, 512, 1,024, 2,048, 4,096, 8,192 and 9,200 tokens.",
    "pi = 3.14159265358979; e=2.718; -42; +7; 1e-5; 0x1F; 1_000_000",
    "2024-06-01T10:45:00Z and $3.50 (12% off)",
    "模型读取提示并把它分成词元。",
    "大型语言模型的推理速度取决于内存带宽和计算能力",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장도 있습니다.",
    "Mixed 中文 and English 文字 together",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇯🇵 👨‍👩‍👧‍👦",
    "😀😀😀",
    "Ünïcödé àccents: café, naïve, résumé, Straße, Ærøskøbing",
    "composed e\u0301 vs \u00e9, A\u030a vs \u00c5",
    "Кириллица и ελληνικά και العربية",
    "def prefill(model, ids, chunk=8192):\n    state = model.start()\n    for i in range(0, "
    "len(ids), chunk):\n        state = model.forward(ids[i:i + chunk], state)\n    return "
    "state\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "if (x != y && z >= 0) { y <<= 2; } // comment /* block */",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "What is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "text<|endoftext|>more text",
    " <|im_end|> spaced <|im_start|> ",
    "<think>\nreasoning here\n</think>\n\nThe answer is 4.",
    "<|im_start|>user\n你好 🎉<|im_end|>",
    "<|im_start",
    "<|not_a_token|> <im_start> |>",
    "!!!??? ... --- *** ### @@@ ~~~",
    "a" * 64,
    "\u00a0non-breaking\u2003em space\u200bzero width",
]


def write_hf_tokenizer(v: Any, hf: Path) -> tuple[int, int]:
    """Writes a synthetic vocabulary as a Hugging Face Qwen2 tokenizer folder (vocab.json,
    merges.txt, tokenizer_config.json with the added tokens at their ids); (BPE tokens, added
    tokens). make_ggml_fixtures.py writes its checkpoints' tokenizers with it too."""
    sys.path.insert(0, str(ROOT))
    from strata_rt.text.tokenizer_vocab import CONTROL, NORMAL, USER_DEFINED

    hf.mkdir(parents=True, exist_ok=True)
    normal = {t: i for i, (t, k) in enumerate(zip(v.tokens, v.token_type)) if k == NORMAL}
    (hf / "vocab.json").write_text(json.dumps(normal, ensure_ascii=False, indent=0) + "\n",
                                   encoding="utf-8")
    (hf / "merges.txt").write_text("#version: 0.2\n" + "\n".join(v.merges) + "\n",
                                   encoding="utf-8")
    added = {str(i): {"content": v.tokens[i], "special": v.token_type[i] == CONTROL,
                      "normalized": False, "lstrip": False, "rstrip": False,
                      "single_word": False}
             for i in v.ids_of_type(CONTROL, USER_DEFINED)}
    eos = v.tokens[v.eos_token_id] if v.eos_token_id is not None else None
    pad = v.tokens[v.padding_token_id] if v.padding_token_id is not None else None
    config = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
              "additional_special_tokens": [v.tokens[i] for i in v.ids_of_type(CONTROL)
                                            if v.tokens[i] not in (eos, pad)],
              "bos_token": None, "eos_token": eos, "pad_token": pad, "unk_token": None,
              "errors": "replace", "clean_up_tokenization_spaces": False,
              "model_max_length": 32768, "split_special_tokens": False}
    (hf / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1)
                                              + "\n", encoding="utf-8")
    return len(normal), len(added)


def write_vocab() -> None:
    sys.path.insert(0, str(ROOT))
    from strata_rt.text.tokenizer_vocab import synthetic_vocab, write_tokenizer_gguf

    v = synthetic_vocab(N_VOCAB)
    hf = OUT / "hf"
    n_normal, n_added = write_hf_tokenizer(v, hf)
    write_tokenizer_gguf(OUT / "tokenizer.gguf", v, keys={
        "general.name": "strata_rt synthetic tokenizer", "qwen3moe.vocab_size": N_VOCAB})
    print(f"wrote {hf} ({n_normal} BPE tokens, {len(v.merges)} merges, {n_added} added) "
          f"and {OUT / 'tokenizer.gguf'} ({N_VOCAB} tokens)")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _tokenizers() -> dict[str, Any]:
    import transformers

    hf = str(OUT / "hf")
    out: dict[str, Any] = {}
    slow = transformers.Qwen2Tokenizer
    if int(transformers.__version__.split(".")[0]) < 5:  # 4.x: slow and fast
        out["Qwen2Tokenizer (pure Python)"] = slow.from_pretrained(hf)
        out["Qwen2TokenizerFast"] = transformers.Qwen2TokenizerFast.from_pretrained(hf)
    else:  # 5.x: one class, on the tokenizers library
        out["Qwen2Tokenizer"] = slow.from_pretrained(hf)
    try:
        with tempfile.TemporaryDirectory() as d:
            gguf = Path(d) / "tokenizer.gguf"
            gguf.write_bytes((OUT / "tokenizer.gguf").read_bytes())
            out[GGUF_LOADED] = transformers.AutoTokenizer.from_pretrained(
                d, gguf_file=gguf.name)
    except Exception as e:  # GGUF loading is optional: needs the gguf package and the arch
        print(f"transformers' GGUF loading not used: {type(e).__name__}: {e}")
    return out


#: texts a tokenizer is known to get wrong, and why (they are left out of its comparison)
GGUF_LOADED = "AutoTokenizer(gguf_file=)"
KNOWN_GAPS = {GGUF_LOADED: ("<think>", "transformers' GGUFQwen2Converter adds only Qwen's three "
                            "control tokens as added tokens, not user-defined ones such as "
                            "<think> (tokenizer_config.json and llama.cpp match them)")}


def write_ids(check: bool) -> int:
    toks = _tokenizers()
    cases = []
    bad = 0
    for text in CORPUS:
        got = {name: list(t.encode(text, add_special_tokens=False)) for name, t in toks.items()
               if name not in KNOWN_GAPS or KNOWN_GAPS[name][0] not in text}
        first = next(iter(got.values()))
        for name, ids in got.items():
            if ids != first:
                bad += 1
                print(f"DISAGREE on {text!r}:\n  {next(iter(got))}: {first}\n  {name}: {ids}")
        cases.append({"text": text, "ids": first})
    versions: dict[str, Any] = {"python": platform.python_version(),
                                "checked_with": sorted(toks)}
    gaps = {n: KNOWN_GAPS[n] for n in toks if n in KNOWN_GAPS}
    if gaps:
        versions["known_gaps"] = {n: f"texts with {w} left out: {why}"
                                  for n, (w, why) in gaps.items()}
    versions.update({n: _version(n) for n in ("transformers", "tokenizers", "regex", "gguf")})
    if check:
        stored = json.loads((OUT / "expected.json").read_text(encoding="utf-8"))["cases"]
        for want, have in zip(stored, cases):
            if want != have:
                bad += 1
                print(f"DIFFERS from the fixture on {want['text']!r}:\n  stored: "
                      f"{want['ids']}\n  now:    {have['ids']}")
        if len(stored) != len(cases):
            bad += 1
            print(f"the fixture holds {len(stored)} cases, the corpus {len(cases)}")
        print(f"{len(cases)} cases, {bad} differences ({json.dumps(versions)})")
        return 1 if bad else 0
    if bad:
        return 1
    lines = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    (OUT / "expected.json").write_text(f'{{"n_vocab": {N_VOCAB}, "cases": [\n{lines}\n]}}\n',
                                       encoding="utf-8")
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases, checked with {', '.join(sorted(toks))}; {versions}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=("vocab", "ids"))
    ap.add_argument("--check", action="store_true",
                    help="ids: compare with the stored expected.json instead of writing it")
    a = ap.parse_args()
    if a.step == "vocab":
        write_vocab()
        return 0
    return write_ids(a.check)


if __name__ == "__main__":
    sys.exit(main())
