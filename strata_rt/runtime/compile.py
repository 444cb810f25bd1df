"""nvcc -> cubin with a disk cache; no pycuda here, so CPU machines and CI compile for real.

Every source, strata_rt's own or a plugin's, compiles with two include roots: the kernels folder
(`#include "common/mma.cuh"`) and the shared headers' folder, `common_include_dir()`
(`#include "mma.cuh"`); a source's own folder is searched first, as nvcc always does.

The cache key covers everything that can change the cubin: the source, every header a kernel
could include (the shared headers, the GGML templates of kernels/ggml, which a plugin's source
may include, and the source's own folder), the arch, the defines, the flags and the compiler's
version; include roots enter it by their contents, not their paths, so two installs of one
version share cubins. A stale cubin is therefore never loaded, and a
second run compiles nothing.

A cached file is trusted only when it matches the seal written beside it at build time (its
size and sha256, `<name>.seal`): a cache emptied to 0-byte files, cut short by a full disk or
damaged later is rebuilt, with a warning naming the file, instead of being loaded (or passing
`check-kernels`). A cubin or library without a seal (an older cache) is rebuilt once too.

This module knows nothing of formats or the registry: `check_kernels` takes anything with a
name and a list of sources.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..config.settings import env
from ..errors import KernelBuildError
from ..resources import KERNELS_ROOT

#: Flags every kernel is built with. No --use_fast_math: kernels promise exact, IEEE-rounded
#: arithmetic that numpy mirrors bit for bit.
BASE_FLAGS = ("-cubin", "-O3", "-std=c++17")
#: Files that can be #included and therefore take part in the cache key.
_INCLUDE_SUFFIXES = {".cu", ".cuh", ".h", ".hpp", ".inc"}
Defines = Mapping[str, "int | float | str | None"]
#: suffix of the file beside a cached build that records its size and digest
SEAL_SUFFIX = ".seal"
#: what every cubin and shared library nvcc writes starts with
_ELF_MAGIC = b"\x7fELF"

log = logging.getLogger(__name__)


def nvcc_path() -> str | None:
    """The nvcc to run: STRATA_NVCC, else nvcc on PATH, else None."""
    return env.text("STRATA_NVCC") or shutil.which("nvcc")


def nvcc_available() -> bool:
    return nvcc_path() is not None


def cache_dir() -> Path:
    configured = env.text("STRATA_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "strata_rt" / "kernels"


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str) -> str:
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise KernelBuildError(f"cannot run nvcc at {nvcc!r}: {e}") from None
    if done.returncode != 0:
        raise KernelBuildError(f"`{nvcc} --version` failed:\n{done.stdout}{done.stderr}")
    return done.stdout.strip()


def _require_nvcc() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise KernelBuildError(
            "nvcc not found: put the CUDA toolkit's nvcc on PATH or set STRATA_NVCC to it")
    return nvcc


def _include_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in _INCLUDE_SUFFIXES)


def _define_flags(defines: Defines | None) -> list[str]:
    flags = []
    defines = defines or {}
    for key in sorted(defines):
        value = defines[key]
        flags.append(f"-D{key}" if value is None else f"-D{key}={value}")
    return flags


def _common_dir() -> Path:
    """kernels/common under this module's KERNELS_ROOT (common_include_dir() in an install;
    tests point KERNELS_ROOT at a temporary tree)."""
    return KERNELS_ROOT / "common"


def include_flags() -> list[str]:
    """nvcc's include roots for every kernel source (strata_rt's or a plugin's)."""
    return ["-I", str(KERNELS_ROOT), "-I", str(_common_dir())]


