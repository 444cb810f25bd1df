"""The grouped fp16 GEMM on Hopper's warpgroup tensor cores: CUTLASS kernels (wgmma operands fed
by TMA, warp-specialized persistent blocks) compiled from the headers of the nvidia-cutlass
package into a shared library (kernels/cutlass/grouped_gemm_sm90.cu) driven through ctypes.

Why CUTLASS: the project's own fp16 GEMM (gemm_f16.cu) issues mma.sync, which an sm_90 GPU runs
at a fraction of its wgmma rate, and Nsight showed it latency bound. A wgmma kernel needs TMA
descriptors, mbarrier pipelines and warp specialization; CUTLASS's grouped kernels are the
maintained form of exactly that, and the package ships only headers, compiled here by the nvcc
the project already requires. Only sm_90 (compiled for sm_90a) runs them; elsewhere the own
kernels serve every size.

`CutlassGemm.gemm` has the FormatKernels.mmq contract; strata_rt.gemm.grouped_gemm routes a launch
here by rows_hint (see its TILE_RULE), so the formats that multiply fp16 images use it without
knowing. The routing never returns to the host: a prepare kernel reads bounds on the device.

Headers are found in STRATA_CUTLASS_DIR (a CUTLASS checkout: include/ and tools/util/include/)
or in the installed nvidia-cutlass package (the `cuda` extra installs it); nothing is imported.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.settings import env
from ..errors import FormatError, KernelBuildError
from ..formats.contract import MMQ_GROUP, ids16
from ..formats.launchers import check_aligned, pick_by_rows
from ..resources import KERNELS_ROOT
from ..runtime.compile import KernelCheck, compile_shared
from ..runtime.graph import is_capturing

if TYPE_CHECKING:
    from ..runtime import Runtime
    from ..runtime.memory import DeviceBuffer

log = logging.getLogger(__name__)

CUTLASS_SOURCE = KERNELS_ROOT / "cutlass" / "grouped_gemm_sm90.cu"
#: the library's extern "C" surface version (strata_cutlass_abi)
ABI = 3
#: wgmma and TMA exist from sm_90; the "a" target enables the arch-specific instructions
LIBRARY_ARCH = "sm_90a"
RUNS_ON = "sm_90"
#: k: 16-byte rows of fp16 operands; m: 16-byte rows of fp32 outputs
K_MULTIPLE = 8
M_MULTIPLE = 4
INSTALL_HINT = ("pip install nvidia-cutlass (or the cuda extra: pip install 'strata_rt[cuda]'), "
                "or set STRATA_CUTLASS_DIR to a CUTLASS checkout")
_ERR_LEN = 512
#: argument blocks kept allocated and initialized ahead of streams not seen yet
SPARE_BLOCKS = 4


@dataclass(frozen=True)
class CutlassTile:
    """One kernel of the library: bm activation rows x bn weight rows per output tile, a
    `schedule` of CUTLASS's (cooperative: two consumer warpgroups share a tile; pingpong: each
    owns one, alternating), `cluster` blocks along M sharing weight tiles by TMA multicast.
    index is the kernel's number in grouped_gemm_sm90.cu."""

    name: str
    index: int
    bm: int
    bn: int
    schedule: str
    cluster: int


#: every kernel of grouped_gemm_sm90.cu, in its order (tests/test_cutlass_gemm.py checks)
CUTLASS_TILES = (
    CutlassTile("cutlass_128x256", 0, 128, 256, "cooperative", 1),
    CutlassTile("cutlass_64x256", 1, 64, 256, "pingpong", 1),
    CutlassTile("cutlass_64x128", 2, 64, 128, "pingpong", 1),
    CutlassTile("cutlass_128x128", 3, 128, 128, "cooperative", 1),
)
CUTLASS_BY_NAME = {t.name: t for t in CUTLASS_TILES}
#: (largest rows_hint, tile) in order, for launches grouped_gemm hands over (its TILE_RULE says
#: from which rows_hint); set from bench/bench_gemm.py's per-tile sweep, where the pingpong
#: 64x256 tile was the fastest or within 3% of it on both geometries from 2,048 tokens up
CUTLASS_RULE = ((None, "cutlass_64x256"),)


def cutlass_tile(rows_hint: int, tile: str | None = None) -> CutlassTile:
    """The kernel CutlassGemm.gemm runs for rows_hint (or the one `tile` names)."""
    return pick_by_rows(CUTLASS_RULE, CUTLASS_BY_NAME, rows_hint, tile, "CUTLASS GEMM")


@dataclass(frozen=True)
class CutlassHeaders:
    """Include roots of a CUTLASS tree and the bytes that identify its version."""

    include: Path
    util_include: Path
    version: bytes

    def roots(self) -> dict[str, bytes]:
        return {str(self.include): self.version, str(self.util_include): self.version}


