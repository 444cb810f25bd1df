"""What the GGML launchers (ggml_gather.py, ggml_fused.py) know of a decoder and of the fused
GEMM's tiles: a small spec per decoder, and the tile list read from the one source that defines
it, kernels/ggml/templates.cuh.

Why a spec and not the GgmlType table: a plugin brings its own type as a decoder struct in its
own .cu (one STRATA_GGML_KERNELS(SUFFIX, Decoder) line after including the templates); its
launchers need only the suffix the kernels are named by and the block geometry, which a
`DecoderSpec` states. Every built-in type has one (`DecoderSpec.of`).

The fused kernels' shared memory per type and tile follows from the geometry by the formula of
templates.cuh's FusedStage / FusedCfg, mirrored here (`FusedShape`); tests/test_ggml_fused_cpu.py
compares the two for every built-in type and the example plugin's, through the host build.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from ..errors import FormatError
from ..formats.ggml_types import GgmlType, ggml_type
from ..formats.launchers import MmqTile
from ..resources import KERNELS_ROOT

TEMPLATES_HEADER = KERNELS_ROOT / "ggml" / "templates.cuh"
#: the define that makes a built-in source (fused.cu, gemv.cu) build one type's kernels
ONLY_DEFINE = "STRATA_GGML_ONLY"
#: values of K one stage takes (1-value types: 256 bytes of a row), as FusedStage
STAGE_VALUES = 256
STAGE_ROW_BYTES_1 = 256
#: shared memory one block may take (sm_80's limit), one SM has (sm_90), and the driver's
#: reserve per resident block: the budget FusedCfg sizes its pipeline by
BLOCK_SMEM_MAX = 163 * 1024
SM_SMEM = 228 * 1024
BLOCK_RESERVE = 2048


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder the templates were instantiated for: `name` is the SUFFIX of its kernels
    (ggml_gather_SUFFIX, ggml_fused_SUFFIX_<tile>), with a block's values and bytes."""

    name: str
    block_values: int
    block_bytes: int

    def __post_init__(self) -> None:
        v, b = self.block_values, self.block_bytes
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise FormatError(f"decoder name {self.name!r} is not a C identifier")
        ok = b > 0 and ((v == 1 and STAGE_ROW_BYTES_1 % b == 0 and (STAGE_ROW_BYTES_1 // b) % 64
                         == 0) or (v > 1 and v % 8 == 0 and STAGE_VALUES % v == 0))
        if not ok:
            raise FormatError(
                f"decoder {self.name}: blocks of {v} values and {b} bytes do not fit the shared "
                "templates (1-value blocks of 1, 2 or 4 bytes, or blocks of a multiple of 8 "
                f"values dividing {STAGE_VALUES})")

    @classmethod
    def of(cls, t: GgmlType) -> DecoderSpec:
        return cls(t.name, t.block_values, t.block_bytes)

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` values; FormatError unless whole blocks."""
        if cols <= 0 or cols % self.block_values:
            raise FormatError(f"{self.name}: a row of {cols} values is not a whole number of "
                              f"{self.block_values}-value blocks")
        return cols // self.block_values * self.block_bytes

    @property
    def stage_values(self) -> int:
        """Values of K per pipeline stage of the fused GEMM: k must be a multiple."""
        if self.block_values == 1:
            return STAGE_ROW_BYTES_1 // self.block_bytes
        return STAGE_VALUES

    @property
    def stage_bytes(self) -> int:
        """Bytes of one weight row per stage."""
        return self.stage_values // self.block_values * self.block_bytes

    @property
    def weight_row_bytes(self) -> int:
        """Shared bytes of one weight row per stage: the 16-byte chunks that cover the stage
        bytes wherever they start (offsets are multiples of the bytes' power-of-two part)."""
        sb = self.stage_bytes
        align = 16 if sb % 16 == 0 else sb & -sb
        return 16 * ((sb + 16 - align + 15) // 16)

    def __str__(self) -> str:
        return self.name


#: what a launcher takes for a type: a built-in's name, GGUF id, gguf enum or table entry, or
#: a decoder's spec (or the name of one of the launcher's own decoders)
GgmlKey = str | int | GGMLQuantizationType | GgmlType | DecoderSpec


def resolve(key: GgmlKey, own: Mapping[str, DecoderSpec], builtin: bool) -> DecoderSpec:
    """The spec a launcher serves for `key`: a DecoderSpec, a name among `own` (the decoders
    of a plugin's module), or (when `builtin`) anything ggml_types.ggml_type accepts."""
    if isinstance(key, DecoderSpec):
        if key.name in own and own[key.name] != key:
            raise FormatError(f"decoder {key.name}: {key} differs from this launcher's "
                              f"{own[key.name]}")
        if not builtin and key.name not in own:
            raise FormatError(f"decoder {key.name} is not in this launcher's module (it has: "
                              f"{', '.join(own) or 'none'})")
        return key
    if isinstance(key, str) and key in own:
        return own[key]
    if not builtin:
        raise FormatError(f"decoder {key!r} is not in this launcher's module (it has: "
                          f"{', '.join(own) or 'none'})")
    return DecoderSpec.of(ggml_type(key))


def own_decoders(decoders: Iterable[DecoderSpec]) -> dict[str, DecoderSpec]:
    out: dict[str, DecoderSpec] = {}
    for d in decoders:
        if not isinstance(d, DecoderSpec):
            raise FormatError(f"decoders must be DecoderSpec entries, got {d!r}")
        out[d.name] = d
    return out


class DecoderModule:
    """What the GGML launchers (gather, rows, fused GEMM, matrix-vector) keep of where their
    kernels come from: the built-in types' source, or a plugin's `source` with the `decoders`
    its STRATA_GGML_KERNELS lines instantiate; which spec a launch of a given type runs; and
    the loaded modules. One module holds every type's kernels, loaded at once (a plugin's
    build errors surface when the launcher is made), except for a built-in source with
    `per_type`, built once per type with ONLY_DEFINE=<type> when that type is first asked for
    (the fused and matrix-vector sources, whose full builds take minutes)."""

    def __init__(self, runtime: Any, kind: str, builtin_source: Path, *,
                 source: str | Path | None = None, decoders: Iterable[DecoderSpec] = (),
                 per_type: bool = False):
        self.runtime = runtime
        self._own = own_decoders(decoders)
        self._builtin = source is None
        if not self._builtin and not self._own:
            raise FormatError(f"{kind} over {source}: name its decoders (DecoderSpec)")
        self.source = builtin_source if source is None else Path(source)
        self._per_type = per_type and self._builtin
        self._modules: dict[str, Any] = {}
        if not self._per_type:
            self._modules[""] = runtime.module(self.source)

    def decoder(self, gtype: GgmlKey) -> DecoderSpec:
        """The spec this launcher runs for gtype (FormatError when it has no kernel for it)."""
        return resolve(gtype, self._own, self._builtin)

    def module_of(self, name: str) -> Any:
        """The loaded module holding the kernels of the type called `name` (class doc)."""
        if not self._per_type:
            return self._modules[""]
        if name not in self._modules:
            self._modules[name] = self.runtime.module(self.source, defines={ONLY_DEFINE: name})
        return self._modules[name]


@dataclass(frozen=True)
class FusedTile:
    """One line of STRATA_GGML_FUSED_TILES: bm activation rows x 16 * warps weight rows per
    block, at most `stages` pipeline buffers, min_blocks per SM (the register budget)."""

    name: str
    bm: int
    warps: int
    stages: int
    min_blocks: int

    @property
    def bn(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shape(self, d: DecoderSpec) -> FusedShape:
        return FusedShape(self, d)


@dataclass(frozen=True)
class FusedShape:
    """A tile instantiated for one decoder (FusedCfg): its pipeline depth and shared memory."""

    tile: FusedTile
    decoder: DecoderSpec

    @cached_property
    def stage_smem(self) -> int:
        d = self.decoder
        return self.tile.bm * 2 * d.stage_values + self.tile.bn * d.weight_row_bytes

    @cached_property
    def stages(self) -> int:
        budget = min(BLOCK_SMEM_MAX, SM_SMEM // self.tile.min_blocks - BLOCK_RESERVE)
        return min(self.tile.stages, budget // self.stage_smem)

    @property
    def smem(self) -> int:
        """Dynamic shared memory of one block (the kernel traps when given less)."""
        return self.stages * self.stage_smem

    @property
    def launch(self) -> MmqTile:
        return MmqTile(m=self.tile.bn, rows=self.tile.bm, threads=self.tile.threads,
                       k_multiple=self.decoder.stage_values, shared=self.smem)


def tiles_of_source(text: str) -> tuple[FusedTile, ...]:
    """The tiles of STRATA_GGML_FUSED_TILES in templates.cuh's text (the one list)."""
    block = re.search(r"#define STRATA_GGML_FUSED_TILES\(TILE, SUFFIX, DEC\)(.*?)\n\n", text,
                      re.S)
    if block is None:
        raise FormatError(f"{TEMPLATES_HEADER.name}: no STRATA_GGML_FUSED_TILES list")
    rows = re.findall(r"TILE\(SUFFIX, DEC, (\w+), (\d+), (\d+), (\d+), (\d+)\)", block.group(1))
    return tuple(FusedTile(name, *(int(v) for v in rest)) for name, *rest in rows)


#: the fused GEMM's tiles, as templates.cuh lists them
TILES: tuple[FusedTile, ...] = tiles_of_source(TEMPLATES_HEADER.read_text())
TILES_BY_NAME = {t.name: t for t in TILES}

__all__ = ["BLOCK_RESERVE", "BLOCK_SMEM_MAX", "SM_SMEM", "TEMPLATES_HEADER", "TILES",
           "TILES_BY_NAME", "DecoderSpec", "FusedShape", "FusedTile", "GgmlKey", "own_decoders",
           "resolve", "tiles_of_source"]
