"""Output paths: checked before a run, written so that a reader never sees half a file.

A results path that cannot be written used to fail after the whole run ("Is a directory",
"File exists" for a path under a file, "Permission denied"), losing every result. The checks
here answer "can a file be created or rewritten here?" without leaving anything behind: they
walk up to the nearest existing folder and create (then remove) a probe file in it, which also
catches read-only mounts and ACLs that permission bits do not show.

`write_text_atomic` writes beside the target and renames, so a file rewritten after every
prompt is always either the previous complete version or the new one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a component without search permission
        return False


def _probe(folder: Path) -> str | None:
    """Why no file can be created in the existing folder, or None."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".strata-write-test-")
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return f"no permission to write in {folder}"
        return f"cannot write in {folder}: {e.strerror or e}"
    os.close(fd)
    os.unlink(name)
    return None


def _creatable(folder: Path) -> str | None:
    """Why `folder` (and the folders above it that are missing) cannot be created and
    written in, or None."""
    ancestor = folder
    while not _exists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, so no folder can be created under it"
    return _probe(ancestor)


def output_file_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a file, or None. A device or pipe that exists
    (/dev/null, /dev/stdout) is accepted as it is."""
    path = Path(path)
    if path.is_dir():
        return "is a directory; give a file path (a name inside it)"
    if _exists(path):
        if not path.is_file():
            return None
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # opens, changes nothing
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                return "no permission to write this file"
            return f"cannot be written: {e.strerror or e}"
        return _probe(path.parent)  # rewritten through a temporary name beside it
    return _creatable(path.parent)


def output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be used (or created) as a folder for output files, or None."""
    path = Path(path)
    if _exists(path):
        return _probe(path) if path.is_dir() else "is a file, not a folder"
    return _creatable(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `text` to a temporary file beside `path`, then renames it over `path`. A path
    that exists and is not a regular file (/dev/null, a pipe) is written directly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _exists(path) and not path.is_file():
        path.write_text(text)
        return
    mode = path.stat().st_mode & 0o7777 if _exists(path) else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
