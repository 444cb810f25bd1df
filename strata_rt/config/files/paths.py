"""Output paths: checked before a run, written so that a reader never sees half a file.

A results path that cannot be written used to fail after the whole run ("Is a directory",
"File exists" for a path under a file, "Permission denied"), losing every result. The checks
here answer "can a file be created or rewritten here?" without leaving anything behind: they
walk up to the nearest existing folder and create (then remove) a probe file in it, which also
catches read-only mounts and ACLs that permission bits do not show.

`write_text_atomic` writes beside the target and renames, so a file rewritten after every
prompt is always either the previous complete version or the new one. Only regular files are
ever renamed over: a device node given as an output (a copy of /dev/full, /dev/null itself)
would otherwise be moved aside or replaced, for every process on the machine. So FIFOs,
devices and sockets are refused as outputs, a symlink is written through (its target
rewritten, the link kept), and `output_collisions` refuses an output that is a file the run
reads (its config, model, prompt files) or another of its outputs.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from .file_kinds import kind_name
from .input_files import file_id


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
        kind = kind_name(os.stat(ancestor).st_mode) if _exists(ancestor) else None
        return f"{ancestor} is {kind or 'a file'}, so no folder can be created under it"
    return _probe(ancestor)


def output_target(path: str | Path) -> Path:
    """The file an output path writes: `path` with its symlinks followed (a link is written
    through, never replaced by a regular file); `path` itself when it is no link."""
    path = Path(path)
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


#: what a JSON document starts with (after white space); results only ever replace one
_JSON_STARTS = (b"{", b"[")


def results_file_problem(path: Path) -> str | None:
    """Why the existing file at `path` is not one JSON results may replace, or None (also
    for a new name): an empty file or a JSON document is rewritten; anything else (a model,
    a prompt file, a config named by mistake) would be lost. Checked after the collisions
    with the run's own inputs, whose message says more."""
    target = output_target(path)
    if not target.is_file():
        return None
    try:
        with open(target, "rb") as f:
            head = f.read(4096).lstrip()
    except OSError as e:
        return f"cannot be read to see what it holds: {e.strerror or e}"
    if not head or head[:1] in _JSON_STARTS:
        return None
    return (f"exists and is not a JSON document (it starts with {head[:8]!r}); results "
            "replace only an earlier results file: remove it or give another path")


#: every 64th position of each chunk's output goes to a residual dump (STRATA_PREFILL_DUMP_R)
DUMP_STRIDE = 64


def dump_file_problem(path: Path, hidden: int) -> str | None:
    """Why the existing file at `path` is not one a residual dump (records of an int64
    position and `hidden` float32 values, positions a multiple of 64) may replace, or None
    (also for a new name, an empty file or an earlier dump of a model as wide): the engine
    empties it when it opens, so a file named by mistake would be lost."""
    target = output_target(path)
    if not target.is_file():
        return None
    record = 8 + 4 * hidden
    try:
        size = target.stat().st_size
        with open(target, "rb") as f:
            head = f.read(record * 64)
    except OSError as e:
        return f"cannot be read to see what it holds: {e.strerror or e}"
    positions = [int.from_bytes(head[i:i + 8], "little", signed=True)
                 for i in range(0, len(head) - 7, record)]
    if size % record == 0 and all(p >= 0 and p % DUMP_STRIDE == 0 for p in positions):
        return None
    return (f"exists and is not a residual dump of a model of hidden size {hidden} (it starts "
            f"with {head[:8]!r}); the dump replaces only an earlier one: remove it or give "
            "another path")


def output_file_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a results file, or None. Only a regular file (or a
    new name) is written: a FIFO would block the run, and a device or socket would be renamed
    away by the atomic write, so they are refused, as is a symlink loop. A symlink is
    followed: what it points to is checked and written."""
    path = Path(path)
    if "\0" in str(path):
        return "a path cannot hold a NUL character"
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (following its links never reaches a file)"
        if e.errno == errno.ENAMETOOLONG:
            return "the path is too long"
        st = None
    target = output_target(path)
    if st is None:
        return _creatable(target.parent)
    if stat.S_ISDIR(st.st_mode):
        return "is a directory; give a file path (a name inside it)"
    if not stat.S_ISREG(st.st_mode):
        return (f"is {kind_name(st.st_mode)}; results are written to regular files only "
                "(a new name, or a file to rewrite)")
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND))  # opens, changes nothing
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return "no permission to write this file"
        return f"cannot be written: {e.strerror or e}"
    return _probe(target.parent)  # rewritten through a temporary name beside it


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode when both exist (hard links and
    symlinks included), else the same path once symlinks are followed."""
    ia, ib = file_id(a), file_id(b)
    if ia is not None or ib is not None:
        return ia == ib
    return os.path.realpath(a) == os.path.realpath(b)


def output_collisions(outputs: dict[str, Path], inputs: dict[str, Path]) -> list[str]:
    """One problem per output that names a file the run reads (`inputs`: what -> path) or
    another output: writing it would destroy the input, or one result the other. Keys are
    how the user gave each path (`--json: got 'run.yaml'`, `output.dump_r`)."""
    problems = []
    seen: list[tuple[str, Path]] = []
    for label, out in outputs.items():
        hit = next((f"{what} ({path})" for what, path in inputs.items()
                    if same_file(out, path)), None)
        if hit is None:
            hit = next((f"the path {other} also writes" for other, path in seen
                        if same_file(out, path)), None)
        if hit is not None:
            problems.append(f"{label}: got {str(out)!r}; is {hit}; writing there would "
                            "destroy it: give another path")
        seen.append((label, out))
    return problems


def output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be used (or created) as a folder for output files, or None."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (following its links never reaches a folder)"
        st = None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            return _probe(path)
        kind = kind_name(st.st_mode)
        return f"is {kind or 'a file'}, not a folder"
    return _creatable(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    """Writes `text` to a temporary file beside the target, then renames it over the target:
    a reader (or a run cut short, or a full disk) finds the previous complete version or the
    new one. A symlink is written through. Anything but a regular file or a new name is never
    replaced (OSError): output_file_problem refuses those before a run."""
    target = output_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    st = None
    if _exists(target):
        st = os.stat(target)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"is {kind_name(st.st_mode)}; not replaced by a "
                          "results file", str(path))
    mode = st.st_mode & 0o7777 if st is not None else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
