"""What a path given as an input file is, told without opening it.

A FIFO given where a file is expected blocks the first read forever, a device reads garbage or
blocks, a directory or a symlink loop fails deep inside a reader with a message about
something else. `not_a_file(path)` names the kind from `stat` alone (nothing is opened), so a
loader can refuse the path with a message saying what it is; `open_regular(path)` opens it
without blocking (O_NONBLOCK) and checks again on the open descriptor, so a path swapped for a
FIFO between the two is refused too. Shared by every loader of user files.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_name(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file ('a directory', 'a FIFO
    (named pipe)', ...; None for one): the one table of file kinds."""
    if stat.S_ISREG(mode):
        return None
    for test, words in _KINDS:
        if test(mode):
            return words
    return "not a regular file"


def kind_of_mode(mode: int) -> str | None:
    """'is a directory', 'is a FIFO (named pipe)', ... for a stat mode; None for a regular
    file."""
    name = kind_name(mode)
    return None if name is None else f"is {name}"


def not_a_file(path: str | Path) -> str | None:
    """Why `path` is not a readable regular file ('is a FIFO (named pipe)', 'is a symlink
    loop', 'no such file', ...), or None when it is one. Never opens the path."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except ValueError:  # os.stat refuses the string itself
        return "is not a valid path (it holds a NUL character)"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (following its links never reaches a file)"
        if e.errno == errno.ENOENT:
            if os.path.lexists(p):
                return f"is a symlink to {os.readlink(p)!r}, which does not exist"
            return "no such file"
        if e.errno == errno.ENOTDIR:
            return "no such file (a part of the path is not a directory)"
        if e.errno == errno.EACCES:
            return "cannot be read: permission denied"
        return f"cannot be read: {e.strerror or e}"
    kind = kind_of_mode(st.st_mode)
    if kind is not None:
        return kind
    if not os.access(p, os.R_OK):
        return "cannot be read: permission denied"
    return None


def open_regular(path: str | Path) -> tuple[int, os.stat_result]:
    """An O_RDONLY descriptor of a regular file, opened without blocking (a FIFO swapped in
    after `not_a_file` cannot hang the open). Raises OSError, or ValueError naming the kind
    when the opened thing is not a regular file (the descriptor is closed then)."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    kind = kind_of_mode(st.st_mode)
    if kind is not None:
        os.close(fd)
        raise ValueError(kind)
    return fd, st
