"""The conformance suite: the same checks against any quant format.

A plugin author runs it on a new format (`run_conformance(fmt)` prints a report; pytest users
parametrize over `conformance_cases(fmt)`). The CPU checks need numpy only (and nvcc for the
compile check); given a Runtime, the GPU checks compare the format's gathers and MMQ with its own
numpy twins, byte for byte where the contract promises exactness.

Geometry: hidden = 2*m, ffn = m with m = lcm(dim_multiple, 128) (q8_1 needs K % 128 == 0);
hidden != ffn so a transposed matrix cannot pass. Rows: a layer of six experts holding
3, 0, 1, 17, 2 and 5 rows; the group under test is experts (1, 2, 3, 4), so it covers an expert
with no rows, one row, 17 rows (not a multiple of any tile), and rows of experts outside the
group that must stay untouched.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .errors import PluginError
from .formats import MMQ_GROUP, FormatKernels, QuantFormat

if TYPE_CHECKING:
    from .runtime import Runtime

#: NMSE every format's matmul reference must reach against float64 (issue contract).
FLOAT64_NMSE = 5e-4
#: NMSE a non-q8_1 kernel may differ from its own reference by (tensor cores sum differently).
KERNEL_NMSE = 1e-6
ROW_COUNTS = (3, 0, 1, 17, 2, 5)
GROUP = (1, 2, 3, 4)
POISON = 0xFF  # float32 0xFFFFFFFF is NaN


class ConformanceSkip(Exception):
    """A check that cannot run here (no nvcc, no runtime, no kernels); not a failure."""


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Squared error over squared signal, in float64 (NaN if `got` holds NaN)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    denom = float(np.sum(w * w))
    return float(np.sum((g - w) ** 2)) / (denom if denom > 0 else 1.0)


class Subject:
    """One format under test with the inputs every check shares (built lazily, once)."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime | None = None,
                 seed: int | None = None):
        self.fmt = fmt
        self.runtime = runtime
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        self.rng = np.random.default_rng(self.seed)
        m = math.lcm(fmt.dim_multiple, 128)
        self.hidden, self.ffn = 2 * m, m
        self.bounds = np.concatenate([[0], np.cumsum(ROW_COUNTS)]).astype(np.int32)
        self.rows = int(self.bounds[-1])

    @cached_property
    def layout(self):
        return self.fmt.layout(self.hidden, self.ffn)

    def gaussian(self, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)

    @cached_property
    def weights(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Float gate, up, down of each expert of the group."""
        h, f = self.hidden, self.ffn
        return {e: (self.gaussian(f, h, h ** -0.5), self.gaussian(f, h, h ** -0.5),
                    self.gaussian(h, f, f ** -0.5)) for e in GROUP}

    @cached_property
    def blobs(self) -> dict[int, np.ndarray]:
        return {e: self.fmt.pack_expert(*w) for e, w in self.weights.items()}

    @cached_property
    def images(self) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [len(GROUP), image_bytes] gate/up and down images, position p = GROUP[p]."""
        pairs = [self.fmt.images(self.blobs[e], self.hidden, self.ffn) for e in GROUP]
        return (np.stack([np.asarray(a, np.uint8) for a, _ in pairs]),
                np.stack([np.asarray(b, np.uint8) for _, b in pairs]))

    def shapes(self, part: str) -> tuple[int, int]:
        """(m, k) of the products of `part` ("gate_up" or "down")."""
        return (2 * self.ffn, self.hidden) if part == "gate_up" else (self.hidden, self.ffn)

    @cached_property
    def inputs(self) -> dict[str, np.ndarray]:
        """float32 activations [rows, k] per part."""
        return {part: self.gaussian(self.rows, self.shapes(part)[1])
                for part in ("gate_up", "down")}

    def group_rows(self) -> np.ndarray:
        """Boolean mask of activation rows owned by experts of the group."""
        mask = np.zeros(self.rows, dtype=bool)
        for e in GROUP:
            mask[self.bounds[e]: self.bounds[e + 1]] = True
        return mask

    def float64_product(self, part: str) -> np.ndarray:
        """The exact product of the dequantized image weights with the float32 inputs."""
        m, k = self.shapes(part)
        image = self.images[0 if part == "gate_up" else 1]
        x = self.inputs[part].astype(np.float64)
        out = np.zeros((self.rows, m))
        for p, e in enumerate(GROUP):
            lo, hi = self.bounds[e], self.bounds[e + 1]
            w = self.fmt.image_matrix(image[p], m, k).astype(np.float64)
            out[lo:hi] = x[lo:hi] @ w.T
        return out

    @cached_property
    def references(self) -> dict[str, np.ndarray]:
        out = {}
        for part in ("gate_up", "down"):
            m, k = self.shapes(part)
            image = self.images[0 if part == "gate_up" else 1]
            acts = self.fmt.prepare_activations(self.inputs[part])
            out[part] = np.asarray(
                self.fmt.mmq_reference(image, GROUP, acts, self.bounds, m, k))
        return out

    # ------------------------------------------------------------------ device helpers
    def require_gpu(self) -> Runtime:
        if self.runtime is None:
            raise ConformanceSkip("no runtime given (GPU checks need a CUDA device)")
        if not self.fmt.kernel_sources():
            raise ConformanceSkip(f"{self.fmt.name} has no kernels")
        return self.runtime

    @cached_property
    def kernels(self) -> FormatKernels:
        return self.fmt.kernels(self.require_gpu(), self.layout)

    @cached_property
    def stream(self):
        return self.require_gpu().stream("conformance")

    def upload(self, host: np.ndarray):
        rt = self.require_gpu()
        host = np.ascontiguousarray(host)
        buf = rt.alloc(host.nbytes)
        rt.memcpy_htod(buf.ptr, host.reshape(-1).view(np.uint8), self.stream)
        return buf

    def download(self, ptr: int, nbytes: int) -> np.ndarray:
        host = np.empty(nbytes, dtype=np.uint8)
        self.runtime.memcpy_dtoh(host, ptr, self.stream)
        self.stream.synchronize()
        return host

    @cached_property
    def sources(self):
        """The group's blobs in one device buffer at slot stride (like the ring or the cache),
        each slot's tail filled with random bytes."""
        slot = self.layout.slot_bytes
        host = self.rng.integers(0, 256, (len(GROUP), slot), dtype=np.uint8)
        for p, e in enumerate(GROUP):
            host[p, : self.layout.blob_bytes] = self.blobs[e]
        return self.upload(host)

    def src_ptr(self, p: int) -> int:
        return self.sources.ptr + p * self.layout.slot_bytes

    def group_buffers(self, fill: np.ndarray | None = None):
        """Device gate/up and down group buffers (MMQ_GROUP positions) filled with `fill`
        (random bytes when None); returns (gu, down, gu_fill, down_fill)."""
        lay = self.layout
        sizes = (MMQ_GROUP * lay.gate_up_image_bytes, MMQ_GROUP * lay.down_image_bytes)
        fills = fill if fill is not None else tuple(
            self.rng.integers(0, 256, n, dtype=np.uint8) for n in sizes)
        return self.upload(fills[0]), self.upload(fills[1]), fills[0], fills[1]


# ---------------------------------------------------------------------------- CPU checks


def check_sizes(s: Subject) -> str:
    fmt, lay = s.fmt, s.layout
    assert fmt.row_bytes(s.hidden) == s.hidden // fmt.block_values * fmt.block_bytes
    assert lay.hidden == s.hidden and lay.ffn == s.ffn
    parts = sorted([(lay.gate_up_offset, lay.gate_up_bytes, "gate/up"),
                    (lay.down_offset, lay.down_bytes, "down")])
    end = 0
    for off, size, name in parts:
        assert size > 0, f"{name} part of the blob is empty"
        assert off >= end, f"{name} part (offset {off}) overlaps the part before it"
        end = off + size
    assert end <= lay.blob_bytes, f"parts end at {end}, past blob_bytes {lay.blob_bytes}"
    assert lay.slot_bytes % 256 == 0 and lay.slot_bytes >= lay.blob_bytes
    if type(fmt).image_matrix is QuantFormat.image_matrix:
        assert lay.gate_up_image_bytes == fmt.matrix_bytes(2 * s.ffn, s.hidden), \
            "gate/up image is not 2*ffn x hidden in the format's row encoding"
        assert lay.down_image_bytes == fmt.matrix_bytes(s.hidden, s.ffn)
    blob = s.blobs[GROUP[0]]
    assert blob.dtype == np.uint8 and blob.size == lay.blob_bytes, \
        f"pack_expert gave {blob.size} bytes, layout says {lay.blob_bytes}"
    return (f"hidden {s.hidden}, ffn {s.ffn}: blob {lay.blob_bytes} B, images "
            f"{lay.gate_up_image_bytes} + {lay.down_image_bytes} B")


def check_roundtrip(s: Subject) -> str:
    w = s.gaussian(s.ffn, s.hidden)
    raw = s.fmt.quantize(w)
    assert raw.dtype == np.uint8 and raw.shape == (s.ffn, s.fmt.row_bytes(s.hidden)), \
        f"quantize gave {raw.dtype} {raw.shape}"
    back = s.fmt.dequantize(raw, w.shape)
    assert back.dtype == np.float32 and back.shape == w.shape
    err = nmse(back, w)
    assert err <= s.fmt.roundtrip_nmse, \
        f"round-trip NMSE {err:.3g} above the format's stated {s.fmt.roundtrip_nmse:.3g}"
    return f"round-trip NMSE {err:.4g} (stated bound {s.fmt.roundtrip_nmse:.3g})"


def check_pack_unpack(s: Subject) -> str:
    e = GROUP[0]
    unpacked = s.fmt.unpack_expert(s.blobs[e], s.hidden, s.ffn)
    for name, w, got in zip(("gate", "up", "down"), s.weights[e], unpacked):
        want = s.fmt.dequantize(s.fmt.quantize(w), w.shape)
        assert np.array_equal(got, want), \
            f"expert {e} {name}: unpack_expert(pack_expert) != dequantize(quantize)"
    return "pack/unpack agree with quantize/dequantize exactly"


def check_images(s: Subject) -> str:
    gu, dn = s.images
    lay = s.layout
    assert gu.shape[1] == lay.gate_up_image_bytes and dn.shape[1] == lay.down_image_bytes
    for p, e in enumerate(GROUP):
        gate, up, down = s.fmt.unpack_expert(s.blobs[e], s.hidden, s.ffn)
        assert np.array_equal(s.fmt.image_matrix(gu[p], 2 * s.ffn, s.hidden),
                              np.concatenate([gate, up])), f"expert {e}: gate/up image != [gate; up]"
        assert np.array_equal(s.fmt.image_matrix(dn[p], s.hidden, s.ffn), down), \
            f"expert {e}: down image != down"
    return "images dequantize to [gate; up] and down"


def check_reference(part: str) -> Callable[[Subject], str]:
    def check(s: Subject) -> str:
        m, _ = s.shapes(part)
        ref = s.references[part]
        assert ref.dtype == np.float32 and ref.shape == (s.rows, m), \
            f"mmq_reference gave {ref.dtype} {ref.shape}, want float32 {(s.rows, m)}"
        inside = s.group_rows()
        assert not ref[~inside].any(), "rows of experts outside the group must be zero"
        err = nmse(ref[inside], s.float64_product(part)[inside])
        assert err <= FLOAT64_NMSE, f"reference vs float64 NMSE {err:.3g} > {FLOAT64_NMSE}"
        return f"{part}: reference vs float64 NMSE {err:.3g}"

    return check


def check_compile(s: Subject) -> str:
    from .runtime.compile import compile_cubin, nvcc_available

    sources = s.fmt.kernel_sources()
    if not sources:
        return "no kernels"
    if not nvcc_available():
        raise ConformanceSkip("nvcc not found")
    for src in sources:
        compile_cubin(src, "sm_90")
    return f"{len(sources)} source(s) compile for sm_90"


# ---------------------------------------------------------------------------- GPU checks


def _placed(fill: np.ndarray, images: list[tuple[int, np.ndarray]], stride: int) -> np.ndarray:
    """`fill` with each (position, image) written at position*stride."""
    want = fill.copy()
    for pos, img in images:
        want[pos * stride: pos * stride + img.size] = img
    return want


def check_gpu_gather(s: Subject) -> str:
    k, lay = s.kernels, s.layout
    gu, dn, gu_fill, dn_fill = s.group_buffers()
    positions = (15, 0, 7, 3)
    for p, pos in enumerate(positions):
        k.gather(s.stream, s.src_ptr(p), pos, gu.ptr, dn.ptr)
    got_gu, got_dn = s.download(gu.ptr, gu.nbytes), s.download(dn.ptr, dn.nbytes)
    img_gu, img_dn = s.images
    want_gu = _placed(gu_fill, [(pos, img_gu[p]) for p, pos in enumerate(positions)],
                      lay.gate_up_image_bytes)
    want_dn = _placed(dn_fill, [(pos, img_dn[p]) for p, pos in enumerate(positions)],
                      lay.down_image_bytes)
    for name, got, want in (("gate/up", got_gu, want_gu), ("down", got_dn, want_dn)):
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{name} group buffer differs from images() at {bad.size} "
                               f"byte(s), first at {bad[0]}")
    for buf in (gu, dn):
        buf.free()
    return f"gathers to positions {positions} equal images() byte for byte"


