"""A made-up byte-level BPE vocabulary of a real model's size (Qwen3: 151,936 tokens, 151,387
merges), for measuring how long a file's tokenizer takes to open and for tests that compare
two ways of reading one.

The 256 byte tokens come first (GPT-2's order), then one token per merge: each merge joins a
token drawn from all tokens so far with one drawn from the first few thousand (so tokens stay
short, as real ones are, and every merge's parts exist before it), then Qwen's control and
user-defined tokens, reserved control tokens and `[PADn]` unused tokens up to the size. Seeded:
the same vocabulary on every machine.
"""

from __future__ import annotations

import numpy as np

from .tokenizer_vocab import (
    CONTROL,
    NORMAL,
    QWEN_SPECIAL,
    QWEN_USER_DEFINED,
    UNUSED,
    USER_DEFINED,
    TokenizerVocab,
    byte_to_unicode,
)

#: Qwen3's vocabulary: tokens (the embedding's rows) and BPE merges
QWEN3_TOKENS, QWEN3_MERGES = 151_936, 151_387
#: reserved control tokens after Qwen's named ones (Qwen3 has 26 added tokens in all)
RESERVED = 21
#: the longest token made, in byte-level characters
MAX_CHARS = 16


def large_vocab(n_tokens: int = QWEN3_TOKENS, n_merges: int = QWEN3_MERGES,
                seed: int = 0) -> TokenizerVocab:
    """A vocabulary of exactly `n_tokens` tokens and `n_merges` merges (see the module doc);
    n_tokens must hold the byte tokens, the merges and the 26 added tokens."""
    added = len(QWEN_SPECIAL) + len(QWEN_USER_DEFINED) + RESERVED
    if n_tokens < 256 + n_merges + added:
        raise ValueError(f"{n_tokens} tokens cannot hold 256 byte tokens, {n_merges} merged "
                         f"ones and {added} added ones")
    rng = np.random.default_rng(seed)
    tokens = list(byte_to_unicode().values())
    seen = set(tokens)
    merges: list[str] = []
    while len(merges) < n_merges:
        n = len(tokens)
        left = rng.integers(0, n, 4096).tolist()
        right = rng.integers(0, min(n, 4000), 4096).tolist()
        for i, j in zip(left, right):
            a, b = tokens[i], tokens[j]
            t = a + b
            if len(t) > MAX_CHARS or t in seen:
                continue
            seen.add(t)
            tokens.append(t)
            merges.append(f"{a} {b}")
            if len(merges) == n_merges:
                break
    types = [NORMAL] * len(tokens)
    eos = len(tokens)
    tokens += [*QWEN_SPECIAL, *QWEN_USER_DEFINED]
    types += [CONTROL] * len(QWEN_SPECIAL) + [USER_DEFINED] * len(QWEN_USER_DEFINED)
    tokens += [f"<|reserved_{i}|>" for i in range(RESERVED)]
    types += [CONTROL] * RESERVED
    while len(tokens) < n_tokens:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    return TokenizerVocab(tokens=tuple(tokens), token_type=tuple(types), merges=tuple(merges),
                          eos_token_id=eos, padding_token_id=eos, add_bos_token=False)