def _cache_key(source: Path, text: bytes, arch: str, flags: list[str], version: str,
               extra: Mapping[str, bytes] | None = None) -> str:
    """sha256 over everything that can change the output. `extra` maps include roots outside
    the kernels tree to the bytes that identify their contents: those bytes enter the key, the
    roots' paths do not (two installs of one version share the build)."""
    h = hashlib.sha256()
    extra = dict(extra or {})
    roots = {str(KERNELS_ROOT): "<kernels>", str(_common_dir()): "<common>"}
    roots.update({path: "<extra>" for path in extra})
    keyed = [roots.get(f, f) for f in flags]
    for data in sorted(extra.values()):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    for part in (str(source.name).encode(), text, arch.encode(), "\0".join(keyed).encode(),
                 version.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    seen = set()
    # kernels/ggml: the shared GGML templates a plugin's source may include
    for folder in (_common_dir(), KERNELS_ROOT / "ggml", source.parent):
        for path in _include_files(folder):
            if path in seen:
                continue
            seen.add(path)
            h.update(str(path.relative_to(folder)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


def _read_source(source: Path, what: str) -> tuple[Path, bytes]:
    """The resolved path and bytes of a source; KernelBuildError when it cannot be read."""
    source = Path(source).resolve()
    try:
        return source, source.read_bytes()
    except OSError as e:
        raise KernelBuildError(f"{what} source {source}: cannot read it ({e})") from None


#: the marker of a source with arch-specific instructions (wgmma): check_kernels also builds it
#: for ARCH_SPECIFIC, where its guarded body compiles (other targets compile it empty)
ARCH_SPECIFIC_MARK = "__CUDA_ARCH_FEAT_SM90_ALL"
ARCH_SPECIFIC = "sm_90a"
#: the device arch (Runtime.arch) an ARCH_SPECIFIC cubin runs on
ARCH_SPECIFIC_RUNS_ON = "sm_90"


def arch_flag(arch: str) -> str:
    """nvcc's target flag: the explicit -gencode form for an arch-specific target ("sm_90a"),
    whose -arch shorthand some nvcc versions also expand to a plain pass that rejects wgmma."""
    if arch.endswith("a"):
        return f"-gencode=arch=compute_{arch[3:]},code={arch}"
    return f"-arch={arch}"


def compile_cubin(source: Path, arch: str, defines: Defines | None = None,
                  extra_flags: Iterable[str] = ()) -> Path:
    """Compiles `source` for `arch` (e.g. "sm_90") and returns the cached cubin's path.

    Raises KernelBuildError with nvcc's output when the source does not compile."""
    source, text = _read_source(source, "kernel")
    if not arch.startswith("sm_"):
        raise KernelBuildError(f"arch {arch!r} for {source.name}: expected sm_XY, e.g. sm_90")
    nvcc = _require_nvcc()
    flags = [*BASE_FLAGS, arch_flag(arch), *include_flags(), *_define_flags(defines),
             *extra_flags]
    key = _cache_key(source, text, arch, flags, nvcc_version(nvcc))
    target = cache_dir() / f"{source.stem}-{arch}-{key[:24]}.cubin"
    if cached_build_ok(target):
        return target
    what = f"{source} for {arch}" + (f" with {' '.join(_define_flags(defines))}"
                                     if defines else "")
    return _build(nvcc, flags, source, target, what)


#: Flags of a shared library (host code and kernels together, loaded with ctypes).
SHARED_FLAGS = ("-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17",
                "--expt-relaxed-constexpr", "-DNDEBUG")


def compile_shared(source: Path, arch: str, include_roots: Mapping[str, bytes]) -> Path:
    """Compiles `source` (host and device code) for `arch` into a cached shared library and
    returns its path. include_roots maps each extra include folder to the bytes that identify
    its contents (a version header): they join the cache key, the folder's path does not.

    Raises KernelBuildError with nvcc's output when the source does not compile."""
    source, text = _read_source(source, "library")
    nvcc = _require_nvcc()
    flags = [*SHARED_FLAGS, f"-arch={arch}", *include_flags()]
    for root in include_roots:
        flags += ["-I", root]
    key = _cache_key(source, text, arch, flags, nvcc_version(nvcc), include_roots)
    target = cache_dir() / f"lib{source.stem}-{arch}-{key[:24]}.so"
    if cached_build_ok(target):
        return target
    return _build(nvcc, flags, source, target, f"{source} for {arch}")


def seal_path(target: Path) -> Path:
    """The file beside a cached build that records its size and digest."""
    return target.with_name(target.name + SEAL_SUFFIX)


def _seal_text(data: bytes) -> str:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def cache_problem(target: Path) -> str | None:
    """Why the cached build at `target` cannot be trusted (None: it can, or it is absent).

    Checked: an ELF header, the size and the sha256 the seal recorded when nvcc wrote it."""
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if data[:4] != _ELF_MAGIC:
        return f"it is not an ELF file ({len(data):,} bytes)"
    try:
        sealed = seal_path(target).read_text()
    except (OSError, UnicodeDecodeError):
        return f"it has no seal ({seal_path(target).name}), so its bytes cannot be verified"
    if _seal_text(data) != sealed:
        size = sealed.split()[0] if sealed.split() else "?"
        return (f"its size or digest differs from the seal ({len(data):,} bytes; the seal "
                f"records {size} bytes)")
    return None


def cached_build_ok(target: Path) -> bool:
    """Whether `target` is a cached build to load as is. A damaged one is reported, and
    False tells the caller to rebuild it (the rebuild replaces the file and its seal)."""
    if not target.exists():
        return False
    why = cache_problem(target)
    if why is None:
        return True
    log.warning("kernel cache: %s: %s; rebuilding it", target, why)
    return False


def _build(nvcc: str, flags: list[str], source: Path, target: Path, what: str) -> Path:
    """Runs nvcc into a temporary file beside target, seals it (size and digest beside it),
    then renames it into place: the seal first, so a reader finds either no build, or a build
    and its own seal (a reader in between finds the old build and a new seal, and rebuilds)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [nvcc, *flags, "-o", tmp, str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise KernelBuildError(f"nvcc could not compile {what}:\n"
                                   f"{(done.stdout + done.stderr).strip()}\n"
                                   f"command: {' '.join(cmd)}")
        data = Path(tmp).read_bytes()
        if data[:4] != _ELF_MAGIC:
            raise KernelBuildError(f"nvcc wrote no ELF file for {what} ({len(data):,} bytes; "
                                   f"command: {' '.join(cmd)})")
        os.chmod(tmp, 0o755 if target.suffix == ".so" else 0o644)
        _write_seal(target, data)
        os.replace(tmp, target)  # atomic: a reader sees nothing or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _write_seal(target: Path, data: bytes) -> None:
    """The seal of `data`, written beside `target` through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".seal.tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_seal_text(data))
        os.chmod(tmp, 0o644)
        os.replace(tmp, seal_path(target))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True)
class KernelCheck:
    """One source compiled for one arch by `check_kernels`."""

    owner: str  # format name, or "common"
    source: Path
    arch: str
    ok: bool
    seconds: float
    message: str = ""  # the compiler's output on failure


class KernelOwner(Protocol):
    """What check_kernels needs of a format: its name and its .cu files."""

    @property
    def name(self) -> str: ...

    def kernel_sources(self) -> list[Path]: ...


def kernel_jobs(owners: Iterable[KernelOwner]) -> list[tuple[str, Path]]:
    """(owner, source) for every .cu under kernels/common (owner "common"), kernels/model
    (owner "model": the whole model's attention and dense kernels) and kernels/ggml (owner
    "ggml": the GGML types' decoders and dequantizing gather) and every owner's sources, each
    source once (the first owner that lists it)."""
    jobs = {p.resolve(): "common" for p in sorted((KERNELS_ROOT / "common").glob("*.cu"))}
    for folder in ("model", "ggml"):
        for p in sorted((KERNELS_ROOT / folder).glob("*.cu")):
            jobs.setdefault(p.resolve(), folder)
    for owner in owners:
        for p in owner.kernel_sources():
            jobs.setdefault(Path(p).resolve(), owner.name)
    return [(name, path) for path, name in jobs.items()]


def _arches_of(source: Path, arches: tuple[str, ...]) -> tuple[str, ...]:
    """The arches a source is checked for: also ARCH_SPECIFIC when it guards a body for it
    and the check covers the plain sm_90."""
    try:
        marked = ARCH_SPECIFIC_MARK in source.read_text(errors="replace")
    except OSError:
        marked = False  # compile_cubin reports the unreadable source
    return (*arches, ARCH_SPECIFIC) if marked and "sm_90" in arches else arches


def check_kernels(owners: Iterable[KernelOwner], arches: Iterable[str] = ("sm_80", "sm_90"),
                  workers: int | None = None) -> list[KernelCheck]:
    """Compiles the shared kernels and every owner's sources for every arch (in parallel;
    nvcc runs in its own process) and reports each one instead of stopping at the first
    failure. Finding no shared kernels is an error: strata_rt was installed without them."""
    _require_nvcc()
    jobs = kernel_jobs(owners)
    if not any(owner == "common" for owner, _ in jobs):
        raise KernelBuildError(
            f"no kernel sources in {KERNELS_ROOT / 'common'}: this strata_rt install lacks "
            "its CUDA sources; reinstall it from a wheel or sdist built from its source tree")
    arches = tuple(arches)
    tasks = [(owner, src, arch) for owner, src in jobs for arch in _arches_of(src, arches)]

    def one(task: tuple[str, Path, str]) -> KernelCheck:
        owner, src, arch = task
        start = time.perf_counter()
        try:
            compile_cubin(src, arch)
        except KernelBuildError as e:
            return KernelCheck(owner, src, arch, False, time.perf_counter() - start, str(e))
        return KernelCheck(owner, src, arch, True, time.perf_counter() - start)

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        return list(pool.map(one, tasks))
