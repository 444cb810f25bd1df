"""Hostile keys of a whole-model GGUF: RoPE theta, head layout, context, vocabulary and the
tokenizer's keys. Each is refused when the model opens (not at the first bad id after a
prefill), as one GGUFError naming the file and the key, exit code 1 from `strata inspect` and
`strata run`, no traceback."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from strata_rt.cli import main
from strata_rt.errors import GGUFError
from strata_rt.models.qwen3 import (
    TINY_SPEC,
    Qwen3Model,
    read_qwen3_gguf,
    read_qwen3_spec,
    write_qwen3_gguf,
)
from strata_rt.text.tokenizer_vocab import TokenizerVocab, synthetic_vocab
from strata_rt.weights.gguf_file.gguf_header import ARRAY, STRING
from tests._gguf_bytes import BOOL, F32, I32, U8, U32, Doc

A = "qwen3moe."
T = "tokenizer.ggml."


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(TINY_SPEC, 1, "fp16")


@pytest.fixture(scope="module")
def doc(tmp_path_factory, model) -> Doc:
    path = write_qwen3_gguf(tmp_path_factory.mktemp("whole") / "m.gguf", model,
                            keys=synthetic_vocab(TINY_SPEC.vocab).gguf_keys())
    return Doc.of(path)


def key(name: str, t: int, v=None, elem=None) -> Callable[[Doc], Doc]:
    return lambda d: d.set(name, t, v, elem)


THETA = A + "rope.freq_base"
CASES: dict[str, tuple[Callable[[Doc], Doc], str]] = {
    "rope theta +inf": (key(THETA, F32, math.inf),
                        f"key {THETA} = inf (float32); expected a finite number (1, 1e+12]"),
    "rope theta NaN": (key(THETA, F32, math.nan), f"key {THETA} = nan (float32)"),
    "rope theta 0.5": (key(THETA, F32, 0.5), f"key {THETA} = 0.5 (float32)"),
    "rope theta negative": (key(THETA, F32, -1e6), f"key {THETA} = -1000000.0 (float32)"),
    "rope theta string": (key(THETA, STRING, "1e6"), f"key {THETA} = '1e6' (string)"),
    "head_count string": (key(A + "attention.head_count", STRING, "4"),
                          "key qwen3moe.attention.head_count = '4' (string); expected an "
                          "integer 1..4,096"),
    "head_count_kv zero": (key(A + "attention.head_count_kv", U32, 0),
                           "head_count_kv = 0 (uint32)"),
    "key_length array": (key(A + "attention.key_length", ARRAY, [64], U32),
                         "key_length = an array of uint32 (1 value)"),
    "context 0": (key(A + "context_length", U32, 0), "context_length = 0 (uint32)"),
    "context float": (key(A + "context_length", F32, 4096.0),
                      "context_length = 4096.0 (float32); expected an integer"),
    "vocab_size string": (key(A + "vocab_size", STRING, "512"), "vocab_size = '512' (string)"),
    "vocab_size unlike the embedding": (key(A + "vocab_size", U32, 513),
                                        "key qwen3moe.vocab_size = 513 but tensor "
                                        "token_embd.weight holds 512 rows"),
    "rope dims unlike the heads": (key(A + "rope.dimension_count", U32, 32),
                                   "key qwen3moe.rope.dimension_count = 32 but heads have 64 "
                                   "dims"),
    "shared experts": (key(A + "expert_shared_count", U32, 2),
                       "expert_shared_count = 2 (uint32); expected the integer 0 (strata_rt "
                       "runs no shared expert)"),
    "rope scaling yarn": (key(A + "rope.scaling.type", STRING, "yarn"),
                          "key qwen3moe.rope.scaling.type = 'yarn'; strata_rt runs plain RoPE"),
    "rope scale_linear": (key(A + "rope.scale_linear", F32, 0.25),
                          "key qwen3moe.rope.scale_linear = 0.25; strata_rt runs plain RoPE"),
    "top-k weights not renormalised": (key(A + "expert_weights_norm", BOOL, False),
                                       "key qwen3moe.expert_weights_norm = False"),
    "sigmoid gating": (key(A + "expert_gating_func", U32, 2),
                       "expert_gating_func = 2 (uint32); expected the integer 1"),
    "chat template uint32": (key("tokenizer.chat_template", U32, 7),
                             "key tokenizer.chat_template = 7 (uint32); expected a string"),
    "tokens not strings": (key(T + "tokens", ARRAY, list(range(512)), I32),
                           f"key {T}tokens = an array of int32 (512 values); expected an "
                           "array of strings"),
    "token types strings": (key(T + "token_type", ARRAY, ["1"] * 512, STRING),
                            f"key {T}token_type = an array of string"),
    "bos id string": (key(T + "bos_token_id", STRING, "0"), f"key {T}bos_token_id = '0'"),
    "add_bos_token uint8": (key(T + "add_bos_token", U8, 1),
                            f"key {T}add_bos_token = 1 (uint8); expected a bool"),
    "tokenizer model uint32": (key(T + "model", U32, 2), f"key {T}model = 2 (uint32)"),
    "more tokens than embedding rows": (
        lambda d: d.set(T + "tokens", ARRAY, [f"t{i}" for i in range(600)], STRING),
        f"key {T}tokens holds 600 tokens but tensor token_embd.weight has 512 rows"),
    "fewer tokens than embedding rows": (
        lambda d: d.set(T + "tokens", ARRAY, [f"t{i}" for i in range(500)], STRING),
        f"key {T}tokens holds 500 tokens but tensor token_embd.weight has 512 rows"),
}


def poke(name: str, at: int, data: bytes) -> Callable[[Doc], Doc]:
    """Bytes written `at` bytes into tensor `name`'s data."""
    def change(d: Doc) -> Doc:
        lo = d.tensor(name)[3] + at
        d.data = d.data[:lo] + data + d.data[lo + len(data):]
        return d
    return change


