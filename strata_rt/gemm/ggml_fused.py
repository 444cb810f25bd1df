"""Launchers of the grouped GEMM that decodes native GGML blocks in its main loop, for every
built-in type (kernels/ggml/fused.cu) or a plugin's own decoder (its .cu with one
STRATA_GGML_KERNELS line; kernels/ggml/templates.cuh).

Why: a dequantizing gather writes every expert of a group as fp16 images whatever the prompt
length, which dominates a short prompt's layer; here the group buffers hold the native blocks
(a byte copy) and each block tile decodes its weights in shared memory and registers right
before the tensor-core multiply. It generalises the IQ3_XXS kernel (fused_gemm.py) to any
decoder. Each tile has three entries (ENTRIES): a group buffer (gemm), images where they lie
(gemm_at: up to 16 addresses) and a layer's every expert in one launch through a device table
of blob addresses (gemm_table).

Numerics: the same bytes as GgmlGather's images followed by GroupedGemm.gemm (the own fp16
kernels), for every type, tile and rows_hint: each weight is the gather's fp16 value, each
output one fp32 accumulator from zero taking one mma per 16 values of K in ascending order.

Modules: the built-in kernels compile one type per module (fused.cu with STRATA_GGML_ONLY=<TYPE>),
the first time a type is used, so a model pays for the types it holds; a plugin's source is one
module with its decoders' kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FormatError
from ..formats.contract import MMQ_GROUP
from ..formats.launchers import (
    MMQ_ARG_TYPES,
    MMQ_TABLE_ARG_TYPES,
    launch_mmq,
    launch_mmq_table,
    pick_by_rows,
)
from ..resources import KERNELS_ROOT
from .ggml_decoders import (
    ONLY_DEFINE,
    TILES,
    TILES_BY_NAME,
    DecoderModule,
    DecoderSpec,
    FusedTile,
    GgmlKey,
    resolve,
)

if TYPE_CHECKING:
    from ..runtime import Runtime

FUSED_SOURCE = KERNELS_ROOT / "ggml" / "fused.cu"
#: the in-place kernels' arguments: 16 image addresses before the MMQ arguments (no weights)
AT_ARG_TYPES = "P" * MMQ_GROUP + MMQ_ARG_TYPES.replace("P", "", 1)
#: the three entries of every tile: a group buffer, images where they lie (16 addresses), and
#: a layer's experts through a device table; their kernels' argument types
ENTRIES = ("grouped", "at", "tab")
ENTRY_ARG_TYPES = {"grouped": MMQ_ARG_TYPES, "at": AT_ARG_TYPES, "tab": MMQ_TABLE_ARG_TYPES}
#: (largest rows_hint, tile) in order; beyond the last bound the last tile. First guesses, as
#: the IQ3_XXS kernel's: the smallest tile holding an expert's rows reads its weights once.
TILE_RULE = ((16, "m16"), (32, "m32"), (None, "m64"))
#: the kernels keep 32-bit byte offsets inside an image
MAX_IMAGE_BYTES = 1 << 32


def kernel_name(d: DecoderSpec, tile: FusedTile, entry: str = "grouped") -> str:
    """The kernel of one entry of a tile: ggml_fused_<SUFFIX>_<tile> (grouped),
    ggml_fused_at_<SUFFIX>_<tile> (at: the in-place twin) or ggml_fused_tab_<SUFFIX>_<tile>
    (tab: the table twin)."""
    if entry not in ENTRIES:
        raise FormatError(f"fused GGML entry {entry!r} is unknown; valid: {', '.join(ENTRIES)}")
    infix = "" if entry == "grouped" else f"{entry}_"
    return f"ggml_fused_{infix}{d.name}_{tile.name}"


def pick_tile(rows_hint: int, tile: str | None = None) -> FusedTile:
    """The tile a launch sized for rows_hint rows per expert uses (or the one named)."""
    return pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint, tile, "fused GGML")


def native_image_bytes(gtype: GgmlKey, m: int, k: int) -> int:
    """Bytes of one native image of m rows of k values of a type (the group-buffer stride);
    FormatError unless the fused kernels can read it: k a multiple of the type's stage
    values, and the image a multiple of 16 bytes under 4 GiB (so a 16-byte chunk read around
    a row's bytes never leaves the image)."""
    return _image_bytes(resolve(gtype, {}, True), m, k)


def _image_bytes(d: DecoderSpec, m: int, k: int) -> int:
    if m <= 0 or k <= 0 or k % d.stage_values:
        raise FormatError(f"a fused {d.name} image needs k a positive multiple of "
                          f"{d.stage_values} (the values of one stage); got m={m}, k={k}")
    n = m * d.row_bytes(k)
    if n % 16:
        raise FormatError(f"a fused {d.name} image of {m} x {k} takes {n} bytes, not a "
                          "multiple of 16: the kernel reads whole 16-byte chunks, which would "
                          "leave the image")
    if n >= MAX_IMAGE_BYTES:
        raise FormatError(f"a fused {d.name} image of {m} x {k} takes {n} bytes; the kernel "
                          "addresses images of less than 4 GiB")
    return n


class GgmlFused(DecoderModule):
    """Prepared launches of the fused GEMMs. Default: the built-in types of fused.cu, each
    type's module compiled and loaded when first used. With `source` (a plugin's .cu) and
    `decoders` (the specs of the STRATA_GGML_KERNELS lines in it): that module's kernels."""

    def __init__(self, runtime: Runtime, *, source: str | Path | None = None,
                 decoders: Iterable[DecoderSpec] = ()):
        super().__init__(runtime, "GgmlFused", FUSED_SOURCE, source=source, decoders=decoders,
                         per_type=True)
        self._kernels: dict[tuple[str, str, str], Any] = {}

    def kernel(self, d: DecoderSpec, tile: FusedTile, entry: str = "grouped") -> Any:
        """The prepared kernel of one entry (ENTRIES) of a tile for decoder d."""
        key = (d.name, tile.name, entry)
        if key not in self._kernels:
            self._kernels[key] = self.module_of(d.name).kernel(
                kernel_name(d, tile, entry), ENTRY_ARG_TYPES[entry])
        return self._kernels[key]

    def native_image_bytes(self, gtype: GgmlKey, m: int, k: int) -> int:
        return _image_bytes(self.decoder(gtype), m, k)

    def gemm(self, stream: Any, gtype: GgmlKey, weights: int, expert_ids: tuple[int, ...],
             acts: int, bounds: int, out: int, m: int, k: int, rows_hint: int, *,
             tile: str | None = None) -> None:
        """out[r, :] = W_p @ acts[r, :] for every row r of every expert of the group (the
        FormatKernels.mmq contract with native images of native_image_bytes(gtype, m, k) at
        weights + p * that, and fp16 activations [rows, k]). `tile` names one of TILES
        (m16, m32, m64) instead of the one pick_tile chooses (same bytes, other speed)."""
        d = self.decoder(gtype)
        chosen = pick_tile(rows_hint, tile)
        _image_bytes(d, m, k)
        launch_mmq(self.kernel(d, chosen), chosen.shape(d).launch, f"{d.name} fused", stream,
                   weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def gemm_at(self, stream: Any, gtype: GgmlKey, sources: Sequence[int],
                expert_ids: tuple[int, ...], acts: int, bounds: int, out: int, m: int, k: int,
                rows_hint: int, *, tile: str | None = None) -> None:
        """gemm with position p's native image read at sources[p] (e.g. the expert's resident
        slot plus the part's offset in its blob), so no gather precedes it: the same tile,
        block order and arithmetic, hence the same bytes. Each image must start on 16 bytes
        (and spans native_image_bytes(gtype, m, k), a multiple of 16)."""
        d = self.decoder(gtype)
        chosen = pick_tile(rows_hint, tile)
        if len(sources) != len(expert_ids):
            raise FormatError(f"{len(sources)} image addresses for {len(expert_ids)} experts")
        _image_bytes(d, m, k)
        launch_mmq(self.kernel(d, chosen, "at"), chosen.shape(d).launch,
                   f"{d.name} fused in-place", stream, 0, expert_ids, acts, bounds, out, m, k,
                   rows_hint, images=[int(s) for s in sources])

    def gemm_table(self, stream: Any, gtype: GgmlKey, table: int, offset: int, acts: int,
                   bounds: int, out: int, m: int, k: int, rows_hint: int, n_experts: int, *,
                   tile: str | None = None) -> None:
        """gemm_at over every expert of a layer in one launch (FormatKernels.mmq_table):
        expert e's native image at table[e] + offset, where `table` is a device uint64
        [n_experts] (8-byte aligned; an entry of 0 skips the expert, whose output rows stay
        untouched) and offset a multiple of 16; bounds holds n_experts + 1 entries. The tile
        gemm_at would take, and for each expert its bytes."""
        d = self.decoder(gtype)
        chosen = pick_tile(rows_hint, tile)
        _image_bytes(d, m, k)
        launch_mmq_table(self.kernel(d, chosen, "tab"), chosen.shape(d).launch,
                         f"{d.name} fused", stream, table, offset, acts, bounds, out, m, k,
                         rows_hint, n_experts)


__all__ = ["AT_ARG_TYPES", "ENTRIES", "ENTRY_ARG_TYPES", "FUSED_SOURCE", "ONLY_DEFINE", "TILES",
           "TILE_RULE", "DecoderSpec", "GgmlFused", "kernel_name", "native_image_bytes",
           "pick_tile"]
