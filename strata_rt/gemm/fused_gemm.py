"""Launchers of the IQ3_XXS GEMM that dequantizes in its main loop (kernels/iq3_xxs/fused.cu),
the matmul of STRATA_MMQ_KERNEL=f16_fused.

Why: f16_gemm's dequantizing gather writes every expert of a group as fp16 images (1.2 GB per
layer on the Qwen3-30B shape, ~0.49 ms) whatever the prompt length, which is most of a short
prompt's layer. Here the group buffers hold the native blocks (a byte copy, 98 bytes per 256
weights) and each block tile decodes its weights in shared memory and registers right before
the tensor-core multiply, so a layer reads 0.23 GB of weights and writes none. Row tiles of
16, 32 and 64 rows match short prompts (rows per expert ~16-64 at 254-2,048 tokens); the
weights are read once per row tile, so fewer row tiles are the point. Each tile has three
entries: a group buffer (gemm), images where they lie (gemm_at: up to 16 addresses) and a
layer's every expert in one launch through a device table of blob addresses (gemm_table).

Numerics: the same bytes as the f16_gemm kernel on the same blocks and activations (each weight
decoded as the dequantizing gather decodes it; one fp32 accumulator per output from zero, one
mma per 16 values of K in ascending order), so an engine may switch between the two per chunk
without changing a byte. The numpy twin is f16_gemm's (GGMLFormat.mmq_reference of f16_fused:
gemm_reference on the decoded blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FormatError
from ..formats.contract import MMQ_GROUP
from ..formats.launchers import (
    MMQ_ARG_TYPES,
    MMQ_TABLE_ARG_TYPES,
    MmqTile,
    launch_mmq,
    launch_mmq_table,
    pick_by_rows,
)
from ..resources import KERNELS_ROOT, kernel_lines
from .ggml_decoders import FusedTile as GgmlFusedTile

if TYPE_CHECKING:
    from ..runtime import Runtime

FUSED_SOURCE = KERNELS_ROOT / "iq3_xxs" / "fused.cu"
#: values of K per IQ3_XXS block and per pipeline stage; k must be a multiple
K_MULTIPLE = 256
IQ3_BLOCK_BYTES = 98
#: shared bytes of one weight row (seven 16-byte chunks cover a 98-byte block at an even
#: address) and of one activation row (256 fp16 values) per stage; mirrors fused.cu
W_ROW_BYTES = 112
A_ROW_BYTES = 512


@dataclass(frozen=True)
class FusedTile(GgmlFusedTile):
    """One compiled kernel of fused.cu (a FUSED_KERNEL line): the GGML fused GEMM's tile
    fields, K stepped one IQ3_XXS block per stage, with this kernel's shared memory."""

    @property
    def smem(self) -> int:
        """Dynamic shared memory of one block (the kernel traps when given less)."""
        return self.stages * (self.bm * A_ROW_BYTES + self.bn * W_ROW_BYTES)

    @property
    def launch(self) -> MmqTile:
        """The geometry the common MMQ launch takes."""
        return MmqTile(m=self.bn, rows=self.bm, threads=self.threads, k_multiple=K_MULTIPLE,
                       shared=self.smem)


#: every kernel of fused.cu, read from its FUSED_KERNEL lines (the one copy of the table)
TILES = tuple(FusedTile(name, *(int(v) for v in args))
              for name, *args in kernel_lines(FUSED_SOURCE, "FUSED_KERNEL"))
TILES_BY_NAME = {t.name: t for t in TILES}
#: the in-place twin of each tile (FUSED_AT_KERNEL in fused.cu): the same kernel body, with
#: position p's image at its own address (a Ptrs16 of 16 pointers before the expert ids)
AT_PREFIX = "iq3_fused_at_"
AT_ARG_TYPES = "P" * MMQ_GROUP + MMQ_ARG_TYPES.replace("P", "", 1)


#: the table twin of each tile (FUSED_TABLE_KERNEL): the same kernel body over every expert of
#: a layer in one launch, expert e's image at table[e] + offset (MMQ_TABLE_ARG_TYPES)
TAB_PREFIX = "iq3_fused_tab_"


def at_name(tile: FusedTile) -> str:
    """The in-place kernel of a tile: iq3_fused_m32 -> iq3_fused_at_m32."""
    return AT_PREFIX + tile.name.rsplit("_", 1)[1]


def tab_name(tile: FusedTile) -> str:
    """The table kernel of a tile: iq3_fused_m32 -> iq3_fused_tab_m32."""
    return TAB_PREFIX + tile.name.rsplit("_", 1)[1]