def check_gpu_gather_batch(s: Subject) -> str:
    k = s.kernels
    if not s.fmt.native:
        try:
            k.gather_batch(s.stream, [s.src_ptr(0)], 0, 0, 0)
        except PluginError:
            return "not native: batched gather refused"
        raise AssertionError("a non-native format accepted gather_batch")
    cases = [(0, [p % len(GROUP) for p in range(MMQ_GROUP)]), (5, [0, 1, 2, 3]),
             (13, [3, 2, 1])]
    for first, picks in cases:
        one_gu, one_dn, gu_fill, dn_fill = s.group_buffers()
        bat_gu, bat_dn, _, _ = s.group_buffers((gu_fill, dn_fill))
        for i, p in enumerate(picks):
            k.gather(s.stream, s.src_ptr(p), first + i, one_gu.ptr, one_dn.ptr)
        k.gather_batch(s.stream, [s.src_ptr(p) for p in picks], first, bat_gu.ptr, bat_dn.ptr)
        for name, a, b in (("gate/up", one_gu, bat_gu), ("down", one_dn, bat_dn)):
            one, bat = s.download(a.ptr, a.nbytes), s.download(b.ptr, b.nbytes)
            bad = np.flatnonzero(one != bat)
            assert bad.size == 0, (f"batch of {len(picks)} at {first}: {name} buffer differs "
                                   f"from per-expert gathers at {bad.size} byte(s)")
        for buf in (one_gu, one_dn, bat_gu, bat_dn):
            buf.free()
    return "batches of 16 at 0, 4 at 5, 3 at 13 equal per-expert gathers byte for byte"


