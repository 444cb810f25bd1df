"""Files a run reads, named by what they are and read with bounded memory and no wait.

Opening a FIFO blocks until a writer comes, a character device such as /dev/zero never ends,
and `Path.is_file()` answers False for both, so a check that asked only that called them "no
such file" (or, without a check, hung or read until memory ran out). Here every path is first
named by its kind (missing, directory, FIFO, character or block device, socket, a symlink
loop, no permission), then opened without blocking (O_NONBLOCK), checked again on the open
descriptor (the path may change between the two) and read up to a size limit decided before
the first byte is read. Text is decoded as UTF-8, and a file holding NUL bytes is called
binary rather than "not UTF-8".
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .file_kinds import kind_name

#: a run config or a plugins.yaml: a hundred times a real one (a few KiB), and what the
#: YAML parser (pure Python, about 100 KiB/s on a loaded core) reads in a few seconds
CONFIG_LIMIT = 256 << 10
#: a token file, a routing profile or a prompt given on the command line
DATA_LIMIT = 16 << 20
#: a text to score (`strata perplexity --file`): 16M tokens or so, hours of windows; its
#: tokens are held as Python ints (28 bytes each), so the bound is the memory's too
TEXT_LIMIT = 64 << 20


class InputFileError(Exception):
    """Why a file cannot be read, in words that name its kind (`why`); callers wrap it in
    the error of their input (ConfigError, PluginError) with the option or key."""

    def __init__(self, path: Path, why: str):
        self.path = Path(path)
        self.why = why
        super().__init__(f"{path}: {why}")


def path_text_problem(name: str) -> str | None:
    """Why no file can have the name `name`, or None: a NUL character, or a lone UTF-16
    surrogate (a YAML "\\ud800" escape; the file system call would raise) other than the
    ones that stand for undecodable bytes."""
    if "\0" in name:
        return "a path cannot hold a NUL character"
    try:
        os.fsencode(name)
    except UnicodeEncodeError as e:
        return (f"character {e.start + 1} ({ascii(name[e.start])[1:-1]}) is half of a UTF-16 "
                "surrogate pair, which no file name can hold")
    return None


def user_path(value: str | Path) -> Path:
    """`value` as a path, a leading `~` or `~name` read as a home folder as a shell reads it;
    InputFileError saying why when that names no home folder here (an unknown user name, or
    `~` with neither HOME nor a user entry). `./~name` names a file of that name."""
    text = os.fspath(value)
    if not text.startswith("~"):
        return Path(text)
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):  # left as it was: no home folder for that name
        head = text.split("/", 1)[0]
        who = ("the home folder, and none is known here (HOME is not set)" if head == "~"
               else f"the home folder of user {head[1:]!r}, and there is no such user")
        raise InputFileError(Path(text), f"starts with {head}, which names {who} (for a "
                             f"file whose name starts with ~, write ./{text})")
    return Path(expanded)


def _stat_problem(path: Path, e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symlink loop (following its links never reaches a file)"
    if e.errno == errno.ENOENT:
        return ("is a symlink to a missing file" if os.path.islink(path)
                else "no such file")
    if e.errno == errno.ENOTDIR:
        return "no such file (a part of the path is a file, not a folder)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "no permission to read it"
    if e.errno == errno.ENAMETOOLONG:
        return "the path is too long"
    return f"cannot be read: {e.strerror or e}"


def regular_file_problem(path: str | Path) -> str | None:
    """Why `path` is not a regular file that can be opened for reading, or None. Symlinks
    are followed; a loop of them is named as such."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        return _stat_problem(path, e)
    except ValueError:  # a NUL byte in the path
        return "the path holds a NUL character"
    kind = kind_name(st.st_mode)
    if kind is not None:
        return f"is {kind}; expected a regular file"
    if not os.access(path, os.R_OK):
        return "no permission to read it"
    return None


def read_bytes(path: str | Path, limit: int, what: str = "a file") -> bytes:
    """The bytes of a regular file of at most `limit` bytes; InputFileError otherwise (its
    kind, its size against the limit, or the error reading it). Never blocks on a FIFO and
    never reads more than limit + 1 bytes."""
    path = Path(path)
    why = regular_file_problem(path)
    if why is not None:
        raise InputFileError(path, why)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise InputFileError(path, _stat_problem(path, e)) from None
    try:
        st = os.fstat(fd)
        kind = kind_name(st.st_mode)  # the path may have been swapped since the check
        if kind is not None:
            raise InputFileError(path, f"is {kind}; expected a regular file")
        if st.st_size > limit:
            raise InputFileError(path, f"is {st.st_size:,} bytes; {what} is at most "
                                       f"{limit:,} bytes")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise InputFileError(path, f"cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if total > limit:  # grew while being read (or a size the file system does not report)
        raise InputFileError(path, f"holds more than {limit:,} bytes; {what} is at most "
                                   f"{limit:,} bytes")
    return b"".join(chunks)


def decode_text(data: bytes, path: str | Path, what: str = "a UTF-8 text file") -> str:
    """UTF-8 text, or InputFileError calling the bytes binary (a NUL byte) or naming the
    first byte that is not UTF-8."""
    if b"\0" in data:
        at = data.index(b"\0")
        raise InputFileError(Path(path), f"is a binary file (a NUL byte at offset {at:,}), "
                                         f"not {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(Path(path), f"is not UTF-8 text (byte {e.start:,}: "
                                         f"{e.reason}); expected {what}") from None


def read_text(path: str | Path, limit: int, what: str = "a UTF-8 text file") -> str:
    """read_bytes, then decode_text."""
    return decode_text(read_bytes(path, limit, what), path, what)


def check_utf8(text: str, where: str) -> str | None:
    """Why a str from the command line or the environment is not valid UTF-8 (Python keeps
    undecodable bytes of argv as lone surrogates), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        try:  # a byte argv could not decode comes back as itself
            shown = f"byte {char.encode('utf-8', 'surrogateescape')[0]:#04x}"
        except UnicodeEncodeError:
            shown = f"U+{ord(char):04X}"
        return f"{where} is not valid UTF-8 ({shown} at character {e.start}); give UTF-8 text"
    return None


def file_id(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of what `path` names after its symlinks, or None when it does not
    exist (or cannot be looked at): two paths name one file when these are equal."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino
