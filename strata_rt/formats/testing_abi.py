"""The launch ABI check of the conformance suite, on a machine without a GPU.

A stand-in for the Runtime records what a format's launchers do: which sources they load, which
kernels they prepare with which argument types, and every launch (grid, block, arguments). The
MMQ launch must follow the common ABI (arguments ids16, weights, acts, bounds, out, m, k; grid
m tiles x group position x row tiles). Then, with nvcc, each prepared kernel's parameter list is
read from the PTX of its source and compared with how the argument types pack (a pointer where
the kernel takes a pointer, a struct's bytes where it takes a struct), so an argument order or
type that disagrees with the kernel fails here instead of corrupting memory on a device. A
format that offers table products (mmq_table) is held to their ABI too: arguments (table,
offset, acts, bounds, out, m, k), grid (m tiles, the layer's experts, row tiles).
"""

from __future__ import annotations

import functools
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PluginError
from .contract import ids16
from .launchers import GRID_YZ_MAX, MMQ_ARG_TYPES, MMQ_TABLE_ARG_TYPES
from .testing_groups import GROUP, PARTS, ConformanceSkip, Subject, part_shape

#: device addresses the recorded launches receive (16-byte aligned, distinct)
_WEIGHTS, _ACTS, _BOUNDS, _OUT, _SRC, _GU, _DN = (0x10000 * i for i in range(1, 8))
_PTX_SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}
#: a table launch's expert table (8-byte aligned) and experts (not a multiple of the group)
_TABLE, _TABLE_EXPERTS = 0x80008, 40


@dataclass
class Prepared:
    source: Path
    name: str
    arg_types: str
    defines: tuple = ()
    flags: tuple = ()


@dataclass
class Launch:
    name: str
    arg_types: str
    grid: tuple
    block: tuple
    args: tuple
    shared: int


@dataclass
class Recorder:
    """Stands in for a Runtime: records prepared kernels and launches, runs nothing."""

    arch: str = "sm_80"
    prepared: list[Prepared] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)

    def module(self, source: Path, defines: Any = None, extra_flags: tuple = (),
               arch: str | None = None) -> Any:
        rec = self
        frozen = tuple(sorted((defines or {}).items()))

        class _Kernel:
            def __init__(self, name: str, arg_types: str):
                self.name, self.arg_types = name, arg_types

            def launch(self, grid, block, stream, args, shared: int = 0) -> None:
                rec.launches.append(Launch(self.name, self.arg_types, tuple(grid), tuple(block),
                                           tuple(args), shared))

        class _Module:
            def kernel(self, name: str, arg_types: str, overlap: bool = False) -> _Kernel:
                rec.prepared.append(Prepared(Path(source), name, arg_types, frozen,
                                             tuple(extra_flags)))
                return _Kernel(name, arg_types)

        return _Module()

    @property
    def calls(self) -> list[tuple]:
        """(name, grid, block, shared, args) of every launch so far, in order."""
        return [(x.name, x.grid, x.block, x.shared, x.args) for x in self.launches]

    @property
    def kernels(self) -> dict[str, str]:
        """Argument types of every prepared kernel, by name."""
        return {p.name: p.arg_types for p in self.prepared}