#: (largest rows_hint, tile) in order; beyond the last bound the last tile. First guesses, to
#: be set from a bench sweep: the smallest tile holding an expert's rows reads its weights
#: once and wastes the fewest zero rows.
TILE_RULE = ((16, "iq3_fused_m16"), (32, "iq3_fused_m32"), (None, "iq3_fused_m64"))


def pick_tile(rows_hint: int) -> FusedTile:
    """The tile `FusedGemm.gemm` uses for a launch sized for rows_hint rows per expert."""
    return pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint)


def native_image_bytes(m: int, k: int) -> int:
    """Bytes of one native IQ3_XXS image of m rows of k values (the group-buffer stride)."""
    if m <= 0 or k <= 0 or k % K_MULTIPLE:
        raise FormatError(f"an IQ3_XXS image needs k a positive multiple of {K_MULTIPLE}; "
                          f"got m={m}, k={k}")
    return m * (k // K_MULTIPLE) * IQ3_BLOCK_BYTES


class FusedGemm:
    """Prepared launches of every kernel of fused.cu on one runtime."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        mod = runtime.module(FUSED_SOURCE)
        self._kernels = {t.name: mod.kernel(t.name, MMQ_ARG_TYPES) for t in TILES}
        self._at = {t.name: mod.kernel(at_name(t), AT_ARG_TYPES) for t in TILES}
        self._tab = {t.name: mod.kernel(tab_name(t), MMQ_TABLE_ARG_TYPES) for t in TILES}

    def gemm(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
             out: int, m: int, k: int, rows_hint: int, *, tile: str | None = None) -> None:
        """out[r, :] = W_p @ acts[r, :] for every row r of every expert of the group (the
        FormatKernels.mmq contract with native IQ3_XXS images of native_image_bytes(m, k) at
        weights + p * that, and fp16 activations [rows, k]). `tile` names a kernel of TILES
        instead of the one pick_tile chooses (same bytes, other speed)."""
        chosen = pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint, tile, "fused IQ3_XXS")
        launch_mmq(self._kernels[chosen.name], chosen.launch, "IQ3_XXS f16_fused", stream,
                   weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def gemm_at(self, stream, sources: list[int], expert_ids: tuple[int, ...], acts: int,
                bounds: int, out: int, m: int, k: int, rows_hint: int, *,
                tile: str | None = None) -> None:
        """gemm with position p's native image read at sources[p] (e.g. the expert's resident
        slot plus the part's offset in the blob), so no gather precedes it. The same tile,
        block order and arithmetic as gemm, hence the same bytes. Each image must start on 16
        bytes and span native_image_bytes(m, k), a multiple of 16 (the kernel reads whole
        16-byte chunks around each block)."""
        chosen = pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint, tile, "fused IQ3_XXS")
        if len(sources) != len(expert_ids):
            raise FormatError(f"{len(sources)} image addresses for {len(expert_ids)} experts")
        _check_in_place(m, k)
        launch_mmq(self._at[chosen.name], chosen.launch, "IQ3_XXS in-place", stream, 0,
                   expert_ids, acts, bounds, out, m, k, rows_hint, images=sources)

    def gemm_table(self, stream, table: int, offset: int, acts: int, bounds: int, out: int,
                   m: int, k: int, rows_hint: int, n_experts: int, *,
                   tile: str | None = None) -> None:
        """gemm_at over every expert of a layer in one launch (FormatKernels.mmq_table):
        expert e's native image at table[e] + offset, where `table` is a device uint64
        [n_experts] (8-byte aligned; an entry of 0 skips the expert, whose output rows stay
        untouched) and offset a multiple of 16; bounds holds n_experts + 1 entries. The tile
        gemm_at would take, and for each expert its bytes."""
        chosen = pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint, tile, "fused IQ3_XXS")
        _check_in_place(m, k)
        launch_mmq_table(self._tab[chosen.name], chosen.launch, "IQ3_XXS", stream, table,
                         offset, acts, bounds, out, m, k, rows_hint, n_experts)


def _check_in_place(m: int, k: int) -> None:
    """An image read where it lies must span a multiple of 16 bytes (the kernel reads whole
    16-byte chunks around each block, which must not leave it)."""
    if native_image_bytes(m, k) % 16:
        raise FormatError(f"an IQ3_XXS image of {m} x {k} takes {native_image_bytes(m, k)} "
                          "bytes, not a multiple of 16: it cannot be read in place")
