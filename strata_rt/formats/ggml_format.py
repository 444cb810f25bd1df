"""GGMLFormat: a format whose experts are the blocks of one GGML tensor type, as GGUF files hold
them. A subclass names the type (`ggml = "Q4_K"`) and gets the rest from the type table
(strata_rt.formats.ggml_types: id and block geometry from the `gguf` package, dequantize by
`gguf.quants`): sizes, GGUF loading by byte copy, random valid blocks, and two products on fp16
activations (STRATA_MMQ_KERNEL):

- f16_gemm (the default): the gathers dequantize each expert into fp16 images (one launch for
  the 2*ffn gate/up rows, one for the down rows) and a grouped fp16 GEMM multiplies them; on
  short chunks resident experts are read in place by the GEMM that decodes blocks in its main
  loop (the same bytes), up to `f16_gemm_in_place_rows` rows per expert;
- f16_fused: the gathers copy the blocks and that decoding GEMM runs every product, in place
  whenever the expert is resident.

A variant is the same class with another `variant` (for_variant returns a copy): everything the
variant changes (activation, exactness, image sizes and bytes, the numpy reference, the
launchers) is a property or method reading `self.variant`. A subclass may add exact q8_1 MMQ
variants on the native blocks (`exact_variants`, `exact_mmq_reference`, and the launchers
through `kernels_class`), as IQ3_XXS does.

Numerics of both fp16 variants (not `exact`): every weight multiplied is fp16 (round to nearest
even) of the float32 value `dequantize` gives, and the products are float64 products of those
fp16 weights and the fp16 activations rounded to float32 (grouped_gemm.gemm_reference), which
the GEMMs meet within the conformance suite's KERNEL_NMSE. Against a float64 product of the
exact weights and the float32 activations they stay within FLOAT64_NMSE_BOUND: what remains is
fp16 rounding of weights and activations (relative 2^-11 each), NMSE about 1e-7.
"""

from __future__ import annotations

import copy
import math
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gguf
import numpy as np

from ..errors import FormatError, GGUFError
from ..gemm.ggml_decoders import DecoderSpec
from ..gemm.ggml_fused import FUSED_SOURCE
from ..gemm.ggml_gather import GATHER_SOURCE as DEQUANT_GATHER_SOURCE
from ..gemm.ggml_gather import images_reference
from ..gemm.ggml_gemv import GEMV_SOURCE
from ..gemm.grouped_gemm import GEMM_SOURCE, fp16_image_layout, fp16_image_values, gemm_reference
from .activations import F16, Q8_1, Activation
from .contract import ExpertLayout, QuantFormat, expert_rows
from .ggml_blocks import random_matrix
from .ggml_types import BY_NAME, GgmlType, ggml_type
from .ggml_variants import F16_FUSED, F16_GEMM, F16_VARIANTS
from .launchers import GATHER_SOURCE as COPY_GATHER_SOURCE

if TYPE_CHECKING:
    from .contract import FormatKernels

#: NMSE of an fp16 product against float64 on the exact weights and float32 activations
FLOAT64_NMSE_BOUND = 1e-5
#: in_place_max_rows of f16_fused: the decoding GEMM runs whether the blocks were copied or
#: not, so resident experts are always read in place
ALWAYS_IN_PLACE = 1 << 30
#: the in-place kernel reads whole 16-byte words of each image
IN_PLACE_ALIGN = 16


def gguf_type(name: str) -> GgmlType:
    """A GGML type the gguf package knows but the built-in table does not list (a plugin's,
    decoded by its own decoder_source)."""
    try:
        return GgmlType.from_gguf(name)
    except KeyError:
        raise FormatError(f"GGML type {name!r} is unknown to the gguf package") from None


@cache
def gguf_quantizes(t: GgmlType) -> bool:
    """Whether gguf.quants.quantize encodes type t (it dequantizes every type but quantizes
    only some)."""
    try:
        gguf.quants.quantize(np.zeros((1, t.block_values), np.float32), t.qtype)
    except NotImplementedError:
        return False
    return True


