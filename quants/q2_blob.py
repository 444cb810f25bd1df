"""The planar Q2 blob: 2-bit codes with one fp16 scale per 64 weights, weight = (code-1)*scale.

Blob of one expert (hidden h, expert width f), four planes in this order:
  1. gate/up codes, 2f rows x h/4 bytes, interleaved (row 2k = gate row k, row 2k+1 = up row k),
     four codes per byte, low bits first;
  2. down codes, h rows x f/4 bytes;
  3. gate/up scales, 2f rows x h/64 fp16, interleaved like plane 1;
  4. down scales, h rows x f/64 fp16.

The blob is not a set of matrix byte ranges, so the gather rebuilds an MMQ-ready image per
expert (one launch, never batched). Images are de-interleaved and planar:
  gate/up image = codes of gate rows then up rows (2f x h/4) followed by their scales
                  (2f x h/64 fp16);
  down image    = down codes (h x f/4) followed by down scales (h x f/64 fp16).
Both planes of an image are 16-byte aligned when h and f are multiples of 128, which is also
what q8_1 activations need (K a multiple of 128), hence dim_multiple = 128.

`quantize`/`dequantize` work on one matrix in a row-wise *plain* encoding (each row: its codes,
then its fp16 scales), used by the conformance round trip; `pack_expert` builds the planar blob.

Scale rule (quantize): for each group of 64 values x, the levels are {-1, 0, 1, 2} * s. The
scale may be negative, which mirrors the asymmetric levels onto the other side of zero. We try
NCAND positive and NCAND negative candidate scales (fractions FRAC_LO..1 of the smallest scale
that represents the group's extremes without clipping), assign every value to its nearest level
(clip(rint(x/s), -1, 2)) and score the squared error. The NSTART best candidates then get REFINE
rounds of alternating optimisation (least-squares scale sum(x*c)/sum(c*c) for the fixed codes,
then nearest codes for that scale; neither step can raise the error) and the best result wins.
The scale is stored as fp16 and the codes are reassigned to the stored scale, so the blob holds
the best codes for the scale it actually carries. On Gaussian weights the error lands within
0.2% of a dense 4,001-point scale search per group (tested), NMSE about 0.123.

Variants (STRATA_MMQ_KERNEL), one class: an object's `variant` decides what it runs, and
for_variant returns a copy running another. f16_gemm, the default: the same blob, a
per-expert gather (kernels/q2_blob/dequant.cu) that writes fp16 images, each weight
fp16((code-1)*scale), which is exact, and the grouped fp16 GEMM of strata_rt.gemm.grouped_gemm on
fp16 activations. Not exact: it meets the float64 reference of its fp16 inputs within the
conformance tolerance, and a float64 product of the exact weights and unquantized activations
more closely than the int8 path does (its q8_1 activations round more). int8: the exact int8
tensor-core MMQ on q8_1 activations, bit-identical to mmq_reference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16, Q8_1, Activation
from strata_rt.formats.contract import ExpertLayout, FormatKernels, QuantFormat, expert_rows
from strata_rt.formats.hookspecs import hookimpl
from strata_rt.formats.launchers import MmqTile, PerExpertKernels
from strata_rt.gemm.grouped_gemm import (
    GroupedGemm,
    fp16_image_layout,
    fp16_image_values,
    gemm_reference,
)

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

F16_GEMM = "f16_gemm"  # the fp16-image variant, the default
INT8 = "int8"  # the exact int8 MMQ
GROUP = 64           # weights per scale
NCAND = 32           # candidate scales per sign
FRAC_LO = 0.25       # smallest candidate, as a fraction of the covering scale
NSTART = 4           # best candidates refined further
REFINE = 4           # alternating refinement rounds per start
CHUNK = 4096         # groups per vectorized step (bounds the temporary arrays)
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Planes:
    """Byte offsets and sizes of the four planes of one expert's blob."""

    gu_codes: int
    down_codes: int
    gu_scales: int
    down_scales: int
    gu_codes_bytes: int
    down_codes_bytes: int
    gu_scales_bytes: int
    down_scales_bytes: int

    @classmethod
    def of(cls, hidden: int, ffn: int) -> Planes:
        gc, dc = 2 * ffn * hidden // 4, hidden * ffn // 4
        gs, ds = 2 * ffn * (hidden // GROUP) * 2, hidden * (ffn // GROUP) * 2
        return cls(0, gc, gc + dc, gc + dc + gs, gc, dc, gs, ds)

    @property
    def total(self) -> int:
        return self.down_scales + self.down_scales_bytes


def image_bytes(m: int, k: int) -> int:
    """Bytes of an m x k image: codes (m x k/4) then fp16 scales (m x k/64)."""
    return m * k // 4 + m * (k // GROUP) * 2


# -------------------------------------------------------------------- numpy codec
def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (codes uint8 [rows, cols/4], scales float16 [rows, cols/64])."""
    rows, cols = w.shape
    x = w.reshape(-1, GROUP)
    codes = np.empty(x.shape, dtype=np.int8)
    scales = np.empty(x.shape[0], dtype=np.float16)
    for s in range(0, x.shape[0], CHUNK):
        codes[s:s + CHUNK], scales[s:s + CHUNK] = _quantize_groups(x[s:s + CHUNK])
    c = (codes + 1).astype(np.uint8).reshape(rows, cols // 4, 4)
    packed = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)
    return packed, scales.reshape(rows, cols // GROUP)


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(codes uint8 [rows, cols/4], scales float16 [rows, cols/64]) -> float32 [rows, cols].
    Each product (code-1)*scale is exact in float32."""
    rows = codes.shape[0]
    levels = code_levels(codes).astype(np.float32).reshape(rows, -1, GROUP)
    s = np.asarray(scales, dtype=np.float16).astype(np.float32).reshape(rows, -1, 1)
    return (levels * s).reshape(rows, -1)


def code_levels(codes: np.ndarray) -> np.ndarray:
    """Packed codes uint8 [rows, cols/4] -> int8 levels code-1 [rows, cols]."""
    c = np.asarray(codes, dtype=np.uint8)
    unpacked = (c[..., None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3
    return (unpacked.astype(np.int8) - 1).reshape(c.shape[0], -1)


def _nearest(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Nearest level index in {-1, 0, 1, 2} for each value under scale s (s == 0: level 0)."""
    safe = np.where(s == 0, 1.0, s)
    return np.where(s == 0, 0.0, np.clip(np.rint(x / safe), -1, 2))


def _quantize_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [G, 64] -> (levels int8 [G, 64] in -1..2, scales float16 [G]); see the module
    docstring for the rule."""
    x64 = x.astype(np.float64)
    hi, lo = x64.max(1), x64.min(1)
    cover_pos = np.maximum(hi / 2, -lo)       # s > 0 spans [-s, 2s]
    cover_neg = -np.maximum(-lo / 2, hi)      # s < 0 spans [2s, -s]
    frac = np.linspace(FRAC_LO, 1.0, NCAND)
    cand = np.concatenate([cover_pos[:, None] * frac, cover_neg[:, None] * frac], axis=1)
    c = _nearest(x64[:, None, :], cand[:, :, None])
    err = ((x64[:, None, :] - c * cand[:, :, None]) ** 2).sum(2)
    top = np.argsort(err, axis=1)[:, :NSTART]
    s = np.take_along_axis(cand, top, axis=1)                     # [G, NSTART]
    xs = x64[:, None, :]
    c = _nearest(xs, s[:, :, None])
    for _ in range(REFINE):
        cc = (c * c).sum(2)
        s = np.where(cc > 0, (xs * c).sum(2) / np.where(cc > 0, cc, 1.0), s)
        c = _nearest(xs, s[:, :, None])
    err = ((xs - c * s[:, :, None]) ** 2).sum(2)
    s = s[np.arange(len(x64)), err.argmin(1)]
    if np.abs(s).max(initial=0.0) > FP16_MAX:
        raise FormatError(f"q2_blob: a group needs scale {np.abs(s).max():.4g}, beyond fp16's "
                          f"{FP16_MAX}; weights of magnitude above ~1e5 cannot be stored")
    s16 = s.astype(np.float16)
    c = _nearest(x64, s16.astype(np.float64)[:, None])
    return c.astype(np.int8), s16


# -------------------------------------------------------------------- the format
class Q2Blob(QuantFormat):
    name = "q2_blob"
    ggml_type = None
    block_values = GROUP
    block_bytes = GROUP // 4 + 2       # plain row encoding: 16 code bytes + one fp16 scale
    native = False
    kernel_dir = "q2_blob"
    roundtrip_nmse = 0.15
    dim_multiple = 128
    #: the MMQ variant this object runs (one of mmq_variants())
    variant: str
    description = ("planar 2-bit blob (gate/up interleaved, fp16 scale per 64), "
                   "2.25 bits/weight; f16_gemm (default): dequantizing gather to fp16 images, "
                   "grouped fp16 GEMM; int8: exact int8 tensor-core MMQ on q8_1 activations")

    def __init__(self, variant: str | None = None):
        """`variant`: the MMQ variant this object runs (None: f16_gemm)."""
        super().for_variant(variant)  # refuses an unknown name, listing the valid ones
        self.variant = variant or F16_GEMM

    @property
    def f16(self) -> bool:
        """Whether this object runs f16_gemm (fp16 images and activations)."""
        return self.variant == F16_GEMM

    @property
    def activation(self) -> Activation:
        return F16 if self.f16 else Q8_1

    @property
    def exact(self) -> bool:
        return not self.f16

    @property
    def image_dtype(self) -> type[np.floating] | None:
        return np.float16 if self.f16 else None

    # ---------------------------------------------------------------- layout
    def layout(self, hidden: int, ffn: int) -> ExpertLayout:
        """gate_up_offset/bytes and down_offset/bytes name the blob's two *code* planes (the
        scale planes follow them; `Planes.of` has every offset). Images: see module doc."""
        self.check_dims(hidden, ffn)
        p = Planes.of(hidden, ffn)
        planar = ExpertLayout(hidden, ffn, p.gu_codes, p.gu_codes_bytes, p.down_codes,
                              p.down_codes_bytes, p.total, image_bytes(2 * ffn, hidden),
                              image_bytes(hidden, ffn))
        return fp16_image_layout(planar) if self.f16 else planar

    # ---------------------------------------------------------------- host side
    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        if imatrix is not None:
            raise FormatError("q2_blob: the quantizer takes no importance matrix")
        w = self.check_weights(weights)
        codes, scales = encode(w)
        return np.concatenate([codes, scales.view(np.uint8)], axis=1)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, self.row_bytes(cols))
        return decode(b[:, : cols // 4], b[:, cols // 4:].copy().view(np.float16))

    def pack_expert(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        ffn, hidden = np.shape(gate)
        lay = self.layout(hidden, ffn)
        if np.shape(up) != (ffn, hidden) or np.shape(down) != (hidden, ffn):
            raise FormatError(
                f"q2_blob: expert shapes gate {np.shape(gate)}, up {np.shape(up)}, down "
                f"{np.shape(down)} do not agree (want gate/up [ffn, hidden], down [hidden, ffn])")
        (gc, gs), (uc, us), (dc, ds) = (encode(self.check_weights(m)) for m in (gate, up, down))
        blob = np.concatenate([
            _interleave(gc, uc).reshape(-1), dc.reshape(-1),
            _interleave(gs, us).view(np.uint8).reshape(-1), ds.view(np.uint8).reshape(-1)])
        assert blob.size == lay.blob_bytes
        return blob

    def _planes(self, blob: np.ndarray, hidden: int, ffn: int):
        p = Planes.of(hidden, ffn)
        self.layout(hidden, ffn)
        b = np.asarray(blob, dtype=np.uint8).reshape(-1)
        if b.size < p.total:
            raise FormatError(f"q2_blob: blob of {b.size} bytes, expert {hidden}x{ffn} needs "
                              f"{p.total}")
        gc = b[p.gu_codes: p.gu_codes + p.gu_codes_bytes].reshape(2 * ffn, hidden // 4)
        dc = b[p.down_codes: p.down_codes + p.down_codes_bytes].reshape(hidden, ffn // 4)
        gs = b[p.gu_scales: p.gu_scales + p.gu_scales_bytes].view(np.float16)
        ds = b[p.down_scales: p.down_scales + p.down_scales_bytes].view(np.float16)
        return gc, dc, gs.reshape(2 * ffn, -1), ds.reshape(hidden, -1)

    def unpack_expert(self, blob: np.ndarray, hidden: int, ffn: int):
        gc, dc, gs, ds = self._planes(blob, hidden, ffn)
        gu = decode(gc, gs)
        return gu[0::2], gu[1::2], decode(dc, ds)

    def images(self, blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
        """The numpy twin of the gather: kernels/q2_blob/dequant.cu's fp16 images (f16_gemm),
        kernels/q2_blob/gather.cu's planar images (int8)."""
        gc, dc, gs, ds = self._planes(blob, hidden, ffn)
        if self.f16:
            gu16 = decode(gc, gs)  # blob rows: gate 0, up 0, gate 1, ...
            with np.errstate(over="ignore"):
                gu16 = np.concatenate([gu16[0::2], gu16[1::2]]).astype(np.float16)
                dn16 = decode(dc, ds).astype(np.float16)
            return gu16.reshape(-1).view(np.uint8), dn16.reshape(-1).view(np.uint8)
        gu = np.concatenate([gc[0::2].reshape(-1), gc[1::2].reshape(-1),
                             gs[0::2].view(np.uint8).reshape(-1),
                             gs[1::2].view(np.uint8).reshape(-1)])
        dn = np.concatenate([dc.reshape(-1), ds.view(np.uint8).reshape(-1)])
        return gu, dn

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        if self.f16:
            return fp16_image_values(image, rows, cols, f"{self.name} ({self.variant})")
        return decode(*_split_image(image, rows, cols))

    # ---------------------------------------------------------------- matmul reference
    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """f16_gemm: float64 products of the fp16 images and fp16 activations, rounded to
        float32 (grouped_gemm.gemm_reference). int8: mirrors kernels/q2_blob/mmq.cu bit for
        bit: per 32-value sub-block j ascending, idot_j = sum((code-1) * q) exactly, then
        acc += (ws * d_j) * idot_j in float32 with each product and sum rounded (ws = the fp16
        scale of the 64-group holding j)."""
        if self.f16:
            return gemm_reference(image, expert_ids, acts, bounds, m, k)
        q = np.asarray(acts.q)
        d = np.asarray(acts.d, dtype=np.float32)
        out = np.zeros((q.shape[0], m), dtype=np.float32)
        img = np.asarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
        nsub = k // 32
        for p, r0, r1 in expert_rows(expert_ids, bounds):
            if r1 <= r0:
                continue
            codes, scales = _split_image(img[p], m, k)
            wl = code_levels(codes).astype(np.float32).reshape(m, nsub, 32)
            qa = q[r0:r1].astype(np.float32).reshape(r1 - r0, nsub, 32)
            # integer partial sums below 2**24: float32 matmul is exact in any order
            idot = np.einsum("rjk,mjk->jrm", qa, wl, optimize=True)
            ws = scales.astype(np.float32)
            acc = np.zeros((r1 - r0, m), dtype=np.float32)
            for j in range(nsub):
                acc = acc + (ws[None, :, j // 2] * d[r0:r1, j, None]) * idot[j]
            out[r0:r1] = acc
        return out

    # ---------------------------------------------------------------- device side
    def kernels_class(self) -> type[FormatKernels]:
        return Q2DequantF16Kernels if self.f16 else Q2Kernels

    def mmq_variants(self) -> tuple[str, ...]:
        """f16_gemm (the default): fp16 images and the grouped fp16 GEMM; int8: the exact int8
        MMQ on q8_1 activations."""
        return (F16_GEMM, INT8)

    def for_variant(self, name: str | None) -> Q2Blob:
        """This object when it runs variant `name` already, else a copy running it."""
        super().for_variant(name)
        chosen = name or F16_GEMM
        if chosen == self.variant:
            return self
        other = copy.copy(self)
        other.variant = chosen
        return other

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.variant})>"


def _interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows a0, b0, a1, b1, ... (the blob's gate/up order)."""
    out = np.empty((2 * a.shape[0],) + a.shape[1:], dtype=a.dtype)
    out[0::2], out[1::2] = a, b
    return out


def _split_image(image: np.ndarray, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """An m x k image -> (codes uint8 [m, k/4], scales float16 [m, k/64])."""
    b = np.asarray(image, dtype=np.uint8).reshape(-1)
    if b.size < image_bytes(m, k):
        raise FormatError(f"q2_blob: image of {b.size} bytes, {m}x{k} needs {image_bytes(m, k)}")
    nc = m * k // 4
    return (b[:nc].reshape(m, k // 4),
            b[nc: image_bytes(m, k)].view(np.float16).reshape(m, k // GROUP))


class Q2Kernels(PerExpertKernels):
    """Launchers of kernels/q2_blob: the per-expert image rebuild and the int8 MMQ."""

    gather_kernel = ("q2_gather", "ii")
    gather_planes = 4
    mmq_kernel: ClassVar[str | None] = "q2_mmq"
    #: TILE_M, TILE_N, NTHREADS and KSTEP of kernels/q2_blob/mmq.cu
    mmq_tile = MmqTile(m=64, rows=64, threads=128, k_multiple=128)

    def gather_units(self) -> int:
        return Planes.of(self.layout.hidden, self.layout.ffn).gu_codes_bytes

    def gather_args(self) -> tuple[int, ...]:
        return (self.layout.hidden, self.layout.ffn)


class Q2DequantF16Kernels(Q2Kernels):
    """The per-expert dequantizing gather and the shared grouped fp16 GEMM (the exact MMQ
    module is not loaded)."""

    gather_kernel = ("q2_dequant_f16", "ii")
    gather_source = "dequant.cu"
    gather_planes = 2
    mmq_kernel: ClassVar[str | None] = None

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._gg = GroupedGemm(runtime, iq3_gather=False)

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        self._gg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def gather_units(self) -> int:
        """16 bytes per thread of the grid-sizing rule = one 32-bit code word per thread."""
        return 4 * Planes.of(self.layout.hidden, self.layout.ffn).gu_codes_bytes


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [Q2Blob()]