def _packed(arg_types: str) -> list[tuple[int, int]]:
    """(offset, size) of each argument as a prepared call packs them (native alignment)."""
    out, offset = [], 0
    for code in arg_types:
        size = struct.calcsize(code)
        offset = -(-offset // size) * size
        out.append((offset, size))
        offset += size
    return out


def ptx_params(ptx: str, name: str) -> list[tuple[int, int]] | None:
    """(offset, size) of the parameters of kernel `name` in PTX text (None: no such entry)."""
    found = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if found is None:
        return None
    out, offset = [], 0
    for decl in filter(None, (d.strip() for d in found.group(1).split(","))):
        tokens = decl.split()
        ti = next(i for i, t in enumerate(tokens) if re.fullmatch(r"\.[usbf](8|16|32|64)", t))
        # `.align N` before the type aligns the parameter; after `.ptr` it is the pointee's
        head = tokens[:ti]
        align = int(head[head.index(".align") + 1]) if ".align" in head else 0
        size = _PTX_SIZES[tokens[ti][2:]]
        count = re.search(r"\[(\d+)\]$", tokens[-1])
        total = size * (int(count.group(1)) if count else 1)
        align = align or size
        offset = -(-offset // align) * align
        out.append((offset, total))
        offset += total
    return out


@functools.lru_cache(maxsize=32)
def _ptx(source: Path, stamp: int, defines: tuple, flags: tuple, arch: str) -> str:
    from ..runtime.compile import include_flags, nvcc_path

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "k.ptx"
        cmd = [nvcc_path() or "nvcc", "-ptx", "-std=c++17", f"-arch={arch}", *include_flags(),
               *(f"-D{k}" if v is None else f"-D{k}={v}" for k, v in defines),
               *flags, "-o", str(target), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssertionError(f"nvcc -ptx failed for {source}:\n{done.stderr.strip()}")
        return target.read_text()


def check_params(p: Prepared, arch: str = "sm_80") -> None:
    """Fails when `p.arg_types` does not pack the way kernel `p.name` of `p.source` takes its
    parameters."""
    ptx = _ptx(p.source, p.source.stat().st_mtime_ns, p.defines, p.flags, arch)
    params = ptx_params(ptx, p.name)
    assert params is not None, f"{p.source.name} defines no extern \"C\" kernel {p.name!r}"
    args = _packed(p.arg_types)
    bounds = {o for o, _ in args} | {o + s for o, s in args}
    ok = bool(args) and params[-1][0] + params[-1][1] == args[-1][0] + args[-1][1]
    for offset, size in params:
        if size <= 8 and (offset, size) not in args:
            ok = False  # a scalar must meet one argument of its size at its offset
        elif size > 8 and not (offset in bounds and offset + size in bounds):
            ok = False  # a struct must span whole arguments
    assert ok, (f"kernel {p.name} of {p.source.name}: the launcher packs {p.arg_types!r} as "
                f"(offset, size) {args}, the kernel takes {params}")


def _check_table_abi(s: Subject, kern: Any, rec: Recorder) -> None:
    """mmq_table makes one launch of a kernel prepared with MMQ_TABLE_ARG_TYPES, its
    arguments and grid per the table ABI, for each part at its offset in the blob."""
    lay = s.layout
    for part, offset in zip(PARTS, (lay.gate_up_offset, lay.down_offset), strict=True):
        m, k = part_shape(part, s.hidden, s.ffn)
        rec.launches.clear()
        kern.mmq_table(None, _TABLE, offset, _ACTS, _BOUNDS, _OUT, m, k, 17, _TABLE_EXPERTS)
        assert len(rec.launches) == 1, f"mmq_table made {len(rec.launches)} launches, not one"
        got = rec.launches[0]
        assert got.arg_types == MMQ_TABLE_ARG_TYPES, (f"table kernel {got.name} prepared as "
                                                      f"{got.arg_types!r}, not "
                                                      f"{MMQ_TABLE_ARG_TYPES!r}")
        want = (_TABLE, offset, _ACTS, _BOUNDS, _OUT, m, k)
        assert got.args == want, f"table arguments {got.args}, the ABI says {want}"
        gx, gy, gz = got.grid
        assert gx >= 1 and m % gx == 0 and gy == _TABLE_EXPERTS and 1 <= gz <= GRID_YZ_MAX, \
            (f"table grid {got.grid} for m={m}: the ABI is (m tiles, the layer's experts = "
             f"{_TABLE_EXPERTS}, row tiles)")


def check_launch_abi(s: Subject) -> str:
    fmt = s.fmt
    if fmt.kernels_class() is None:
        return "no kernels"
    rec = Recorder()
    try:
        kern = fmt.kernels(rec, s.layout)  # type: ignore[arg-type]
    except AttributeError as e:
        raise ConformanceSkip(
            f"the launchers use a runtime feature the recorder lacks: {e}") from None
    for part in PARTS:
        m, k = part_shape(part, s.hidden, s.ffn)
        for hint in (17, 1):
            rec.launches.clear()
            kern.mmq(None, _WEIGHTS, GROUP, _ACTS, _BOUNDS, _OUT, m, k, hint)
            assert len(rec.launches) == 1, f"mmq made {len(rec.launches)} launches, not one"
            got = rec.launches[0]
            assert got.arg_types == MMQ_ARG_TYPES, \
                f"MMQ kernel {got.name} prepared as {got.arg_types!r}, not {MMQ_ARG_TYPES!r}"
            want = (*ids16(GROUP), _WEIGHTS, _ACTS, _BOUNDS, _OUT, m, k)
            assert got.args == want, f"MMQ arguments {got.args}, the ABI says {want}"
            gx, gy, gz = got.grid
            assert gx >= 1 and m % gx == 0 and gy == len(GROUP) and 1 <= gz <= GRID_YZ_MAX, \
                (f"MMQ grid {got.grid} for m={m}: the ABI is (m tiles, group position = "
                 f"{len(GROUP)}, row tiles)")
    tables = fmt.offers_mmq_table()
    if tables:
        _check_table_abi(s, kern, rec)
    rec.launches.clear()
    kern.gather(None, _SRC, 3, _GU, _DN)
    assert rec.launches, "gather launched nothing"
    if not fmt.native:
        try:
            kern.gather_batch(None, [_SRC], 0, _GU, _DN)
        except PluginError:
            pass
        else:
            raise AssertionError("a non-native format accepted gather_batch")
    from ..runtime.compile import nvcc_available

    what = "MMQ and table products" if tables else "MMQ"
    if not nvcc_available():
        return (f"{what} per the ABI; {len(rec.prepared)} prepared kernel(s) (nvcc absent: "
                "their parameters unchecked)")
    for p in rec.prepared:
        check_params(p)
    return (f"{what} per the ABI; {len(rec.prepared)} prepared kernel(s) match their PTX "
            "parameters")
