"""The tokenizer arrays read from one buffer each (gguf_strings) are the arrays the gguf
package's reader decodes field by field, and the tokenizer built from them gives the same ids
on a set of texts; one header parse serves the model and the tokenizer; a Qwen3-sized
vocabulary opens in well under 2 s."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from strata_rt.errors import GGUFError
from strata_rt.text.large_vocab import QWEN3_MERGES, QWEN3_TOKENS, large_vocab
from strata_rt.text.tokenizer import Tokenizer
from strata_rt.text.tokenizer_vocab import TokenizerVocab, synthetic_vocab, write_tokenizer_gguf
from strata_rt.weights.gguf_file import gguf_header, gguf_io
from strata_rt.weights.gguf_file.gguf_strings import StringArray

TEXTS = ["", "Hello world", "The experts stream while the others compute.\n\n",
         "def f(x):\n\treturn x * 30118  # 12% off, $3.50\r\n",
         "模型读取提示并把它分成词元。🎉 emoji, café, naïve, Ελληνικά",
         "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>",
         "   many   spaces\t\ttabs\n\n\nnewlines", "ĠĊ raw byte-level characters ÿ",
         "a" * 500, "1234567890 " * 20]


def reader_vocab(path) -> tuple[list[str], list[str], list[int]]:
    """tokens, merges and token types as the gguf package's reader decodes them."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def strings(key: str) -> list[str]:
        f = fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    f = fields["tokenizer.ggml.token_type"]
    return (strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges"),
            [int(f.parts[i][0]) for i in f.data])


@pytest.mark.parametrize("which", ["synthetic", "large"])
def test_same_arrays_and_same_ids_as_the_gguf_reader(tmp_path, which):
    vocab = synthetic_vocab(1024) if which == "synthetic" else large_vocab(30_000, 29_000, 5)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", vocab)
    fast = TokenizerVocab.from_gguf(path)
    tokens, merges, types = reader_vocab(path)
    assert list(fast.tokens) == tokens == list(vocab.tokens)
    assert list(fast.merges) == merges and list(fast.token_type) == types
    before = Tokenizer(TokenizerVocab(tuple(tokens), tuple(types), tuple(merges),
                                      eos_token_id=vocab.eos_token_id,
                                      padding_token_id=vocab.padding_token_id))
    after = Tokenizer.from_gguf(path)
    for text in TEXTS:
        for special in (True, False):
            assert after.encode(text, parse_special=special) == \
                before.encode(text, parse_special=special), text
    assert after.decode(after.encode(TEXTS[4])) == TEXTS[4]


def test_one_parse_serves_model_and_tokenizer(tmp_path, monkeypatch):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", synthetic_vocab(512))
    calls = []
    real = gguf_io.parse
    monkeypatch.setattr(gguf_io, "parse", lambda p: calls.append(p) or real(p))
    first = gguf_io.open_reader(path)
    Tokenizer.from_gguf(path)
    assert gguf_io.open_reader(path) is first and len(calls) == 1
    # a file written again is parsed again (its identity changed)
    write_tokenizer_gguf(path, synthetic_vocab(600))
    assert len(TokenizerVocab.from_gguf(path)) == 600 and len(calls) == 2


def _strings(items: list[bytes]) -> StringArray:
    buf = b"".join(struct.pack("<Q", len(x)) + x for x in items)
    starts, pos = [], 0
    for x in items:
        starts.append(pos + 8)
        pos += 8 + len(x)
    lo = np.array(starts, np.int64)
    return StringArray.gather(buf, lo, lo + np.array([len(x) for x in items], np.int64))


def test_strings_with_nul_empty_and_multibyte_characters():
    items = [b"a", b"", "é€🎉".encode(), b"x\x00y", b"", b"\x00"]
    s = _strings(items)
    assert [s.item(i) for i in range(len(s))] == items
    assert s.decode("k", "f.gguf") == [x.decode() for x in items]
    assert _strings([]).decode("k", "f.gguf") == []


@pytest.mark.parametrize("items,bad", [([b"ok", b"\xff\xfe", b"z"], 1),
                                       (["é".encode()[:1], "é".encode()[1:]], 0),
                                       ([b"a", b"b\x00", b"\xc3"], 2)])
def test_a_string_that_is_not_utf8_is_named(items, bad):
    """A character split over two strings decodes joined but not on its own: refused, as a
    decode string by string refuses it."""
    with pytest.raises(GGUFError) as e:
        _strings(items).decode("tokenizer.ggml.tokens", "f.gguf")
    assert str(e.value).startswith(f"f.gguf: key tokenizer.ggml.tokens: string {bad} is not "
                                   "valid UTF-8")


def test_a_qwen3_sized_vocabulary_opens_in_well_under_2_s(tmp_path):
    """Header walk, arrays and the `tokenizers` build of 151,936 tokens and 151,387 merges, in
    CPU seconds (the gguf package's reader takes 15-25 s for the same file)."""
    path = write_tokenizer_gguf(tmp_path / "q.gguf", large_vocab())
    gguf_io._OPENED.clear()
    t0 = time.process_time()  # CPU time: other work on a shared machine does not count
    tok = Tokenizer.from_gguf(path)
    seconds = time.process_time() - t0
    assert len(tok) == QWEN3_TOKENS and len(tok.merges) == QWEN3_MERGES
    assert seconds < 2.0, seconds
    assert gguf_header.MAX_STRINGS >= 2 * QWEN3_TOKENS
