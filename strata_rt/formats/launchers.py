"""Launcher base classes a format's kernels build on, and the one MMQ launch every format uses.

- NativeKernels: gathers for native formats. An expert blob is plain byte ranges, so any native
  format's gathers are the same two copies (kernels/common/gather.cu), one expert per launch or
  up to 16 in one batched launch; a format subclasses it and adds its MMQ.
- PerExpertKernels: gathers and MMQ of a non-native format, one gather launch per expert. A
  subclass names its kernels and the source files defining them; the sources are looked up in
  `fmt.kernel_sources()`, so a plugin in its own package with its own kernel folder uses it as
  the built-in formats do.
- launch_mmq: the MMQ kernel ABI (see FormatKernels): arguments (Ids16, weights, acts, bounds,
  out, m, k), grid (m tiles, group position, row tiles).
- launch_mmq_table: the table products' ABI (FormatKernels.mmq_table): arguments (table,
  offset, acts, bounds, out, m, k), grid (m tiles, the layer's experts, row tiles).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import FormatError, PluginError
from ..resources import KERNELS_ROOT
from .contract import (
    MMQ_GROUP,
    ExpertLayout,
    FormatKernels,
    QuantFormat,
    first_misaligned,
    ids16,
)

if TYPE_CHECKING:
    from ..runtime import Runtime

log = logging.getLogger(__name__)

#: argument types of every MMQ kernel: 16 expert ids, weights, acts, bounds, out, m, k
MMQ_ARG_TYPES = "i" * MMQ_GROUP + "PPPPii"
#: argument types of every table MMQ kernel: the device table of the layer's blob addresses,
#: the part's offset in a blob, acts, bounds, out, m, k
MMQ_TABLE_ARG_TYPES = "PqPPPii"
#: CUDA's limit on grid.y and grid.z; MMQ kernels loop over row tiles, so capping is safe
GRID_YZ_MAX = 65535
#: the kernels number a launch's blocks in 32 bits (grouped_block, table_block in mma.cuh)
MAX_GRID_BLOCKS = 1 << 32

GATHER_SOURCE = KERNELS_ROOT / "common" / "gather.cu"
GATHER_THREADS = 256
#: uint4 words one thread copies per pass (GATHER_UNROLL in gather.cu)
GATHER_UNROLL = 4
#: cap on blocks per expert: enough to fill the GPU with one expert, few enough to keep a
#: batch's launch small
GATHER_MAX_BLOCKS = 256
#: cap on blocks along x of a per-expert gather
PER_EXPERT_GATHER_MAX_BLOCKS = 1024


@dataclass(frozen=True)
class MmqTile:
    """Geometry of one MMQ kernel: weight rows per block (m must divide by it), activation rows
    per row tile, threads per block, the multiple k must be, and dynamic shared memory."""

    m: int
    rows: int
    threads: int
    k_multiple: int
    shared: int = 0


def check_aligned(names_and_values: dict[str, int]) -> None:
    """Vectorized kernels load and store 16 bytes at a time; a misaligned address would fault
    on the device, so it is refused on the host with the offending value."""
    why = first_misaligned(names_and_values)
    if why is not None:
        raise FormatError(f"device address not aligned: {why}")


def grid_rows(rows_hint: int, tile_rows: int) -> int:
    """Row tiles per expert in the launch grid: at least one (the hint may be an estimate; the
    kernel reads exact counts from bounds and loops), at most CUDA's grid limit."""
    if rows_hint < 0:
        raise FormatError(f"rows_hint must be >= 0, got {rows_hint}")
    return min(max(1, -(-rows_hint // tile_rows)), GRID_YZ_MAX)


def launch_mmq(kernel: Any, tile: MmqTile, fmt_name: str, stream: Any, weights: int,
               expert_ids: tuple[int, ...], acts: int, bounds: int, out: int, m: int, k: int,
               rows_hint: int, *, images: Sequence[int] | None = None) -> None:
    """One grouped MMQ launch under the common ABI, after the host-side checks. `images`: the
    in-place form (FormatKernels.mmq_in_place) instead of `weights` (then unused): the address
    of each position's image, passed as 16 pointers (unused ones 0) before the expert ids."""
    ids = ids16(expert_ids)
    if m <= 0 or k <= 0 or m % tile.m or k % tile.k_multiple:
        raise FormatError(f"{fmt_name} MMQ needs m % {tile.m} == 0 and k % {tile.k_multiple} "
                          f"== 0; got m={m}, k={k}")
    if images is None:
        check_aligned({"weights": weights, "acts": acts, "out": out})
        args: tuple[int, ...] = (*ids, weights, acts, bounds, out, m, k)
    else:
        check_aligned({"acts": acts, "out": out,
                       **{f"image {p}": int(a) for p, a in enumerate(images)}})
        table = [int(a) for a in images] + [0] * (MMQ_GROUP - len(images))
        args = (*table, *ids, acts, bounds, out, m, k)
    kernel.launch(grid=(m // tile.m, len(expert_ids), grid_rows(rows_hint, tile.rows)),
                  block=(tile.threads, 1, 1), stream=stream, args=args, shared=tile.shared)


def check_table(what: str, table: int, offset: int, n_experts: int) -> None:
    """The host-side checks of a table launch: a table address the kernel can read 8-byte
    entries from, a part offset that keeps 16-byte aligned blobs' parts on 16 bytes, and an
    expert count the grid holds (FormatError naming `what` and the value otherwise). The
    table's entries live on the device and are the caller's to keep aligned."""
    if table == 0 or table % 8:
        raise FormatError(f"{what} table products: the expert table at {table} (0x{table:x}) "
                          "is not a nonzero multiple of 8 (device uint64 entries)")
    if offset < 0 or offset % 16:
        raise FormatError(f"{what} table products: the part's offset {offset} in a blob must "
                          "be a non-negative multiple of 16 (images start on 16 bytes)")
    if not 1 <= n_experts <= GRID_YZ_MAX:
        raise FormatError(f"{what} table products: n_experts must be 1..{GRID_YZ_MAX} (grid.y), "
                          f"got {n_experts}")


def launch_mmq_table(kernel: Any, tile: MmqTile, what: str, stream: Any, table: int,
                     offset: int, acts: int, bounds: int, out: int, m: int, k: int,
                     rows_hint: int, n_experts: int) -> None:
    """One table launch (FormatKernels.mmq_table) after the host-side checks: every expert of
    a layer, expert e's part at table[e] + offset (none where table[e] is 0), grid (m tiles,
    n_experts, row tiles sized from rows_hint as launch_mmq sizes them); the tile, block and
    shared memory of launch_mmq."""
    if m <= 0 or k <= 0 or m % tile.m or k % tile.k_multiple:
        raise FormatError(f"{what} MMQ needs m % {tile.m} == 0 and k % {tile.k_multiple} "
                          f"== 0; got m={m}, k={k}")
    check_table(what, table, offset, n_experts)
    check_aligned({"acts": acts, "out": out})
    grid = (m // tile.m, n_experts, grid_rows(rows_hint, tile.rows))
    if grid[0] * grid[1] * grid[2] >= MAX_GRID_BLOCKS:
        raise FormatError(f"{what} table products: a grid of {grid} blocks exceeds the "
                          "kernels' 32-bit block numbering")
    kernel.launch(grid=grid, block=(tile.threads, 1, 1), stream=stream,
                  args=(table, offset, acts, bounds, out, m, k), shared=tile.shared)


T = TypeVar("T")


def pick_by_rows(rule: tuple[tuple[int | None, str], ...], by_name: dict[str, T],
                 rows_hint: int, tile: str | None = None, what: str = "GEMM") -> T:
    """The tile a launch sized for rows_hint rows per expert uses: rule is (largest rows_hint,
    tile name) in order, ending with an unbounded (None) entry; by_name maps names to tiles.
    `tile` names one of by_name instead (a FormatError naming `what` when it is unknown)."""
    if tile is not None:
        if tile not in by_name:
            raise FormatError(f"{what} tile {tile!r} is unknown; valid: {', '.join(by_name)}")
        return by_name[tile]
    for bound, name in rule:
        if bound is None or rows_hint <= bound:
            return by_name[name]
    raise AssertionError("a tile rule ends with an unbounded entry")


def gather_blocks(nbytes: int) -> int:
    """Blocks along x for a copy of nbytes (16-byte words, GATHER_UNROLL per thread)."""
    words = -(-nbytes // 16)
    return max(1, min(GATHER_MAX_BLOCKS, -(-words // (GATHER_THREADS * GATHER_UNROLL))))


def _check_batch(n: int, first_pos: int) -> None:
    if not 1 <= n <= MMQ_GROUP or not 0 <= first_pos <= MMQ_GROUP - n:
        raise PluginError(
            f"gather_batch of {n} experts at position {first_pos}: a batch holds 1.."
            f"{MMQ_GROUP} experts and must end by position {MMQ_GROUP - 1}")


class NativeKernels(FormatKernels):
    """gather and gather_batch for any native format.

    `fallbacks` counts gather_batch calls that could not use the batched kernel (an address or
    size not a multiple of 16) and ran one gather per expert instead; the first such call also
    logs a warning naming the offending value, so a slow path never goes unnoticed.
    """

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        if not fmt.native:
            raise PluginError(f"format {fmt.name} is not native; NativeKernels copies plain "
                              "byte ranges and cannot gather it")
        mod = runtime.module(GATHER_SOURCE)
        self._one = mod.kernel("gather_one", "PPPqqqq")
        self._batch = mod.kernel("gather_batch", "P" * MMQ_GROUP + "PPqqqqqqiPi")
        lay = layout
        self._ranges = (lay.gate_up_offset, lay.gate_up_bytes, lay.down_offset, lay.down_bytes)
        self._blocks_one = gather_blocks(lay.gate_up_bytes + lay.down_bytes)
        self._blocks_batch = gather_blocks(max(lay.gate_up_bytes, lay.down_bytes))
        self.fallbacks = 0

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        lay = self.layout
        self._one.launch(
            grid=(self._blocks_one, 1, 1), block=(GATHER_THREADS, 1, 1), stream=stream,
            args=(src, gu_buf + pos * lay.gate_up_image_bytes,
                  down_buf + pos * lay.down_image_bytes, *self._ranges))

    def misaligned(self, srcs: list[int], first_pos: int, gu_buf: int,
                   down_buf: int) -> str | None:
        """Why the batched kernel cannot copy this batch (None when it can)."""
        lay = self.layout
        named = {"gate/up bytes": lay.gate_up_bytes, "down bytes": lay.down_bytes,
                 "gate/up offset": lay.gate_up_offset, "down offset": lay.down_offset,
                 "gate/up image bytes": lay.gate_up_image_bytes,
                 "down image bytes": lay.down_image_bytes,
                 "gate/up buffer": gu_buf + first_pos * lay.gate_up_image_bytes,
                 "down buffer": down_buf + first_pos * lay.down_image_bytes}
        named.update({f"source {i}": src for i, src in enumerate(srcs)})
        return first_misaligned(named)

    def gather_routed(self, stream, srcs: list[int], gu_buf: int, down_buf: int, bounds: int,
                      first_expert: int) -> None:
        _check_batch(len(srcs), 0)
        why = self.misaligned(srcs, 0, gu_buf, down_buf)
        if why is not None:  # skipping unrouted experts needs the batched kernel
            raise PluginError(f"{self.fmt.name}: a routed gather needs 16-byte copies: {why}")
        self._launch_batch(stream, srcs, 0, gu_buf, down_buf, bounds, first_expert)

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        _check_batch(len(srcs), first_pos)
        why = self.misaligned(srcs, first_pos, gu_buf, down_buf)
        if why is not None:
            if self.fallbacks == 0:
                log.warning("%s: gather_batch falls back to one gather per expert: %s",
                            self.fmt.name, why)
            self.fallbacks += 1
            for i, src in enumerate(srcs):
                self.gather(stream, src, first_pos + i, gu_buf, down_buf)
            return
        self._launch_batch(stream, srcs, first_pos, gu_buf, down_buf, 0, 0)

    def _launch_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                      down_buf: int, bounds: int, first_expert: int) -> None:
        n = len(srcs)
        lay = self.layout
        ptrs = list(srcs) + [0] * (MMQ_GROUP - n)
        self._batch.launch(
            grid=(self._blocks_batch, n, 1), block=(GATHER_THREADS, 1, 1), stream=stream,
            args=(*ptrs, gu_buf, down_buf, *self._ranges, lay.gate_up_image_bytes,
                  lay.down_image_bytes, first_pos, bounds, first_expert))


def kernel_source(fmt: QuantFormat, file_name: str) -> Path:
    """The file called `file_name` among fmt.kernel_sources()."""
    sources = [Path(p) for p in fmt.kernel_sources()]
    for path in sources:
        if path.name == file_name:
            return path
    listed = ", ".join(str(p) for p in sources) or "none"
    raise PluginError(f"format {fmt.name}: its launchers need the kernel source {file_name!r}, "
                      f"which kernel_sources() does not list (it lists: {listed})")


class PerExpertKernels(FormatKernels):
    """Launchers for a non-native format: one gather launch per expert, grid (blocks,
    gather_planes), block GATHER_THREADS, arguments (src, gate/up image, down image,
    *gather_args()); and the grouped MMQ under the common ABI (launch_mmq) with `mmq_tile`.

    A subclass sets the class attributes and implements gather_units and gather_args; the
    kernels are found by file name in fmt.kernel_sources() (both may live in one file)."""

    #: (kernel name, argument types after the three pointers src, gate/up image, down image)
    gather_kernel: ClassVar[tuple[str, str]]
    #: file among kernel_sources() that defines the gather kernel
    gather_source: ClassVar[str] = "gather.cu"
    #: grid.y of a gather launch (the parts the kernel copies or rebuilds)
    gather_planes: ClassVar[int]
    #: the MMQ kernel in mmq_source, or None for a subclass whose products run elsewhere (Q2
    #: blob's f16_gemm: the grouped fp16 GEMM): then no MMQ module is loaded
    mmq_kernel: ClassVar[str | None]
    mmq_source: ClassVar[str] = "mmq.cu"
    mmq_tile: ClassVar[MmqTile] = MmqTile(m=64, rows=64, threads=128, k_multiple=64)

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        name, arg_types = self.gather_kernel
        self._gather = runtime.module(kernel_source(fmt, self.gather_source)).kernel(
            name, "PPP" + arg_types)
        self._mmq = None if self.mmq_kernel is None else runtime.module(
            kernel_source(fmt, self.mmq_source)).kernel(self.mmq_kernel, MMQ_ARG_TYPES)
        units = max(self.gather_units() // 16, 1)
        self._gather_blocks = min(-(-units // GATHER_THREADS), PER_EXPERT_GATHER_MAX_BLOCKS)

    def gather_units(self) -> int:
        """Bytes of the largest plane one gather block row walks (sizes grid.x)."""
        raise NotImplementedError

    def gather_args(self) -> tuple[int, ...]:
        """The gather kernel's arguments after (src, gate/up image, down image)."""
        raise NotImplementedError

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        lay = self.layout
        gu = gu_buf + pos * lay.gate_up_image_bytes
        dn = down_buf + pos * lay.down_image_bytes
        check_aligned({"src": src, "gate/up image": gu, "down image": dn})
        self._gather.launch(grid=(self._gather_blocks, self.gather_planes, 1),
                            block=(GATHER_THREADS, 1, 1), stream=stream,
                            args=(src, gu, dn, *self.gather_args()))

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        if self._mmq is None:
            raise FormatError(f"{type(self).__name__} names no mmq_kernel and does not "
                              "override mmq")
        launch_mmq(self._mmq, self.mmq_tile, self.fmt.name, stream, weights, expert_ids, acts,
                   bounds, out, m, k, rows_hint)
