"""A GGUF string array (a tokenizer's tokens or merges) as one bytes buffer and offsets.

A vocabulary of 150,000 tokens and as many merges is 300,000 length-prefixed strings. Decoding
them one `bytes.decode` at a time, or through the gguf package's reader (a numpy view per
field), costs seconds at every open; here the header walk records where each string's bytes
start and end (numpy int64), the payloads are gathered into one buffer with one mask (NUL
bytes between them), decoded as one UTF-8 text and split at the NULs. A string that is not valid
UTF-8 on its own is named by its index, as the one-at-a-time decode would name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GGUFError


@dataclass(frozen=True)
class StringArray:
    """`data` holds the strings' bytes, each after the previous one and a NUL byte; string i
    is data[starts[i]:ends[i]]."""

    data: bytes
    starts: np.ndarray  # int64 [count]
    ends: np.ndarray    # int64 [count]

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    def gather(cls, buf: Any, starts: np.ndarray, ends: np.ndarray) -> StringArray:
        """The strings whose payloads lie at buf[starts[i]:ends[i]] (consecutive, each after
        its 8-byte length): the region from the first length to the last byte, with each
        length but the first cut to one NUL byte."""
        n = len(starts)
        if n == 0:
            return cls(b"", np.zeros(0, np.int64), np.zeros(0, np.int64))
        lo, hi = int(starts[0]), int(ends[-1])
        region = np.frombuffer(buf, np.uint8, hi - lo, lo)
        keep = np.ones(hi - lo, bool)
        gaps = starts[1:] - 8 - lo  # where each later length starts in the region
        keep[(gaps[:, None] + np.arange(1, 8)).reshape(-1)] = False
        out = region[keep]
        out[gaps - 7 * np.arange(n - 1)] = 0
        lengths = ends - starts
        new_starts = np.zeros(n, np.int64)
        np.cumsum(lengths[:-1] + 1, out=new_starts[1:])
        return cls(out.tobytes(), new_starts, new_starts + lengths)

    def item(self, i: int) -> bytes:
        return self.data[int(self.starts[i]): int(self.ends[i])]

    def decode(self, what: str, path: Path | str) -> list[str]:
        """Every string as str; GGUFError naming `what`, the first string that is not valid
        UTF-8 and its bytes. One decode and one split at the NULs, unless a string holds a
        NUL itself (then one decode per string)."""
        n = len(self)
        if n and self.data.count(0) == n - 1:
            try:
                return self.data.decode("utf-8").split("\0")
            except UnicodeDecodeError:
                pass  # named below
        out = []
        for i in range(n):
            raw = self.item(i)
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                more = "..." if len(raw) > 24 else ""
                raise GGUFError(f"{path}: key {what}: string {i} is not valid UTF-8 "
                                f"({raw[:24]!r}{more})") from None
        return out
