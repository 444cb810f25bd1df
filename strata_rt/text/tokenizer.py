"""Text to token ids and back, from the tokenizer a GGUF carries.

A prompt has to become the same ids the model was trained on, so the tokenizer is rebuilt from
the file's `tokenizer.ggml.*` keys (strata_rt.text.tokenizer_vocab reads and checks them) on
Hugging Face's `tokenizers` library, the implementation transformers itself runs: byte-level
BPE with the qwen2 pre-tokenizer and NFC normalisation, the file's control and user-defined
tokens matched in the text as single tokens. `tokenizers` is an optional extra
(`pip install 'strata_rt[text]'`), imported only when a tokenizer is built.

Decoding does not go through the library: every id maps to the bytes it stands for, so a
streaming decoder can hold back the first bytes of a UTF-8 character that the next token
completes (a CJK character or an emoji is often split over two or more tokens).
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StrataError
from .tokenizer_vocab import (
    ADDED_TYPES,
    CONTROL,
    PRE_TOKENIZERS,
    TYPE_NAMES,
    UNUSED,
    TokenizerVocab,
    synthetic_vocab,
    token_bytes,
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'strata_rt[text]'"


class TokenizerError(StrataError):
    """A tokenizer cannot be built or used as asked (library missing, unknown id or token)."""


def _library() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("text in and out needs Hugging Face's `tokenizers` library, which "
                             f"is not installed: {INSTALL_HINT}") from None
    return tokenizers


def _build(vocab: TokenizerVocab, parse_special: bool) -> Any:
    """The `tokenizers.Tokenizer` for `vocab`: BPE over the normal tokens (unused ones left
    out), added tokens at their own ids. With parse_special=False, control tokens' text is
    encoded as ordinary text (user-defined tokens are still matched, as llama.cpp does)."""
    tk = _library()
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    tokens = vocab.tokens
    normal = np.flatnonzero(vocab.types != UNUSED).tolist()
    ids = {tokens[i]: i for i in normal}
    if len(ids) != len(normal):  # a token twice: find the first for the message
        first: dict[str, int] = {}
        for i in normal:
            if tokens[i] in first:
                raise TokenizerError(f"token {tokens[i]!r} appears twice in the vocabulary "
                                     f"(ids {first[tokens[i]]} and {i}); a BPE vocabulary "
                                     "needs each token once")
            first[tokens[i]] = i
    split = [m.split(" ") for m in vocab.merges]
    for n, parts in enumerate(split):
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise TokenizerError(f"merge {n} is {vocab.merges[n]!r}; a merge is two tokens "
                                 "joined by one space")
    merges = [(a, b) for a, b in split]
    try:
        bpe = models.BPE(vocab=ids, merges=merges, dropout=None, unk_token=None,
                         continuing_subword_prefix="", end_of_word_suffix="",
                         fuse_unk=False, byte_fallback=False)
    except Exception as e:  # the library reports a merge of unknown tokens as a plain Exception
        raise TokenizerError(f"the merges do not fit the tokens: {e}") from None
    t = tk.Tokenizer(bpe)
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tk.Regex(PRE_TOKENIZERS[vocab.pre]), behavior="isolated",
                             invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([tk.AddedToken(vocab.tokens[i], special=True, normalized=False)
                          for i in vocab.ids_of_type(CONTROL)])
    t.add_tokens([tk.AddedToken(vocab.tokens[i], special=False, normalized=False)
                  for i in vocab.ids_of_type(*ADDED_TYPES) if vocab.token_type[i] != CONTROL])
    t.encode_special_tokens = not parse_special
    for i in vocab.ids_of_type(*ADDED_TYPES):
        if t.token_to_id(vocab.tokens[i]) != i:
            raise TokenizerError(f"added token {vocab.tokens[i]!r} got id "
                                 f"{t.token_to_id(vocab.tokens[i])}, not its own {i}")
    return t


class StreamDecoder:
    """Decodes ids one at a time: `push(id)` returns the text that is complete so far, holding
    back the leading bytes of a UTF-8 character until the token that ends it arrives;
    `flush()` ends the stream (a character left incomplete becomes U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id, self._skip))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """A GGUF's tokenizer: `encode(text) -> ids`, `decode(ids) -> text`, `stream()` for text
    as ids arrive. The keys' values are attributes (tokens, token_type, merges, bos/eos/padding
    ids, add_bos_token)."""

    def __init__(self, vocab: TokenizerVocab, source: str = "tokenizer"):
        self.vocab = vocab
        self.source = source
        self._tk = _build(vocab, parse_special=True)
        self._tk_plain: Any = None

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        vocab = TokenizerVocab.from_gguf(path)
        try:
            tok = cls(vocab, source=str(path))
        except TokenizerError as e:
            raise TokenizerError(f"{path}: {e}") from None
        log.info("%s: %s tokenizer (pre %s), %d tokens, %d merges, %d added", path,
                 vocab.model, vocab.pre, len(vocab), len(vocab.merges),
                 len(vocab.ids_of_type(*ADDED_TYPES)))
        return tok

    @classmethod
    def synthetic(cls, n_vocab: int = 1024) -> Tokenizer:
        """The seeded synthetic vocabulary (strata_rt.text.tokenizer_vocab.synthetic_vocab)."""
        return cls(synthetic_vocab(n_vocab), source="synthetic")

    # the keys' values
    @property
    def tokens(self) -> tuple[str, ...]:
        return self.vocab.tokens

    @property
    def token_type(self) -> tuple[int, ...]:
        return self.vocab.token_type

    @property
    def merges(self) -> tuple[str, ...]:
        return self.vocab.merges

    @property
    def bos_token_id(self) -> int | None:
        return self.vocab.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.vocab.eos_token_id

    @property
    def padding_token_id(self) -> int | None:
        return self.vocab.padding_token_id

    @property
    def add_bos_token(self) -> bool:
        return self.vocab.add_bos_token

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Control and user-defined tokens by text: what `encode` matches as one token."""
        return {self.vocab.tokens[i]: i for i in self.vocab.ids_of_type(*ADDED_TYPES)}

    def token_id(self, text: str) -> int:
        """The id of a token given by its text (a special token such as '<|im_end|>', or a
        normal token in byte-to-unicode form)."""
        i = self._tk.token_to_id(text)
        if i is None:
            known = ", ".join(sorted(self.special_tokens)) or "none"
            raise TokenizerError(f"{self.source}: no token {text!r} in the vocabulary "
                                 f"(special tokens: {known})")
        return int(i)

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True
               ) -> list[int]:
        """Token ids of `text`. add_special: prepend BOS when the file asks for it
        (add_bos_token; Qwen's do not). parse_special: control tokens written in the text
        (`<|im_start|>`) become their ids; False encodes their text like any other."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, not {type(text).__name__}")
        if parse_special:
            tk = self._tk
        else:
            if self._tk_plain is None:
                self._tk_plain = _build(self.vocab, parse_special=False)
            tk = self._tk_plain
        ids = list(tk.encode(text, add_special_tokens=False).ids) if text else []
        if add_special and self.vocab.add_bos_token and self.vocab.bos_token_id is not None:
            ids.insert(0, self.vocab.bos_token_id)
        return ids

    # ------------------------------------------------------------------ decoding
    @cached_property
    def _bytes(self) -> tuple[bytes, ...]:
        return tuple(token_bytes(t, k) for t, k in zip(self.vocab.tokens,
                                                        self.vocab.token_type))

    def _check(self, token_id: Any) -> int:
        n = len(self.vocab)
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            raise TokenizerError(f"token id {token_id!r} is not an integer")
        i = int(token_id)
        if not 0 <= i < n:
            raise TokenizerError(f"token id {i} is not in the vocabulary of {self.source} "
                                 f"(ids 0..{n - 1})")
        return i

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes one token stands for (empty for a control or unused token when
        skip_special)."""
        i = self._check(token_id)
        if skip_special and self.vocab.token_type[i] in (CONTROL, UNUSED):
            return b""
        return self._bytes[i]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids` (bytes that are not valid UTF-8 become U+FFFD). skip_special
        leaves control and unused tokens out."""
        return b"".join(self.token_bytes(i, skip_special) for i in ids).decode(
            "utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def describe(self, token_id: int) -> str:
        i = self._check(token_id)
        return f"{i} {self.vocab.tokens[i]!r} ({TYPE_NAMES[self.vocab.token_type[i]]})"