def _device_activations(s: Subject, x: np.ndarray):
    """Encodes x on the device with the shared activation kernel; checks it against the numpy
    twin byte for byte, so an MMQ failure below is the MMQ's."""
    from .activations import ActivationKernels, activation_bytes

    rt, kind = s.runtime, s.fmt.activation
    rows, k = x.shape
    dx = s.upload(x)
    acts = rt.alloc(activation_bytes(kind, rows, k))
    rt.memset_d8(acts.ptr, POISON, acts.nbytes, s.stream)
    ActivationKernels(rt).launch(kind, s.stream, dx.ptr, k, 0, acts.ptr, rows, k)
    got = s.download(acts.ptr, acts.nbytes)
    twin = s.fmt.prepare_activations(x)
    want = twin.to_device_bytes() if kind == "q8_1" else np.asarray(twin).view(np.uint8)
    assert np.array_equal(got, want.reshape(-1)), \
        f"device {kind} activations differ from the numpy twin"
    dx.free()
    return acts


def check_gpu_mmq(part: str) -> Callable[[Subject], str]:
    def check(s: Subject) -> str:
        k, rt = s.kernels, s.require_gpu()
        m, kk = s.shapes(part)
        gu, dn, _, _ = s.group_buffers()
        for p in range(len(GROUP)):
            k.gather(s.stream, s.src_ptr(p), p, gu.ptr, dn.ptr)
        acts = _device_activations(s, s.inputs[part])
        bounds = s.upload(s.bounds)
        out = rt.alloc(s.rows * m * 4)

        def run(rows_hint: int) -> np.ndarray:
            rt.memset_d8(out.ptr, POISON, out.nbytes, s.stream)
            k.mmq(s.stream, gu.ptr if part == "gate_up" else dn.ptr, GROUP, acts.ptr,
                  bounds.ptr, out.ptr, m, kk, rows_hint)
            return s.download(out.ptr, out.nbytes).reshape(s.rows, m * 4)

        raw = run(max(ROW_COUNTS[e] for e in GROUP))
        # The streamed walk sizes grids from an estimate (row counts live on the device): a
        # kernel must cover every row of bounds whatever rows_hint says.
        low = run(1)
        for buf in (gu, dn, acts, bounds, out):
            buf.free()
        assert np.array_equal(low, raw), "MMQ with rows_hint=1 differs from the exact hint"
        inside = s.group_rows()
        assert np.all(raw[~inside] == POISON), "MMQ wrote rows of experts outside its group"
        got = raw.view(np.float32)[inside]
        ref = s.references[part][inside]
        assert not np.isnan(got).any(), "MMQ left rows of its experts unwritten (NaN poison)"
        if s.fmt.activation == "q8_1":
            diff = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
            assert diff.size == 0, (f"{part}: {diff.size} value(s) differ from the reference "
                                    f"(exact arithmetic promised), max |diff| "
                                    f"{np.max(np.abs(got - ref)):.3g}")
            vs_ref = "bit-exact vs reference"
        else:
            err = nmse(got, ref)
            assert err <= KERNEL_NMSE, f"{part}: NMSE {err:.3g} vs reference > {KERNEL_NMSE}"
            vs_ref = f"NMSE {err:.3g} vs reference"
        err64 = nmse(got, s.float64_product(part)[inside])
        assert err64 <= FLOAT64_NMSE, f"{part}: NMSE {err64:.3g} vs float64 > {FLOAT64_NMSE}"
        return f"{part}: {vs_ref}, NMSE {err64:.3g} vs float64"

    return check