NAN32 = struct.pack("<f", math.nan)
ROW = TINY_SPEC.hidden * 4  # bytes of one F32 row of a [.., hidden] matrix
#: NaN/Inf in dense weights: the keys are fine (read_qwen3_spec opens the file), the load fails
VALUES: dict[str, tuple[Callable[[Doc], Doc], str]] = {
    "NaN in an embedding row": (poke("token_embd.weight", 7 * ROW + 12, NAN32),
                                "tensor token_embd.weight: NaN or Inf in the weights of 1 "
                                "row(s): row 7 (1 of 256)"),
    "Inf in attn_q": (poke("blk.1.attn_q.weight", 3 * ROW, struct.pack("<f", math.inf)),
                      "tensor blk.1.attn_q.weight: NaN or Inf in the weights of 1 row(s): "
                      "row 3"),
    "NaN in the output norm": (poke("output_norm.weight", 40, NAN32),
                               "tensor output_norm.weight: NaN or Inf in the weights of 1 "
                               "row(s): row 0 (1 of 256)"),
}


def hostile(doc: Doc, tmp_path: Path, case: str) -> tuple[Path, str]:
    change, want = {**CASES, **VALUES}[case]
    return change(doc.copy()).write(tmp_path / "bad.gguf"), want


def cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_refuses_at_open(doc, tmp_path, case):
    path, want = hostile(doc, tmp_path, case)
    with pytest.raises(GGUFError) as e:
        read_qwen3_spec(path)
    assert str(e.value).startswith(f"{path}: ") and want in str(e.value), str(e.value)
    with pytest.raises(GGUFError, match="^" + str(path).replace(".", r"\.")):
        read_qwen3_gguf(path, "fp16")


@pytest.mark.parametrize("case", sorted(VALUES))
def test_nan_in_dense_weights_is_refused_at_load(doc, tmp_path, case):
    path, want = hostile(doc, tmp_path, case)
    assert read_qwen3_spec(path)[0] == TINY_SPEC
    with pytest.raises(GGUFError) as e:
        read_qwen3_gguf(path, "fp16")
    assert str(e.value).startswith(f"{path}: ") and want in str(e.value), str(e.value)


def test_nan_in_a_quantized_dense_scale_names_the_row(tmp_path, model):
    q8 = model.with_dense_types({"attn_v": "Q8_0"})
    d = Doc.of(write_qwen3_gguf(tmp_path / "q.gguf", q8))
    row = TINY_SPEC.hidden // 32 * 34  # Q8_0: 34-byte blocks of 32 values
    path = poke("blk.0.attn_v.weight", 5 * row, struct.pack("<e", math.nan))(d).write(
        tmp_path / "bad.gguf")
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.attn_v\.weight: NaN or Inf in the "
                                        r"fp16 block scale d of 1 row\(s\): row 5 \(1 of 8\)"):
        read_qwen3_gguf(path, "fp16")


@pytest.mark.parametrize("case", sorted(CASES) + sorted(VALUES))
def test_inspect_and_run_exit_1(doc, tmp_path, capsys, case):
    path, want = hostile(doc, tmp_path, case)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and f"strata inspect: {path}: " in err and want in err, err
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"gguf": str(path)}, "format": "fp16",
                                   "backend": "reference", "expert_cache": 0,
                                   "prompts": [3]}))
    code, err = cli(["run", str(cfg)], capsys)
    assert code == 1 and err.startswith(f"strata run: {path}: ") and want in err, err


@pytest.mark.parametrize("case", ["tokens not strings", "bos id string",
                                  "add_bos_token uint8", "tokenizer model uint32"])
