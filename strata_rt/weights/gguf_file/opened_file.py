"""Reading a GGUF's tensor bytes after the file was opened, without its memory map.

When a file opens, its header is checked against its size (gguf_header): every tensor lies
inside it. A file cut short afterwards (by another program, a copy still being written, a
cleanup of a full disk) leaves pages of the memory map with nothing behind them, and reading
one raises SIGBUS: the process ends in the middle of a run with no message, and Python cannot
catch it. So the bytes a run reads after open, where the engine holds no copy of its own (the
reference backend decodes each dense weight on its first use; a prompt's embedding rows are
looked up on the host), are read here with pread on the descriptor kept from the open. A read
past the end of the file comes back short instead of faulting, and becomes a GGUFChangedError
naming the file, how it changed and the tensor.

Each read first compares the file's size and modification time with those it had at open
(one fstat): a file rewritten in place, same size or not, is refused rather than read as a mix
of the checked bytes and new ones. A rewrite that lands between that comparison and the read
is not seen; a cut is, by the short read, whenever it lands. The descriptor keeps the file
that was opened, so a new file renamed over the path is never read in its place; what is
read by path after open (a tokenizer's keys) is read only while the path still names that
file (check_path), so another GGUF put there since gives no tokenizer of its vocabulary beside
the opened file's weights.

Reads while the engine opens (the NaN checks, the expert store's fill, the CUDA backend's
uploads) still go through the map, right after the size was checked, and copy what the run
uses. A tokenizer built later reads its keys through gguf_io.open_reader, which parses the file
again if its size or times changed (Engine.tokenizer checks the model's file here first, so the
message says the file changed rather than listing its tensors as cut short).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import GGUFChangedError, GGUFError

_PREADV = getattr(os, "preadv", None)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read into `view` from `offset` (0: the file ends there)."""
    if _PREADV is not None:
        return int(_PREADV(fd, [view], offset))
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


class OpenedFile:
    """A GGUF file's descriptor, kept open from the header's parse, with the size and
    modification time the file had then. The descriptor closes when the object is dropped."""

    def __init__(self, path: str | Path, fd: int, st: os.stat_result) -> None:
        self.path = Path(path)
        self.fd = fd
        self.size = int(st.st_size)
        self.mtime_ns = int(st.st_mtime_ns)
        self._close = weakref.finalize(self, os.close, fd)

    def change(self) -> str | None:
        """How the file differs from when it was opened; None: same size and modification
        time."""
        try:
            st = os.fstat(self.fd)
        except OSError as e:
            return f"it can no longer be examined ({e.strerror or e})"
        if st.st_size < self.size:
            return f"it shrank from {self.size:,} to {st.st_size:,} bytes"
        if st.st_size > self.size:
            return f"it grew from {self.size:,} to {st.st_size:,} bytes"
        if st.st_mtime_ns != self.mtime_ns:
            return f"it was rewritten in place (still {self.size:,} bytes, modified again)"
        return None

    def moved(self) -> str | None:
        """How the file's path differs from when it was opened; None: it still names the file
        held open. The reads here go through the descriptor and need no path, but what is
        read later by path (a tokenizer's keys) must come from the same file."""
        try:
            held = os.fstat(self.fd)
            now = os.stat(self.path)
        except FileNotFoundError:
            return "its path now names another file or none (it was deleted or moved)"
        except OSError as e:
            return f"its path can no longer be examined ({e.strerror or e})"
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return "its path now names another file or none (another file was put there)"
        return None

    def changed(self, why: str, what: str) -> GGUFChangedError:
        return GGUFChangedError(
            f"{self.path}: the file changed after it was opened: {why}, so {what} can no "
            "longer be read as it was checked. Something cut or rewrote the file during the "
            "run; open the model again once the file is complete")

    def check(self, what: str) -> None:
        """GGUFChangedError when the file is not as it was opened (`what` names what was about
        to be read)."""
        why = self.change()
        if why is not None:
            raise self.changed(why, what)

    def check_path(self, what: str) -> None:
        """GGUFChangedError when the file changed (`check`) or its path no longer names it
        (`moved`): before `what` is read again by path."""
        why = self.change() or self.moved()
        if why is not None:
            raise self.changed(why, what)

    def read_into(self, out: np.ndarray, offset: int, what: str) -> None:
        """Fills the contiguous array `out` with the file's bytes from `offset`:
        GGUFChangedError when the file now ends before them, GGUFError on a read error."""
        view = out.data.cast("B")
        done, n = 0, len(view)
        while done < n:
            try:
                got = _pread_into(self.fd, view[done:], offset + done)
            except OSError as e:
                raise GGUFError(f"{self.path}: cannot read {what}: {e.strerror or e}") from None
            if got <= 0:
                raise self.changed(self.change() or f"it now ends before byte {offset + n:,}",
                                   what)
            done += got


@dataclass(frozen=True)
class TensorBytes:
    """Where one tensor's bytes lie in an opened file, read on request (see the module doc)."""

    file: OpenedFile
    name: str
    offset: int
    nbytes: int

    @property
    def what(self) -> str:
        return f"tensor {self.name} (bytes {self.offset:,}..{self.offset + self.nbytes:,})"

    def read(self) -> np.ndarray:
        """uint8 [nbytes]: the whole tensor, read now."""
        self.file.check(self.what)
        out = np.empty(self.nbytes, np.uint8)
        self.file.read_into(out, self.offset, self.what)
        return out

    def rows(self, ids: np.ndarray, row_bytes: int) -> np.ndarray:
        """uint8 [ids.size, row_bytes]: rows `ids` (flattened) of a matrix stored row after
        row, one read each, straight into the result (a prompt's rows are a small part of the
        table: reading the spans between them would cost more)."""
        self.file.check(self.what)
        flat = np.asarray(ids, np.int64).reshape(-1)
        out = np.empty((flat.size, row_bytes), np.uint8)
        if flat.size == 0:
            return out
        rows = self.nbytes // row_bytes
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= rows:
            raise IndexError(f"row {lo if lo < 0 else hi} of tensor {self.name}, which has "
                             f"{rows:,} rows")
        view = out.data.cast("B")
        fd, at = self.file.fd, 0
        for offset in (flat * row_bytes + self.offset).tolist():
            row = view[at: at + row_bytes]
            try:
                got = _pread_into(fd, row, offset)
            except OSError:
                got = 0
            if got != row_bytes:  # the slow path says why (a short read, an I/O error)
                self.file.read_into(out[at // row_bytes], offset, self.what)
            at += row_bytes
        return out