# ---------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Case:
    name: str
    gpu: bool
    check: Callable[[Subject], str]

    def run(self, subject: Subject) -> str:
        """Runs the check; failures name the format, the check and the seed to replay."""
        try:
            return self.check(subject)
        except AssertionError as e:
            raise AssertionError(f"{subject.fmt.name} {self.name} (seed {subject.seed}): "
                                 f"{e}") from None


_CASES = (
    Case("sizes", False, check_sizes),
    Case("roundtrip", False, check_roundtrip),
    Case("pack_unpack", False, check_pack_unpack),
    Case("images", False, check_images),
    Case("reference_gate_up", False, check_reference("gate_up")),
    Case("reference_down", False, check_reference("down")),
    Case("kernels_compile", False, check_compile),
    Case("gpu_gather", True, check_gpu_gather),
    Case("gpu_gather_batch", True, check_gpu_gather_batch),
    Case("gpu_mmq_gate_up", True, check_gpu_mmq("gate_up")),
    Case("gpu_mmq_down", True, check_gpu_mmq("down")),
)


def conformance_cases(fmt: QuantFormat | None = None) -> list[Case]:
    """The named checks (CPU ones first). `fmt` is accepted for symmetry with pytest
    parametrization; every format gets the same checks."""
    return list(_CASES)


