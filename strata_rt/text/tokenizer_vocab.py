"""A GGUF's tokenizer keys as plain data: read from a file, written to one, or made up.

llama.cpp keeps a model's tokenizer in the GGUF itself (`tokenizer.ggml.*`), so a prompt can be
turned into ids without any file beside the weights. This module is the data half of
strata_rt.text.tokenizer and needs nothing beyond the gguf package: `TokenizerVocab.from_gguf`
(`from_header`, on a header the model already opened) checks the keys and names what is
missing or unsupported; `gguf_keys` / `add_tokenizer_keys`
write them back with the value types llama.cpp's converter uses; `synthetic_vocab` builds a
small byte-level BPE vocabulary (GPT-2's 256 byte tokens, merges learned deterministically from
a built-in text, Qwen's special tokens) so synthetic models carry a tokenizer without downloads.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError

log = logging.getLogger(__name__)

#: llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TYPE_NAMES = {NORMAL: "normal", UNKNOWN: "unknown", CONTROL: "control",
              USER_DEFINED: "user-defined", UNUSED: "unused", BYTE: "byte"}
#: token types whose text is matched in the input as one token (added tokens)
ADDED_TYPES = (CONTROL, USER_DEFINED)
#: token types whose text is stored as is, not in GPT-2's byte-to-unicode form
RAW_TYPES = (UNKNOWN, CONTROL, USER_DEFINED, UNUSED)

MODELS = ("gpt2",)
#: the pre-tokenizer regexes strata_rt knows, by `tokenizer.ggml.pre` name. qwen2: letters with
#: at most one leading non-letter (so " word" stays one piece), every digit on its own,
#: punctuation runs with their trailing newlines, whitespace runs (the last space of a run
#: before a word goes with the word).
PRE_TOKENIZERS = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
KEY = "tokenizer.ggml."

#: Qwen's special (control) tokens and the user-defined ones Qwen3 adds, in Qwen's id order
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_USER_DEFINED = ("<think>", "</think>")


def quoted(v: Any) -> str:
    """A key's value in a message: quoted (a NUL or an escape shows as such) and cut at 60
    characters (a file's megabyte string must not fill the message)."""
    if isinstance(v, str) and len(v) > 60:
        return repr(v[:60]) + f"... ({len(v):,} characters)"
    return repr(v)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-unicode map: printable bytes stand for themselves, the other 68 bytes
    (controls, space, ...) for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def token_bytes(text: str, token_type: int) -> bytes:
    """The bytes a token stands for: added and unused tokens hold their text as is, the others
    GPT-2's byte-to-unicode form (a character outside the map is taken as its UTF-8)."""
    if token_type in RAW_TYPES:
        return text.encode("utf-8")
    table = unicode_to_byte()
    out = bytearray()
    for c in text:
        b = table.get(c)
        out += c.encode("utf-8") if b is None else bytes((b,))
    return bytes(out)


@dataclass(frozen=True)
class TokenizerVocab:
    """What a GGUF's `tokenizer.ggml.*` keys hold (ids index `tokens` and `token_type`)."""

    tokens: tuple[str, ...]
    token_type: tuple[int, ...]
    merges: tuple[str, ...]
    model: str = "gpt2"
    pre: str = "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    padding_token_id: int | None = None
    add_bos_token: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise GGUFError("tokenizer keys: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out: list[str] = []
        n = len(self.tokens)
        if self.model not in MODELS:
            out.append(f"{KEY}model = {quoted(self.model)}; strata_rt reads "
                       f"{', '.join(map(repr, MODELS))} (byte-level BPE) only")
        if self.pre not in PRE_TOKENIZERS:
            out.append(f"{KEY}pre = {quoted(self.pre)} is a pre-tokenizer strata_rt does not know "
                       f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
        if n == 0:
            out.append(f"{KEY}tokens is empty")
        if len(self.token_type) != n:
            out.append(f"{KEY}token_type holds {len(self.token_type)} entries for "
                       f"{n} tokens")
        bad = sorted(set(np.unique(np.asarray(self.token_type, np.int64)).tolist())
                     - set(TYPE_NAMES))
        if bad:
            out.append(f"{KEY}token_type holds {bad}; known types are "
                       + ", ".join(f"{k} ({v})" for k, v in TYPE_NAMES.items()))
        for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < n:
                out.append(f"{KEY}{name} = {v} is not a token id (0..{n - 1})")
        return out

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def types(self) -> np.ndarray:
        """token_type as an int64 array (one vectorized pass instead of 150,000 lookups)."""
        return np.asarray(self.token_type, np.int64)

    def ids_of_type(self, *types: int) -> list[int]:
        return np.flatnonzero(np.isin(self.types, types)).tolist()

    # ------------------------------------------------------------------ GGUF keys
    def gguf_keys(self) -> dict[str, Any]:
        """The keys by full name: strings, lists (tokens and merges of strings, token_type of
        ints), ints for the ids present, a bool for add_bos_token."""
        kv: dict[str, Any] = {f"{KEY}model": self.model, f"{KEY}pre": self.pre,
                              f"{KEY}tokens": list(self.tokens),
                              f"{KEY}token_type": list(self.token_type),
                              f"{KEY}merges": list(self.merges)}
        for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
            if getattr(self, name) is not None:
                kv[KEY + name] = int(getattr(self, name))
        kv[f"{KEY}add_bos_token"] = bool(self.add_bos_token)
        return kv

    @classmethod
    def from_gguf(cls, path: str | Path) -> TokenizerVocab:
        """Reads and checks the tokenizer keys; a GGUFError names each missing or invalid
        key (and what is allowed). The header is the one the model opened (gguf_io keeps
        it), and the arrays are decoded from one buffer each (gguf_strings): a Qwen3
        vocabulary of 151,936 tokens and 151,387 merges reads in a fraction of a second."""
        from ..weights.gguf_file.gguf_io import open_reader

        path = Path(path)
        return cls.from_header(open_reader(path))  # every key type- and count-checked

    @classmethod
    def from_header(cls, header: Any) -> TokenizerVocab:
        """The tokenizer of an opened, checked GGUF header (gguf_io.open_reader)."""
        path = header.path

        def get(name: str) -> Any:
            kv = header.keys.get(KEY + name)
            return None if kv is None else kv.value if kv.elem_type is None else kv

        missing = [KEY + k for k in ("model", "tokens") if get(k) is None]
        if missing:
            raise GGUFError(f"{path}: the file has no tokenizer: key(s) {', '.join(missing)} "
                            "missing (llama.cpp's converter writes them; a file without them "
                            "can be prefilled from token ids only)")
        model = get("model")
        if model not in MODELS:
            raise GGUFError(f"{path}: {KEY}model = {quoted(model)}; strata_rt reads "
                            f"{', '.join(map(repr, MODELS))} (byte-level BPE) only")
        pre = get("pre")
        if pre is None:
            raise GGUFError(f"{path}: key {KEY}pre is missing; strata_rt needs the name of the "
                            f"pre-tokenizer (known: {', '.join(sorted(PRE_TOKENIZERS))})")
        if get("merges") is None:
            raise GGUFError(f"{path}: key {KEY}merges is missing (a {quoted(model)} tokenizer "
                            "needs its BPE merges)")
        tokens = tuple(header.strings(KEY + "tokens").decode(KEY + "tokens", path))
        merges = tuple(header.strings(KEY + "merges").decode(KEY + "merges", path))
        if get("token_type") is None:
            log.info("%s: no %stoken_type; every token taken as normal", path, KEY)
            types: tuple[int, ...] = (NORMAL,) * len(tokens)
        else:
            types = tuple(header.numbers(KEY + "token_type").astype(np.int64).tolist())

        def ident(name: str) -> int | None:
            v = get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise GGUFError(f"{path}: key {KEY}{name} = {v!r}; expected a token id")
            return None if v is None else int(v)

        add_bos = get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise GGUFError(f"{path}: key {KEY}add_bos_token = {add_bos!r}; expected a bool")
        try:
            return cls(tokens=tokens, token_type=types, merges=merges, model=str(model),
                       pre=str(pre), bos_token_id=ident("bos_token_id"),
                       eos_token_id=ident("eos_token_id"),
                       padding_token_id=ident("padding_token_id"),
                       add_bos_token=bool(add_bos) if add_bos is not None else False)
        except GGUFError as e:
            raise GGUFError(f"{path}: {e}") from None


def add_tokenizer_keys(writer: Any, vocab: TokenizerVocab) -> None:
    """Adds the tokenizer keys to a gguf.GGUFWriter with the types llama.cpp's converter
    writes (string arrays, an int32 array of token types, uint32 ids, a bool)."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_type))
    writer.add_token_merges(list(vocab.merges))
    if vocab.bos_token_id is not None:
        writer.add_bos_token_id(vocab.bos_token_id)
    if vocab.eos_token_id is not None:
        writer.add_eos_token_id(vocab.eos_token_id)
    if vocab.padding_token_id is not None:
        writer.add_pad_token_id(vocab.padding_token_id)
    writer.add_add_bos_token(vocab.add_bos_token)


def write_tokenizer_gguf(path: str | Path, vocab: TokenizerVocab, arch: str = "qwen3moe",
                         keys: dict[str, Any] | None = None) -> Path:
    """A GGUF holding only the tokenizer keys (and `keys`, written as strings or uint32):
    what a tokenizer test or fixture needs, without weights."""
    from gguf import GGUFWriter

    from ..weights.gguf_file.gguf_io import add_keys

    path = Path(path)
    w = GGUFWriter(str(path), arch)
    add_tokenizer_keys(w, vocab)
    add_keys(w, keys or {})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------- synthetic
#: the text the synthetic merges are learned from: English prose, code, numbers, a little
#: CJK (so some tokens end inside a multi-byte character) and whitespace of several kinds
_TRAINING_TEXT = """\
The engine reads a prompt, turns it into tokens and runs every layer over the whole chunk
before the next one starts. Experts that do not fit in memory are streamed in while the
others compute, and the order of the copies is planned so that no kernel ever waits for a
transfer it could have started earlier. When the prompt is long, the attention over the
cache grows with it, and the time of a chunk depends on how much of the context came first.
A token is a piece of text: a word, part of a word, a digit or a run of spaces.

def prefill(model, ids, chunk=8192):
    \"\"\"Runs the model over ids in chunks and returns the last hidden state.\"\"\"
    state = model.start()
    for start in range(0, len(ids), chunk):
        state = model.forward(ids[start:start + chunk], state)
    return state.hidden[-1]

if __name__ == "__main__":
    print(prefill(load("model.gguf"), [1, 2, 3]))

Numbers such as 128, 256, 512, 1024, 2048, 4096 and 8192 are split into single digits,
so 30118 tokens take five pieces to write and 9200 takes four. Prices: $3.50, 12% off.
Dates: 2024-06-01, 1999-12-31. Times: 10:45, 23:59.

模型读取提示并把它分成词元。每个专家在需要时被复制到显存中，计算和复制同时进行。
大型语言模型的推理速度取决于内存带宽和计算能力。

\tindented with a tab
    indented with spaces
line one
line two

the the the of of and and to to in in is is it it that that for for with with
"""

#: at most this many merges are learned (pairs seen once included: the text runs out first)
MAX_MERGES = 1800


def _training_words(text: str) -> Counter[str]:
    """Splits at whitespace only (a leading space kept with its word), each piece in
    byte-to-unicode form. Coarser than the qwen2 pre-tokenizer on purpose: the merges then
    join digits, letters with punctuation and so on, pairs that only a correct pre-tokenizer
    keeps apart, so tests on this vocabulary can tell a right split from a wrong one."""
    table = byte_to_unicode()
    return Counter("".join(table[b] for b in p.encode("utf-8"))
                   for p in re.findall(r" ?\S+|\s+", text))


@lru_cache(maxsize=1)
def _learned_merges() -> tuple[tuple[str, str], ...]:
    """Greedy BPE on the training text: the most frequent adjacent pair is merged first, ties
    broken by the pair's text, so the list is the same on every machine. Any prefix of it is
    itself a valid merge list."""
    words = [(list(w), n) for w, n in sorted(_training_words(_TRAINING_TEXT).items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < MAX_MERGES:
        counts: Counter[tuple[str, str]] = Counter()
        for syms, n in words:
            for pair in zip(syms, syms[1:]):
                counts[pair] += n
        if not counts:
            break
        best = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        a, b = best
        for syms, _ in words:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == a and syms[i + 1] == b:
                    syms[i:i + 2] = [a + b]
                i += 1
    return tuple(merges)


def synthetic_vocab(n_vocab: int = 1024) -> TokenizerVocab:
    """A Qwen-like vocabulary of exactly `n_vocab` tokens: the 256 byte tokens (in GPT-2's
    order), as many learned merges as fit, Qwen's control tokens (<|endoftext|> is EOS and
    padding, no BOS) and user-defined tokens, then `[PADn]` unused tokens up to n_vocab (how
    Qwen's GGUFs fill the embedding's spare rows)."""
    n_added = len(QWEN_SPECIAL) + len(QWEN_USER_DEFINED)
    if n_vocab < 256 + n_added:
        raise GGUFError(f"a synthetic vocabulary of {n_vocab} tokens cannot hold the 256 byte "
                        f"tokens and {n_added} special ones (at least {256 + n_added})")
    tokens = list(byte_to_unicode().values())  # printable bytes first, as GPT-2 numbers them
    seen = set(tokens)
    merges: list[str] = []
    for a, b in _learned_merges():
        if len(tokens) >= n_vocab - n_added:
            break
        merges.append(f"{a} {b}")
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    eos = len(tokens)
    tokens += [*QWEN_SPECIAL, *QWEN_USER_DEFINED]
    types += [CONTROL] * len(QWEN_SPECIAL) + [USER_DEFINED] * len(QWEN_USER_DEFINED)
    while len(tokens) < n_vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    return TokenizerVocab(tokens=tuple(tokens), token_type=tuple(types), merges=tuple(merges),
                          eos_token_id=eos, padding_token_id=eos, add_bos_token=False)
