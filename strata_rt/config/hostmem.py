"""Host memory, checked before a run allocates it.

Asked for more than the machine has, numpy fails late and in its own words ("Unable to
allocate 81.0 GiB for an array with shape ..."), after the model's other weights were built.
A config says how large the expert store, the model's weights and the prompt buffers will be
before anything is allocated, so validation (and Engine.open, before the store) asks `require`
first and the user reads "needs 81.0 GiB of host memory; 23.1 GiB available".

What may be allocated is the kernel's estimate of memory available without swapping
(MemAvailable in /proc/meminfo), lowered to the headroom of a cgroup limit when the process
runs under a smaller one (a container). Elsewhere (macOS, Windows) the free physical pages that
sysconf reports stand in. STRATA_HOST_MEMORY_CHECK=0 skips the comparison (a system that
overcommits or swaps may still run). Sizes no machine holds (over 1 PiB, or beyond a 64-bit
address space) are refused always.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostMemoryError
from .settings import env

#: larger than any array numpy can allocate (its sizes are signed 64-bit)
MAX_ADDRESSABLE = (1 << 63) - 1
#: more than the memory of any machine (1 PiB): refused even where available memory is
#: unknown or the check is switched off
MAX_MACHINE = 1 << 50

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")


def format_bytes(n: int | float) -> str:
    """Bytes in binary units with one decimal: 81.0 GiB, 6.9 MiB; huge sizes stay readable."""
    if n < 1024:
        return f"{int(n)} bytes"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:,.1f} {unit}"


@dataclass(frozen=True)
class Available:
    """Bytes the process may still allocate (None: unknown) and where the figure came from."""

    nbytes: int | None
    source: str


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup"),
                     self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """limit - usage of the process's memory cgroup (v2, else v1), None without a limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:  # v2: "0::/path"; v1: "N:memory:/path"
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[1] == "" or "memory" in parts[1].split(",")):
            sub = "" if parts[1] == "" else "memory"
            candidates.append((root / sub / parts[2].lstrip("/"), parts[1] == ""))
    candidates += [(root, True), (root / "memory", False)]
    for folder, v2 in candidates:
        limit_file, usage_file = (("memory.max", "memory.current") if v2 else
                                  ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < MAX_MACHINE:
            return max(0, limit - usage)
    return None


def available() -> Available:
    """What the process may allocate now without swapping, as well as this host can say."""
    found = _meminfo_available()
    source = "MemAvailable in /proc/meminfo"
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "free physical pages (sysconf)"
        except (AttributeError, ValueError, OSError):
            found, source = None, "unknown on this system"
    headroom = _cgroup_headroom()
    if headroom is not None and (found is None or headroom < found):
        found, source = headroom, "the memory limit of this process's cgroup"
    return Available(found, source)


def shortfall(nbytes: int, what: str, detail: str = "",
              free: Available | None = None) -> str | None:
    """The message for `what` needing nbytes of host memory, or None when it fits. `detail`
    (what the bytes are) goes after the figures."""
    need = f"{what} needs {format_bytes(nbytes)} of host memory"
    detail = f" ({detail})" if detail else ""
    if nbytes > MAX_ADDRESSABLE:
        return f"{need}, more than a 64-bit address space holds{detail}"
    if nbytes > MAX_MACHINE:
        return f"{need}, more than any machine holds{detail}"
    if not env.flag("STRATA_HOST_MEMORY_CHECK", default=True):
        return None
    free = free if free is not None else available()
    if free.nbytes is not None and nbytes > free.nbytes:
        return (f"{need}; {format_bytes(free.nbytes)} available{detail}. Available is "
                f"{free.source}; STRATA_HOST_MEMORY_CHECK=0 skips this check")
    return None


def require(nbytes: int, what: str, detail: str = "") -> None:
    """Raises HostMemoryError (exit 2) unless nbytes of host memory can be allocated now:
    `require(store_bytes, "the expert store", "94 x 128 experts of 6.9 MiB")`."""
    message = shortfall(int(nbytes), what, detail)
    if message is not None:
        raise HostMemoryError(message)