def test_the_tokenizer_refuses_its_keys_of_the_wrong_type(doc, tmp_path, case):
    path, want = hostile(doc, tmp_path, case)
    with pytest.raises(GGUFError) as e:
        TokenizerVocab.from_gguf(path)
    assert str(e.value).startswith(f"{path}: ") and want in str(e.value)


def test_the_good_file_opens(doc, tmp_path, model):
    """With the keys a downloaded file may carry at their harmless values, too."""
    d = doc.copy().set(A + "rope.scaling.type", STRING, "none")
    d.set(A + "expert_weights_norm", BOOL, True).set(A + "rope.dimension_count", U32, 64)
    d.set(A + "expert_gating_func", U32, 1).set("tokenizer.chat_template", STRING, "{{x}}")
    path = d.write(tmp_path / "good.gguf")
    assert read_qwen3_spec(path) == (TINY_SPEC, False)
    assert len(TokenizerVocab.from_gguf(path)) == TINY_SPEC.vocab
    assert read_qwen3_gguf(path, "fp16").digest() == model.digest()


# ---------------------------------------------------------------------------- the tokenizer
def tokens(change: Callable[[list], object]) -> Callable[[Doc], Doc]:
    """The token list (as bytes) changed in place by `change`."""
    def apply(d: Doc) -> Doc:
        toks = [t.encode() for t in synthetic_vocab(TINY_SPEC.vocab).tokens]
        change(toks)
        return d.set(T + "tokens", ARRAY, toks, STRING)
    return apply


def merges(first: str) -> Callable[[Doc], Doc]:
    return lambda d: d.set(T + "merges", ARRAY,
                           [first, *synthetic_vocab(TINY_SPEC.vocab).merges[1:]], STRING)


#: what `generate` refuses when it builds the tokenizer (and `run` does, to print text): the
#: keys are of the right types and counts, so only building the tokenizer finds these
TOKENIZER: dict[str, tuple[Callable[[Doc], Doc], str]] = {
    "a token not UTF-8": (tokens(lambda t: t.__setitem__(7, b"\xff\xfe")),
                          f"key {T}tokens: string 7 is not valid UTF-8 (b'\\xff\\xfe')"),
    "a token twice": (tokens(lambda t: t.__setitem__(101, t[100])),
                      "token '§' appears twice in the vocabulary (ids 100 and 101)"),
    "a merge of two tokens and a half": (merges("a b c"),
                                         "merge 0 is 'a b c'; a merge is two tokens joined by "
                                         "one space"),
    "a NUL in the pre-tokenizer's name": (key(T + "pre", STRING, "qwen2\0"),
                                          f"{T}pre = 'qwen2\\x00' is a pre-tokenizer strata_rt "
                                          "does not know"),
    "a pre-tokenizer name of a megabyte": (key(T + "pre", STRING, "q" * 1_000_000),
                                           f"{T}pre = '{'q' * 60}'... (1,000,000 characters) "
                                           "is a pre-tokenizer strata_rt does not know"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER))
def test_inspect_builds_the_tokenizer_generate_would(doc, tmp_path, capsys, case):
    from strata_rt.text.tokenizer import Tokenizer, TokenizerError

    change, want = TOKENIZER[case]
    path = change(doc.copy()).write(tmp_path / "bad.gguf")
    assert read_qwen3_spec(path)[0] == TINY_SPEC  # the keys themselves pass
    with pytest.raises((GGUFError, TokenizerError)) as e:
        Tokenizer.from_gguf(path)
    assert str(e.value).startswith(f"{path}: ") and want in str(e.value), str(e.value)
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and err.startswith(f"strata inspect: {path}: ") and want in err, err
    assert "\0" not in err and len(err) < 2000


def test_inspect_names_the_tokenizer_it_built(doc, tmp_path, capsys):
    assert main(["inspect", str(doc.copy().write(tmp_path / "good.gguf"))]) == 0
    assert "tokenizer: gpt2 (pre qwen2), 512 tokens" in capsys.readouterr().out
    bare = doc.copy()
    bare.keys = [k for k in bare.keys if not str(k[0]).startswith(T)]
    assert main(["inspect", str(bare.write(tmp_path / "bare.gguf"))]) == 0
    assert "tokenizer: none (no tokenizer.ggml.* keys" in capsys.readouterr().out


def test_without_the_tokenizers_library_inspect_checks_the_keys(doc, tmp_path, capsys,
                                                                 monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tokenizers" else real(name, *a))
    assert main(["inspect", str(doc.copy().write(tmp_path / "good.gguf"))]) == 0
    assert "(keys checked; not built: the `tokenizers` library is missing)" in \
        capsys.readouterr().out
    path = TOKENIZER["a token not UTF-8"][0](doc.copy()).write(tmp_path / "bad.gguf")
    code, err = cli(["inspect", str(path)], capsys)
    assert code == 1 and "string 7 is not valid UTF-8" in err