@dataclass
class CaseResult:
    name: str
    status: str  # "pass", "fail" or "skip"
    detail: str
    seconds: float


@dataclass
class Report:
    format: str
    seed: int
    results: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status != "fail" for r in self.results)

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.results) if self.results else 4
        lines = [f"conformance of {self.format} (seed {self.seed}):"]
        for r in self.results:
            lines.append(f"  {r.status.upper():4s}  {r.name:<{width}}  {r.seconds:6.2f} s  "
                         f"{r.detail}")
        verdict = "passes" if self.ok else "FAILS"
        lines.append(f"{self.format} {verdict}")
        return "\n".join(lines)


def run_conformance(fmt: QuantFormat, runtime: Runtime | None = None,
                    seed: int | None = None) -> Report:
    """Runs every check (GPU ones only with a runtime) and collects the outcome of each
    instead of stopping at the first failure."""
    subject = Subject(fmt, runtime, seed)
    report = Report(fmt.name, subject.seed)
    for case in conformance_cases(fmt):
        start = time.perf_counter()
        try:
            status, detail = "pass", case.run(subject)
        except ConformanceSkip as e:
            status, detail = "skip", str(e)
        except Exception as e:  # a crash in one check is that check's failure
            status, detail = "fail", f"{type(e).__name__}: {e}"
        report.results.append(CaseResult(case.name, status, detail,
                                         time.perf_counter() - start))
    return report