class GGMLFormat(QuantFormat):
    """A format that is one GGML type (see the module doc). A subclass sets `ggml`; it may set
    `name` (default: the type's name in lower case), `dim_multiple` (default: lcm(block
    values, 128)), `roundtrip_nmse`, `description` and `f16_gemm_in_place_rows`."""

    #: the GGML type's name, one of strata_rt.formats.ggml_types.NAMES
    ggml: ClassVar[str]
    #: the type's table entry (set from `ggml`)
    gtype: ClassVar[GgmlType]
    #: the MMQ variant this object runs (one of mmq_variants())
    variant: str
    #: the .cu file that instantiates the shared GGML kernels for a type outside the built-in
    #: table (its decoder, then one STRATA_GGML_KERNELS line); None: kernels/ggml/gather.cu
    decoder_source: ClassVar[Path | None] = None
    native = True
    kernel_dir = "ggml"
    #: rows hint up to which f16_gemm reads resident experts in place (the decoding GEMM skips
    #: writing and reading the fp16 images; beyond it the fp16 GEMM's speed pays for them).
    #: Measured on IQ3_XXS at the Qwen3 shapes: ahead at 1,024 tokens, behind at 2,048
    f16_gemm_in_place_rows: ClassVar[int] = 136
    #: the down projections' type where a file stores them in another type than gate and up
    #: (a layer of llama.cpp's Q4_K_M keeps them in Q6_K): a class of down_typed(); None: `ggml`
    down: ClassVar[str | None] = None
    #: the table entry of the down type (set from `down`, else `gtype`)
    down_gtype: ClassVar[GgmlType]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "ggml" not in cls.__dict__:
            return
        t = BY_NAME.get(cls.ggml) or gguf_type(cls.ggml)
        cls.gtype = t
        cls.down_gtype = ggml_type(cls.down) if cls.down is not None else t
        cls.ggml_type = t.type_id
        cls.block_values, cls.block_bytes = t.block_values, t.block_bytes
        if "name" not in cls.__dict__:
            cls.name = t.name.lower()
        if "dim_multiple" not in cls.__dict__:  # q8_1's 128 and the fused GEMM's K stage
            cls.dim_multiple = math.lcm(*(
                math.lcm(u.block_values, 128, DecoderSpec(u.name, u.block_values,
                                                          u.block_bytes).stage_values)
                for u in {t, cls.down_gtype}))
        if "description" not in cls.__dict__:
            bits = 8 * t.block_bytes / t.block_values
            cls.description = (
                f"GGUF {t.name}, {bits:.4g} bits/weight: experts keep the file's bytes; "
                "f16_gemm (default): dequantizing gather to fp16 images, grouped fp16 GEMM "
                "(short chunks read resident experts in place); f16_fused: blocks decoded "
                "inside the GEMM; batched gathers")

    def __init__(self, variant: str | None = None):
        """`variant`: the MMQ variant this object runs (None: the default, f16_gemm)."""
        self.variant = self._checked_variant(variant)

    # ------------------------------------------------------------------ variants
    def exact_variants(self) -> tuple[str, ...]:
        """Hook: names of extra MMQ variants that multiply the native blocks (byte-copy
        gathers) on q8_1 activations, bit-identical to exact_mmq_reference. Default: none."""
        return ()

    def exact_mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                            bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """Hook: the numpy mirror of the exact variants' arithmetic (see mmq_reference)."""
        raise NotImplementedError(f"{self.name} declares no exact variants")

    def mmq_variants(self) -> tuple[str, ...]:
        return (*F16_VARIANTS, *self.exact_variants())

    def _checked_variant(self, name: str | None) -> str:
        super().for_variant(name)  # refuses an unknown name, listing the valid ones
        if self.down_gtype is not self.gtype and name not in (None, F16_GEMM):
            raise FormatError(f"{self.name}: a layer whose down projections are of another "
                              f"type runs {F16_GEMM} only (asked: {name})")
        return name or F16_GEMM

    def for_variant(self, name: str | None) -> GGMLFormat:
        """This object when it runs variant `name` already, else a copy running it."""
        chosen = self._checked_variant(name)
        if chosen == self.variant:
            return self
        other = copy.copy(self)
        other.variant = chosen
        return other

    @property
    def runs_f16(self) -> bool:
        """Whether this variant is one of the fp16 products (not an exact one)."""
        return self.variant in F16_VARIANTS

    @property
    def images_are_blocks(self) -> bool:
        """Whether the group buffers hold the native blocks (gathers copy bytes): every variant
        but f16_gemm, and f16_gemm of F16, whose blocks are fp16 images already."""
        return self.variant != F16_GEMM or self.gtype.name == "F16"

    @property
    def activation(self) -> Activation:
        return F16 if self.runs_f16 else Q8_1

    @property
    def exact(self) -> bool:
        return not self.runs_f16

    @property
    def image_dtype(self) -> type[np.floating] | None:
        return np.float16 if self.runs_f16 else None

    def in_place_geometry(self) -> str | None:
        """Why the decoding GEMM cannot read this format's images where they lie (None: it
        can). An image is rows x row bytes with rows a multiple of dim_multiple, starting at a
        slot (256-byte aligned) plus the gate/up image's bytes for the down image; so
        dim_multiple * block_bytes a multiple of 16 keeps every start and size on 16 bytes."""
        for t in {self.gtype, self.down_gtype}:
            if (self.dim_multiple * t.block_bytes) % IN_PLACE_ALIGN:
                return (f"dim_multiple {self.dim_multiple} x {t.name}'s block bytes "
                        f"{t.block_bytes} is not a multiple of {IN_PLACE_ALIGN}: images may "
                        "start off 16 bytes")
        return None

    @property
    def in_place_max_rows(self) -> int:
        """f16_gemm: f16_gemm_in_place_rows; f16_fused: always; exact variants: never; and
        never where in_place_geometry refuses the format."""
        if not self.runs_f16 or self.in_place_geometry() is not None:
            return 0
        return self.f16_gemm_in_place_rows if self.variant == F16_GEMM else ALWAYS_IN_PLACE

    # ------------------------------------------------------------------ bytes <-> values
    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        want = self.matrix_bytes(rows, cols)
        if b.size != want:
            raise FormatError(f"{self.name}: {b.size} bytes given for a {rows} x {cols} matrix, "
                              f"which takes {want}")
        return self.gtype.dequantize(b, cols)

    @property
    def quantizes(self) -> bool:
        return gguf_quantizes(self.gtype)

    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """gguf.quants.quantize where the gguf package implements the type; values that come
        back NaN/Inf (a weight or a block scale beyond fp16's range) are refused."""
        t = self.gtype
        if not self.quantizes:
            raise FormatError(
                f"{self.name}: {t.name} tensors are read from GGUF files as llama-quantize "
                f"writes them; they cannot be produced here (the gguf package has no {t.name} "
                "quantizer)")
        if imatrix is not None:
            raise FormatError(f"{self.name}: the gguf package's {t.name} quantizer takes no "
                              "importance vector")
        w = self.check_weights(weights)
        with np.errstate(over="ignore"):  # refused below, naming the first such weight
            out = np.asarray(gguf.quants.quantize(w, t.qtype))
        raw = np.ascontiguousarray(out).view(np.uint8).reshape(w.shape[0], -1)
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~np.isfinite(self.dequantize(raw, w.shape))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise FormatError(
                f"{self.name}: the weights do not fit {t.name}: {int(bad.sum())} value(s) come "
                f"back NaN/Inf, first at row {r}, column {c} (weight {float(w[r, c]):.4g}; "
                "fp16 values and scales end at 65504)")
        return raw

    def random_expert(self, rng: np.random.Generator, hidden: int, ffn: int) -> np.ndarray:
        """Random valid blocks (finite scales) whose values have standard deviation about
        1/sqrt(row length): fast, and whatever the gguf package can quantize."""
        self.check_dims(hidden, ffn)
        t, d = self.gtype, self.down_gtype
        return np.concatenate([random_matrix(rng, t, ffn, hidden, hidden ** -0.5).reshape(-1),
                               random_matrix(rng, t, ffn, hidden, hidden ** -0.5).reshape(-1),
                               random_matrix(rng, d, hidden, ffn, ffn ** -0.5).reshape(-1)])

    def gguf_part_types(self) -> tuple[int | None, int | None, int | None]:
        return (self.ggml_type, self.ggml_type, self.down_gtype.type_id)

    def unpack_expert(self, blob: np.ndarray, hidden: int, ffn: int):
        """Blob -> (gate, up, down) float32, the down rows in their own type."""
        if self.down_gtype is self.gtype:
            return super().unpack_expert(blob, hidden, ffn)
        lay = self.layout(hidden, ffn)
        b = np.asarray(blob, dtype=np.uint8).reshape(-1)
        half = lay.gate_up_bytes // 2
        return (self.dequantize(b[:half], (ffn, hidden)),
                self.dequantize(b[half: lay.gate_up_bytes], (ffn, hidden)),
                self.down_gtype.dequantize(b[lay.down_offset: lay.down_offset + lay.down_bytes],
                                           ffn).reshape(hidden, ffn))

    def pack_gguf_experts(self, gate: Any, up: Any, down: Any) -> np.ndarray:
        """Tensors of this format's type are copied byte for byte; a tensor of another type is
        dequantized by the gguf package and quantized here, expert by expert."""
        from gguf.quants import dequantize as gguf_dequantize

        tensors = (gate, up, down)
        dims = [tuple(int(v) for v in reversed(t.shape)) for t in tensors]
        if any(len(dm) != 3 for dm in dims):
            raise GGUFError(f"{self.name}: expert tensors must be 3-D [n_experts, rows, cols]; "
                            + ", ".join(f"{t.name} is {list(dm)}"
                                        for t, dm in zip(tensors, dims)))
        n, ffn, hidden = dims[0]
        want = [(n, ffn, hidden), (n, ffn, hidden), (n, hidden, ffn)]
        for t, dm, w in zip(tensors, dims, want):
            if dm != w:
                raise GGUFError(
                    f"{self.name}: tensor {t.name} has shape {list(dm)} [n_experts, rows, cols]; "
                    f"with {gate.name} {list(dims[0])} it must be {list(w)}")
        self.check_dims(hidden, ffn)
        parts = []
        own = (self.ggml_type, self.ggml_type, self.down_gtype.type_id)
        for t, (_, rows, cols), type_id in zip(tensors, want, own):
            if int(t.tensor_type) == type_id:
                parts.append(np.ascontiguousarray(t.data).view(np.uint8).reshape(n, -1))
                continue
            type_name = gguf.GGMLQuantizationType(int(t.tensor_type)).name
            if self.down_gtype is not self.gtype:
                raise FormatError(f"{self.name}: tensor {t.name} has type {type_name}; this "
                                  "layer format copies its tensors as they are")
            per_expert = []
            for e in range(n):
                try:
                    m = np.asarray(gguf_dequantize(t.data[e], t.tensor_type), dtype=np.float32)
                except (NotImplementedError, ValueError, KeyError) as err:
                    raise FormatError(
                        f"{self.name}: tensor {t.name} has type {type_name}, which is not "
                        f"{self.gtype.name} and which the gguf package cannot dequantize "
                        f"({err})") from None
                per_expert.append(self.quantize(m.reshape(rows, cols)).reshape(-1))
            parts.append(np.stack(per_expert))
        return np.concatenate(parts, axis=1)

    # ------------------------------------------------------------------ images
    def layout(self, hidden: int, ffn: int) -> ExpertLayout:
        """The blob is gate rows, up rows, down rows of blocks; f16_gemm's images are fp16
        (2 bytes a value), the other variants' the blob's ranges."""
        blocks = super().layout(hidden, ffn)
        if self.down_gtype is not self.gtype:
            gu, dn = blocks.gate_up_bytes, hidden * self.down_gtype.row_bytes(ffn)
            blocks = ExpertLayout(hidden, ffn, 0, gu, gu, dn, gu + dn, gu, dn)
        return blocks if self.images_are_blocks else fp16_image_layout(blocks)

    def images(self, blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
        """What the gathers write (their numpy twin): the blob's ranges, or for f16_gemm the
        fp16 images [2*ffn, hidden] and [hidden, ffn] of the dequantized values, as uint8."""
        if self.images_are_blocks:
            return super().images(blob, hidden, ffn)
        lay = self.layout(hidden, ffn)
        b = np.asarray(blob, dtype=np.uint8).reshape(-1)
        gu = images_reference(self.gtype, b[lay.gate_up_offset: lay.gate_up_offset
                                            + lay.gate_up_bytes], 2 * ffn, hidden)
        dn = images_reference(self.down_gtype, b[lay.down_offset: lay.down_offset
                                                 + lay.down_bytes], hidden, ffn)
        return gu.reshape(-1).view(np.uint8), dn.reshape(-1).view(np.uint8)

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """The weights the products multiply for one image: fp16 values (f16_gemm), the blocks'
        values rounded to fp16 (f16_fused), the exact values (exact variants); as float32."""
        if not self.runs_f16:
            return self.dequantize(image, (rows, cols))
        if self.variant == F16_FUSED:
            return self.native_f16(image, rows, cols).astype(np.float32)
        return fp16_image_values(image, rows, cols, f"{self.name} ({self.variant})")

    def native_f16(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """One native image's values as the decoding kernels see them: float16 [rows, cols]."""
        raw = np.ascontiguousarray(image, dtype=np.uint8).reshape(-1)
        nbytes = self.matrix_bytes(rows, cols)
        if raw.size < nbytes:
            raise FormatError(f"{self.name}: a native image of {rows} x {cols} takes {nbytes} "
                              f"bytes, got {raw.size}")
        return images_reference(self.gtype, raw[:nbytes], rows, cols)

    # ------------------------------------------------------------------ products
    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """f16_gemm: float64 products of the fp16 images and fp16 activations, rounded to
        float32; f16_fused: the same on the decoded native images (positions without rows are
        not decoded); exact variants: exact_mmq_reference."""
        if not self.runs_f16:
            return self.exact_mmq_reference(image, expert_ids, acts, bounds, m, k)
        if self.variant == F16_GEMM:
            return gemm_reference(image, expert_ids, acts, bounds, m, k)
        n = len(expert_ids)
        img = np.ascontiguousarray(image, dtype=np.uint8).reshape(n, -1)
        decoded = np.zeros((n, m, k), dtype=np.float16)
        for p, r0, r1 in expert_rows(expert_ids, bounds):
            if r1 > r0:
                decoded[p] = self.native_f16(img[p], m, k)
        return gemm_reference(decoded, expert_ids, acts, bounds, m, k)

    # ------------------------------------------------------------------ device side
    def kernel_sources(self) -> list[Path]:
        """What the launchers load: the gathers (the byte copy, or the dequantizing gather),
        the fp16 GEMM for f16_gemm, and the decoding GEMM where a variant reads blocks (f16_fused,
        f16_gemm in place) and the decode step's matrix-vector kernels; a plugin type's
        decoder_source stands for the GGML kernels."""
        uses_fused = self.variant == F16_FUSED or self.in_place_max_rows > 0
        ggml = [] if self.images_are_blocks and not uses_fused else (
            [self.decoder_source] if self.decoder_source is not None else
            [*([] if self.images_are_blocks else [DEQUANT_GATHER_SOURCE]),
             *([FUSED_SOURCE] if uses_fused else [])])
        copy = [COPY_GATHER_SOURCE] if self.images_are_blocks else []
        gemm = [GEMM_SOURCE] if self.variant == F16_GEMM else []
        own = self.decoder_source
        gemv = [GEMV_SOURCE] if own is None else [] if own in ggml else [own]
        return [*copy, *ggml, *gemv, *gemm]

    def kernels_class(self) -> type[FormatKernels] | None:
        """GGMLKernels for the fp16 variants; a subclass with exact variants overrides this
        for them."""
        if not self.runs_f16:
            return None
        from ..gemm.ggml_kernels import GGMLKernels

        return GGMLKernels

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.variant})>"


@cache
def down_typed(gate_up: str, down: str) -> type[GGMLFormat]:
    """The format class of a layer whose gate and up tensors are of type `gate_up` and whose
    down tensors are of type `down` (built-in types; one class per pair). Such a layer runs
    f16_gemm: its gathers dequantize each part with the part's own decoder, and its group
    buffers hold fp16 images like every other layer's, so it runs beside them."""
    a, d = ggml_type(gate_up), ggml_type(down)
    if a is d:
        raise FormatError(f"down_typed({a.name}, {d.name}): the parts share one type; use the "
                          "type's own format")
    body = {"ggml": a.name, "down": d.name, "name": f"{a.name.lower()}+{d.name.lower()}",
            "description": f"GGUF {a.name} gate and up, {d.name} down: the file's bytes"}
    return type(f"{a.name}_{d.name}_down", (GGMLFormat,), body)