def find_headers() -> tuple[CutlassHeaders | None, str]:
    """The CUTLASS headers to compile with, or None and why none were found."""
    configured = env.text("STRATA_CUTLASS_DIR")
    if configured:
        roots = [Path(configured)]
        where = f"STRATA_CUTLASS_DIR={configured}"
    else:
        try:
            spec = importlib.util.find_spec("cutlass_library")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            return None, "the nvidia-cutlass package is not installed"
        roots = [Path(p) / "source" for p in spec.submodule_search_locations]
        where = "the nvidia-cutlass package"
    for root in roots:
        version = root / "include" / "cutlass" / "version.h"
        util = root / "tools" / "util" / "include"
        if version.is_file() and (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
            return CutlassHeaders(root / "include", util, version.read_bytes()), ""
    return None, (f"{where} holds no CUTLASS headers (looked for include/cutlass/version.h and "
                  f"tools/util/include/cutlass/util/packed_stride.hpp under "
                  f"{', '.join(map(str, roots))})")


def build_library() -> Path:
    """Compiles (once; then cached) the library and returns its path."""
    headers, why = find_headers()
    if headers is None:
        raise KernelBuildError(f"the CUTLASS grouped GEMM cannot be built: {why}; "
                               f"{INSTALL_HINT}")
    return compile_shared(CUTLASS_SOURCE, LIBRARY_ARCH, headers.roots())


def check_library() -> KernelCheck | None:
    """`strata check-kernels`' entry for the library: its build, timed, or None (with a log
    line saying why) when the headers are missing."""
    headers, why = find_headers()
    if headers is None:
        return None
    start = time.perf_counter()
    try:
        build_library()
    except KernelBuildError as e:
        return KernelCheck("cutlass", CUTLASS_SOURCE, LIBRARY_ARCH, False,
                           time.perf_counter() - start, str(e))
    return KernelCheck("cutlass", CUTLASS_SOURCE, LIBRARY_ARCH, True,
                       time.perf_counter() - start)


def load_library(path: Path) -> ctypes.CDLL:
    """The built library with its signatures, its ABI checked."""
    lib = ctypes.CDLL(str(path))
    vp, i32, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.strata_cutlass_abi.restype = i32
    lib.strata_cutlass_args_bytes.restype = size
    lib.strata_cutlass_tiles.restype = i32
    lib.strata_cutlass_open.argtypes, lib.strata_cutlass_open.restype = [i32], vp
    lib.strata_cutlass_close.argtypes, lib.strata_cutlass_close.restype = [vp], None
    lib.strata_cutlass_workspace_bytes.argtypes = [vp, i32]
    lib.strata_cutlass_workspace_bytes.restype = size
    lib.strata_cutlass_gemm.argtypes = [vp, i32, vp, ctypes.POINTER(i32), vp, vp, vp, vp, i32,
                                        i32, vp, vp, size, ctypes.c_char_p, i32]
    lib.strata_cutlass_gemm.restype = i32
    if lib.strata_cutlass_abi() != ABI or lib.strata_cutlass_tiles() != len(CUTLASS_TILES):
        raise KernelBuildError(
            f"{path}: ABI {lib.strata_cutlass_abi()} with {lib.strata_cutlass_tiles()} kernels; "
            f"this strata_rt expects ABI {ABI} with {len(CUTLASS_TILES)}")
    return lib


def unavailable_reason(runtime: Runtime) -> str | None:
    """Why CutlassGemm cannot run on this runtime's device, or None when it can (the library
    may still have to be compiled)."""
    arch = getattr(runtime, "arch", None)
    if arch != RUNS_ON:
        return f"the CUTLASS kernels run on {RUNS_ON} only; this device is {arch}"
    headers, why = find_headers()
    return None if headers is not None else f"{why}; {INSTALL_HINT}"


class CutlassGemm:
    """The library opened on one runtime's context: a session (its initialized kernels) and,
    per stream, an argument block with its workspace (a launch's prepare kernel writes the
    block its grouped kernel then reads; launches on one stream are ordered, so a stream's block
    is never overwritten while read). A captured graph keeps its stream's block: replay it on
    the stream it was captured on (as the engine does), or while that stream is idle. `free`
    (also at runtime close) ends it all."""

    def __init__(self, runtime: Runtime):
        why = unavailable_reason(runtime)
        if why is not None:
            raise KernelBuildError(why)
        self.runtime = runtime
        log.info("preparing the CUTLASS grouped GEMM (the first build takes a minute or two; "
                 "later runs load it from the kernel cache)")
        self.lib = load_library(build_library())
        sms = int(runtime.device.get_attribute(
            runtime.drv.device_attribute.MULTIPROCESSOR_COUNT))
        self._session = self.lib.strata_cutlass_open(sms)
        if not self._session:
            raise KernelBuildError("the CUTLASS library could not read the current device")
        self.workspace_bytes = max(
            int(self.lib.strata_cutlass_workspace_bytes(self._session, t.index))
            for t in CUTLASS_TILES)
        # an argument block with its workspace per stream; a few spare ones are allocated
        # and initialized ahead, because a stream first seen inside a graph capture can
        # neither allocate nor wait for an initialization
        self._block_bytes = _align(int(self.lib.strata_cutlass_args_bytes()))
        self._buffers: list[DeviceBuffer] = []
        self._spare: list[int] = []
        self._blocks: dict[int, int] = {}
        self._err = ctypes.create_string_buffer(_ERR_LEN)
        self._lock = threading.Lock()
        runtime._own(self)
        self._top_up()

    def _top_up(self) -> None:
        """Allocates spare blocks up to SPARE_BLOCKS and runs every kernel once on each, with no
        rows, on a private stream: the library's modules load and each (kernel, block) is
        initialized now, and a library that cannot run on this device fails here."""
        stream = self.runtime.stream("cutlass warm-up")
        while len(self._spare) < SPARE_BLOCKS:
            buf = self.runtime.alloc(self._block_bytes + _align(max(self.workspace_bytes, 1)))
            self._buffers.append(buf)
            for t in CUTLASS_TILES:
                self._launch_on(stream, buf.ptr, t, (-1,) * MMQ_GROUP, buf.ptr, buf.ptr, 0,
                                buf.ptr, 256, 64)
            self._spare.append(buf.ptr)
        stream.synchronize()

    def gemm(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
             out: int, m: int, k: int, rows_hint: int, *, tile: str | None = None) -> None:
        """out[r, :] = W_p @ acts[r, :] for every row r of every expert of the group (the
        FormatKernels.mmq contract; see grouped_gemm.GroupedGemm.gemm); `tile` names a kernel
        of CUTLASS_TILES instead of the one CUTLASS_RULE picks."""
        chosen = cutlass_tile(rows_hint, tile)
        if self._session is None:
            raise FormatError("CutlassGemm used after free()")
        ids = ids16(expert_ids)
        if m <= 0 or k <= 0 or m % M_MULTIPLE or k % K_MULTIPLE:
            raise FormatError(f"CUTLASS GEMM needs m % {M_MULTIPLE} == 0 and k % {K_MULTIPLE} "
                              f"== 0; got m={m}, k={k}")
        check_aligned({"weights": weights, "acts": acts, "out": out})
        with self._lock:
            self._launch_on(stream, self._block_for(stream), chosen, ids, weights, acts, bounds,
                            out, m, k)
            if len(self._spare) < SPARE_BLOCKS and not is_capturing(stream):
                self._top_up()

    def _launch_on(self, stream, block: int, tile: CutlassTile, ids: tuple[int, ...],
                   weights: int, acts: int, bounds: int, out: int, m: int, k: int) -> None:
        id_arr = (ctypes.c_int * len(ids))(*ids)
        code = self.lib.strata_cutlass_gemm(
            self._session, tile.index, ctypes.c_void_p(stream.handle or None), id_arr, weights,
            acts, bounds, out, m, k, block, block + self._block_bytes, self.workspace_bytes,
            self._err, _ERR_LEN)
        if code != 0:
            raise FormatError(f"CUTLASS GEMM {tile.name} (m={m}, k={k}) failed: "
                              f"{self._err.value.decode(errors='replace')}")

    def _block_for(self, stream) -> int:
        """The stream's argument block. A handle names one live stream: CUDA releases a
        destroyed stream only after its work has finished, so a later stream that gets the
        same handle may take over its block."""
        key = int(stream.handle or 0)
        if key not in self._blocks:
            if not self._spare:
                raise FormatError(
                    f"CUTLASS GEMM: more than {SPARE_BLOCKS} streams launched it for the first "
                    "time inside one graph capture; launch once on each stream before capturing")
            self._blocks[key] = self._spare.pop()
        return self._blocks[key]

    def free(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            self.lib.strata_cutlass_close(session)
        for buf in self._buffers:
            buf.free()
        self._buffers.clear()
        self._blocks.clear()
        self._spare.clear()


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


_opened: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cutlass_for(runtime: Runtime) -> CutlassGemm | None:
    """The runtime's CutlassGemm (one per runtime, shared by every GroupedGemm), or None when
    the runtime's f16_gemm policy (an engine's EngineConfig.f16_gemm, from STRATA_F16_GEMM) says
    `own` or, under `auto`, the device or the headers do not allow it (a warning says which,
    once per runtime). `cutlass` makes that an error instead."""
    mode = getattr(runtime, "f16_gemm", "auto")  # a test's stand-in runtime may not have one
    if mode == "own":
        return None
    if getattr(runtime, "arch", None) == RUNS_ON and runtime in _opened:
        return _opened[runtime]
    why = unavailable_reason(runtime)
    if why is not None:
        if mode == "cutlass":
            raise KernelBuildError(f"STRATA_F16_GEMM=cutlass: {why}")
        if getattr(runtime, "arch", None) == RUNS_ON:  # elsewhere the own kernels are simply
            log.warning("fp16 GEMM: the own mma.sync kernels serve every size because %s "
                        "(STRATA_F16_GEMM=own silences this)", why)  # the kernels
            _opened[runtime] = None
        return None
    gemm = CutlassGemm(runtime)
    _opened[runtime] = gemm
    return gemm
