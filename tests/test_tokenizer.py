"""The GGUF tokenizer: ids equal to transformers' Qwen2 tokenizers (stored fixtures, made by
tests/tools/make_tokenizer_fixtures.py), byte-correct streaming decode, special tokens, the
synthetic vocabulary and one clear error per kind of bad file or bad input."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the tokenizer needs `pip install 'strata_rt[text]'`")

from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

from strata_rt.errors import GGUFError, StrataError  # noqa: E402
from strata_rt.text import tokenizer_vocab as tv  # noqa: E402
from strata_rt.text.tokenizer import Tokenizer, TokenizerError  # noqa: E402
from strata_rt.text.tokenizer_vocab import (  # noqa: E402
    CONTROL,
    NORMAL,
    UNUSED,
    USER_DEFINED,
    TokenizerVocab,
    synthetic_vocab,
    write_tokenizer_gguf,
)
from strata_rt.weights.gguf_file.gguf_io import add_keys

FIX = Path(__file__).parent / "fixtures" / "tokenizer"
EXPECTED = json.loads((FIX / "expected.json").read_text(encoding="utf-8"))
CASES = EXPECTED["cases"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(FIX / "tokenizer.gguf")


def _write(path: Path, keys: dict[str, Any]) -> Path:
    """A GGUF with exactly `keys` (typed like llama.cpp's converter writes them)."""
    w = GGUFWriter(str(path), "qwen3moe")
    add_keys(w, keys)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _keys(**changes: Any) -> dict[str, Any]:
    kv = synthetic_vocab(300).gguf_keys()
    kv.update({tv.KEY + k: v for k, v in changes.items()})
    return kv


# ---------------------------------------------------------------- against transformers
@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:24]) for c in CASES])
def test_ids_equal_transformers_qwen2_tokenizer(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


def test_the_fixture_covers_what_it_claims():
    texts = "".join(c["text"] for c in CASES)
    for what, probe in [("CJK", "模型"), ("emoji", "🎉"), ("tab run", "\t\t"),
                        ("newline run", "\n\n\n"), ("CRLF", "\r\n"), ("space run", "    "),
                        ("digits", "1234567890"), ("code", "def "), ("chat", "<|im_start|>"),
                        ("user-defined", "<think>"), ("decomposed accent", "e\u0301")]:
        assert probe in texts, what
    assert any(c["text"] == "" for c in CASES)


def test_the_fixture_vocabulary_is_the_synthetic_one():
    """The stored files were made from synthetic_vocab(n); if the learned merges change, the
    fixtures must be regenerated (the script's two steps)."""
    v = synthetic_vocab(EXPECTED["n_vocab"])
    assert TokenizerVocab.from_gguf(FIX / "tokenizer.gguf") == v
    vocab_json = json.loads((FIX / "hf" / "vocab.json").read_text(encoding="utf-8"))
    assert vocab_json == {t: i for i, (t, k) in enumerate(zip(v.tokens, v.token_type))
                          if k == NORMAL}
    merges = (FIX / "hf" / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert tuple(merges[1:]) == v.merges


@pytest.mark.parametrize("wrong", [
    r" ?\S+|\s+",  # whitespace only
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",  # GPT-2's
])
def test_the_fixtures_tell_a_wrong_pre_tokenizer(monkeypatch, wrong):
    monkeypatch.setitem(tv.PRE_TOKENIZERS, "qwen2", wrong)
    bad = Tokenizer.from_gguf(FIX / "tokenizer.gguf")
    differ = [c["text"] for c in CASES if bad.encode(c["text"]) != c["ids"]]
    assert "1234567890" in differ and len(differ) >= 5


# ---------------------------------------------------------------- decoding
@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"][:24]) for c in CASES])
def test_decode_round_trips(tok, case):
    """Text comes back as written, NFC-normalised (as the tokenizer normalises it)."""
    assert tok.decode(case["ids"]) == unicodedata.normalize("NFC", case["text"])
    assert tok.decode(case["ids"]) == tok._tk.decode(case["ids"], skip_special_tokens=False)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    d = tok.stream()
    return [d.push(i) for i in ids] + [d.flush()]


def test_stream_holds_back_a_split_emoji(tok):
    ids = tok.encode("😀")
    assert len(ids) == 4  # no merges for it: one token per UTF-8 byte
    assert _stream(tok, ids) == ["", "", "", "😀", ""]


@pytest.mark.parametrize("text", ["模型读取提示并把它分成词元。", "Emoji: 😀 🎉 🚀 👍🏽 🇯🇵 👨‍👩‍👧‍👦",
                                  "<|im_start|>user\n你好 🎉<|im_end|>", "한국어 café"])
def test_stream_is_byte_correct_on_split_characters(tok, text):
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    split = [i for i in ids if not _complete_utf8(tok.token_bytes(i))]
    assert split, "the text must split a character across tokens to test anything"
    assert pieces.count("") >= 1
    # every prefix of the stream is the longest complete-character prefix of the bytes
    done = b""
    for n, i in enumerate(ids):
        done += tok.token_bytes(i)
        assert "".join(pieces[:n + 1]).encode() == _complete_prefix(done)


def _complete_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _complete_prefix(b: bytes) -> bytes:
    for cut in range(len(b), -1, -1):
        if _complete_utf8(b[:cut]):
            return b[:cut]
    return b""


def test_stream_flush_marks_an_unfinished_character(tok):
    d = tok.stream()
    first = tok.encode("😀")[0]
    assert d.push(first) == ""
    assert d.flush() == "\ufffd"
    assert tok.decode([first]) == "\ufffd"


# ---------------------------------------------------------------- special tokens
def test_special_tokens_are_recognised_in_the_text(tok):
    start, end, eot = (tok.token_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert [tok.token_type[i] for i in (start, end, eot)] == [CONTROL] * 3
    assert tok.encode("<|im_start|>") == [start]
    ids = tok.encode("a<|im_end|>b<|endoftext|>")
    assert ids.count(end) == 1 and ids.count(eot) == 1
    plain = tok.encode("<|im_start|>", parse_special=False)
    assert len(plain) > 1 and not set(plain) & {start, end, eot}
    assert tok.decode(plain) == "<|im_start|>"
    think = tok.token_id("<think>")
    assert tok.token_type[think] == USER_DEFINED
    assert tok.encode("<think>", parse_special=False) == [think]
    assert tok.decode([start, *tok.encode("hi"), end], skip_special=True) == "hi"
    assert tok.special_tokens["<|im_end|>"] == end


def test_the_keys_values_are_attributes(tok):
    v = synthetic_vocab(EXPECTED["n_vocab"])
    assert len(tok) == len(tok.tokens) == len(tok.token_type) == EXPECTED["n_vocab"]
    assert tok.merges == v.merges
    assert tok.eos_token_id == tok.padding_token_id == tok.token_id("<|endoftext|>")
    assert tok.bos_token_id is None and tok.add_bos_token is False
    assert tok.encode("hi") == tok.encode("hi", add_special=False)


def test_bos_is_added_when_the_file_asks(tmp_path):
    v = synthetic_vocab(300)
    bos = v.tokens.index("<|im_start|>")
    path = _write(tmp_path / "bos.gguf", _keys(bos_token_id=bos, add_bos_token=True))
    t = Tokenizer.from_gguf(path)
    assert t.add_bos_token and t.bos_token_id == bos
    assert t.encode("hi") == [bos, *t.encode("hi", add_special=False)]
    assert t.encode("") == [bos] and t.encode("", add_special=False) == []


# ---------------------------------------------------------------- writing, synthetic
def test_keys_round_trip_with_llama_cpps_types(tmp_path):
    v = synthetic_vocab(400)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", v)
    assert TokenizerVocab.from_gguf(path) == v
    f = GGUFReader(str(path)).fields
    assert f["tokenizer.ggml.tokens"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert f["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert f["tokenizer.ggml.eos_token_id"].types == [GGUFValueType.UINT32]
    assert f["tokenizer.ggml.add_bos_token"].types == [GGUFValueType.BOOL]
    assert _write(tmp_path / "k.gguf", v.gguf_keys()) and \
        TokenizerVocab.from_gguf(tmp_path / "k.gguf") == v


def test_whole_model_gguf_carries_the_tokenizer(tmp_path):
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec, write_qwen3_gguf

    spec = Qwen3Spec(n_layers=1, hidden=128, n_heads=2, n_kv_heads=1, head_dim=64, vocab=1024,
                     ffn=128, n_experts=4, top_k=2, rope_theta=1e6, rms_eps=1e-6, context=256)
    v = synthetic_vocab(spec.vocab)
    path = write_qwen3_gguf(tmp_path / "m.gguf", Qwen3Model.synthetic(spec, 1, "fp16"),
                            keys=v.gguf_keys())
    assert Tokenizer.from_gguf(path).vocab == v


def test_synthetic_vocab_is_deterministic_and_well_formed():
    assert tv._learned_merges.__wrapped__() == tv._learned_merges()
    v = synthetic_vocab(1024)
    assert len(v) == 1024
    assert list(v.tokens[:256]) == list(tv.byte_to_unicode().values())
    assert sorted(tv.token_bytes(t, NORMAL) for t in v.tokens[:256]) == \
        [bytes([b]) for b in range(256)]
    normal = {t for t, k in zip(v.tokens, v.token_type) if k == NORMAL}
    assert all(a in normal and b in normal and a + b in normal
               for a, b in (m.split(" ") for m in v.merges))
    assert len(v.merges) > 300
    assert [v.tokens[i] for i in v.ids_of_type(CONTROL)] == list(tv.QWEN_SPECIAL)
    assert v.tokens[v.eos_token_id] == "<|endoftext|>"
    assert v.token_type[-1] == UNUSED and v.tokens[-1] == "[PAD1023]"
    small = synthetic_vocab(300)  # the first merges of the big one
    assert small.merges == v.merges[:len(small.merges)] and len(small) == 300


# ---------------------------------------------------------------- errors
def test_a_gguf_without_a_tokenizer_names_the_missing_keys(tmp_path):
    path = _write(tmp_path / "none.gguf", {"qwen3moe.block_count": 2})
    with pytest.raises(GGUFError, match=r"no tokenizer.*tokenizer\.ggml\.model, "
                                        r"tokenizer\.ggml\.tokens"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("changes,match", [
    ({"model": "llama"}, r"model = 'llama'; strata_rt reads 'gpt2'"),
    ({"pre": "deepseek-llm"}, r"pre = 'deepseek-llm' is a pre-tokenizer strata_rt does not "
                              r"know \(known: qwen2\)"),
    ({"pre": None}, r"tokenizer\.ggml\.pre is missing.*qwen2"),
    ({"merges": None}, r"tokenizer\.ggml\.merges is missing"),
    ({"token_type": [1] * 10}, r"token_type holds 10 entries for 300 tokens"),
    ({"token_type": [1] * 299 + [9]}, r"token_type holds \[9\]; known types"),
    ({"eos_token_id": 300}, r"eos_token_id = 300 is not a token id \(0\.\.299\)"),
    ({"tokens": []}, r"no tokenizer: key\(s\) tokenizer\.ggml\.tokens missing"),
])
def test_bad_tokenizer_keys_are_named(tmp_path, changes, match):
    path = _write(tmp_path / "bad.gguf", _keys(**changes))
    with pytest.raises(GGUFError, match=match) as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("changes,match", [
    ({"merges": ["Ġ t", "Ġt zzz"]}, r"merges do not fit the tokens"),
    ({"merges": ["Ġtt"]}, r"merge 0 is 'Ġtt'; a merge is two tokens joined by one space"),
])
def test_bad_merges_are_named(tmp_path, changes, match):
    path = _write(tmp_path / "bad.gguf", _keys(**changes))
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_gguf(path)


def test_a_duplicate_token_is_named(tmp_path):
    tokens = list(synthetic_vocab(300).tokens)
    tokens[290] = tokens[100]
    with pytest.raises(TokenizerError, match=rf"token {tokens[100]!r} appears twice.*ids 100 "
                                             r"and 290"):
        Tokenizer.from_gguf(_write(tmp_path / "dup.gguf", _keys(tokens=tokens)))


def test_files_that_are_not_ggufs(tmp_path):
    with pytest.raises(GGUFError, match="no such GGUF file"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")


@pytest.mark.parametrize("bad", [-1, 1024, 10**9])
def test_an_unknown_token_id_is_named(tok, bad):
    with pytest.raises(TokenizerError, match=rf"token id {bad} is not in the vocabulary.*"
                                             r"ids 0\.\.1023"):
        tok.decode([5, bad])
    with pytest.raises(TokenizerError, match=rf"token id {bad} "):
        tok.stream().push(bad)


def test_bad_arguments(tok):
    with pytest.raises(TokenizerError, match=r"token id '7' is not an integer"):
        tok.decode(["7"])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="encode takes a str, not bytes"):
        tok.encode(b"abc")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match=r"no token '<\|nope\|>'.*special tokens: "
                                             r"</think>, <think>, <\|endoftext\|>"):
        tok.token_id("<|nope|>")
    with pytest.raises(GGUFError, match="cannot hold the 256 byte tokens"):
        synthetic_vocab(200)
    with pytest.raises(GGUFError, match=r"tokens is empty.*token_type holds 1 entries"):
        TokenizerVocab(tokens=(), token_type=(1,), merges=())
    assert issubclass(TokenizerError, StrataError)


def test_a_missing_library_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(TokenizerError, match=r"pip install 'strata_rt\[text\]'"):
        Tokenizer.synthetic(300)
