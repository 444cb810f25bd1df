"""The conformance suite: the same checks against any quant format.

A plugin author runs it on a new format (`run_conformance(fmt)` prints a report; pytest users
parametrize over `conformance_cases(fmt)`). The CPU checks need numpy only (nvcc for the compile
and kernel-parameter checks); given a Runtime, the GPU checks compare the format's gathers and
MMQ with its own numpy twins: byte for byte where the format declares `exact`, within
KERNEL_NMSE otherwise.

Geometry: u = lcm(dim_multiple, 128) (q8_1 needs K % 128 == 0); "wide" groups have hidden = 2u,
ffn = u, "tall" ones hidden = u, ffn = 2u, so a transposed matrix cannot pass. The packed group
is experts (1, 2, 3, 4) of a layer of six holding 3, 0, 1, 17, 2 and 5 rows: an expert with no
rows, one row, 17 rows (not a multiple of any tile) and rows of experts outside the group that
must stay untouched. The matmul checks also run on the other ROW_CASES of testing_groups.

A format that cannot quantize (`quantizes` False: its bytes come from files) skips the round
trips; its packed group is random_expert's. A format whose images hold its weights in a narrower
type than dequantize gives (fp16 images) declares `image_dtype`, and the image check compares
with the weights rounded to it; its kernels meet its reference within KERNEL_NMSE, and every
format's reference and kernels meet float64 within FLOAT64_NMSE.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PluginError
from .contract import MMQ_GROUP, QuantFormat
from .numerics import nmse
from .testing_abi import check_launch_abi
from .testing_groups import (
    GROUP,
    POISON,
    ROW_CASES,
    ConformanceSkip,
    GroupCase,
    RowCase,
    Subject,
    make_case,
)

if TYPE_CHECKING:
    from ..runtime import Runtime

__all__ = ["FLOAT64_NMSE", "KERNEL_NMSE", "Case", "CaseResult", "ConformanceSkip", "GroupCase",
           "Report", "RowCase", "Subject", "conformance_cases", "make_case",
           "run_conformance"]

#: NMSE every format's matmul reference must reach against float64 (issue contract).
FLOAT64_NMSE = 5e-4
#: NMSE a kernel of a format that is not `exact` may differ from its own reference by.
KERNEL_NMSE = 1e-6
ARCHES = ("sm_80", "sm_90")


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
    assert isinstance(fmt.exact, bool), f"exact must be True or False, not {fmt.exact!r}"
    assert fmt.native or not fmt.offers_batched_gather(), \
        "a format that is not native must not offer a batched gather"
    return (f"hidden {s.hidden}, ffn {s.ffn}: blob {lay.blob_bytes} B, images "
            f"{lay.gate_up_image_bytes} + {lay.down_image_bytes} B")


def _require_quantizer(s: Subject) -> None:
    if not s.fmt.quantizes:
        raise ConformanceSkip(f"{s.fmt.name} does not quantize (its experts come from files)")


def check_roundtrip(s: Subject) -> str:
    _require_quantizer(s)
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
    _require_quantizer(s)
    e = GROUP[0]
    unpacked = s.fmt.unpack_expert(s.blobs[e], s.hidden, s.ffn)
    for name, w, got in zip(("gate", "up", "down"), s.weights[e], unpacked):
        want = s.fmt.dequantize(s.fmt.quantize(w), w.shape)
        assert np.array_equal(got, want), \
            f"expert {e} {name}: unpack_expert(pack_expert) != dequantize(quantize)"
    return "pack/unpack agree with quantize/dequantize exactly"


def image_values(fmt: QuantFormat, weights: np.ndarray) -> np.ndarray:
    """What an image of these exact weights holds: the weights themselves, or the weights
    rounded to the format's `image_dtype` where it declares one (a format whose gathers
    dequantize into, say, fp16 images: numpy's cast rounds to nearest even, as the device
    conversions do)."""
    dtype = fmt.image_dtype
    if dtype is None:
        return weights
    with np.errstate(over="ignore"):
        return weights.astype(dtype).astype(np.float32)


def check_images(s: Subject) -> str:
    gu, dn = s.images
    lay = s.layout
    assert gu.shape[1] == lay.gate_up_image_bytes and dn.shape[1] == lay.down_image_bytes
    for p, e in enumerate(GROUP):
        gate, up, down = s.fmt.unpack_expert(s.blobs[e], s.hidden, s.ffn)
        want_gu = image_values(s.fmt, np.concatenate([gate, up]))
        assert np.array_equal(s.fmt.image_matrix(gu[p], 2 * s.ffn, s.hidden), want_gu), \
            f"expert {e}: gate/up image != [gate; up]"
        assert np.array_equal(s.fmt.image_matrix(dn[p], s.hidden, s.ffn),
                              image_values(s.fmt, down)), f"expert {e}: down image != down"
    rounded = s.fmt.image_dtype
    return "images dequantize to [gate; up] and down" + (
        f" rounded to {np.dtype(rounded).name}" if rounded is not None else "")


def check_reference(row_case: RowCase) -> Callable[[Subject], str]:
    def check(s: Subject) -> str:
        done = []
        for part in ("gate_up", "down"):
            c = s.case(row_case, part)
            ref = c.reference()
            assert ref.dtype == np.float32 and ref.shape == (c.rows, c.m), \
                f"{part}: mmq_reference gave {ref.dtype} {ref.shape}, want float32 {(c.rows, c.m)}"
            inside = c.group_rows()
            assert not ref[~inside].any(), f"{part}: rows of experts outside the group must be 0"
            if inside.any():
                err = nmse(ref[inside], c.float64_product()[inside])
                assert err <= FLOAT64_NMSE, \
                    f"{part}: reference vs float64 NMSE {err:.3g} > {FLOAT64_NMSE}"
                done.append(f"{part} {err:.3g}")
        return ("reference vs float64 NMSE " + ", ".join(done)) if done else "no rows: all zero"

    return check


def check_gguf_copy(s: Subject) -> str:
    """A format with a GGUF type loads tensors of that type as they are: pack_gguf_experts of
    [n_experts, rows, cols] tensors holding the group's blobs gives back those blobs."""
    fmt = s.fmt
    if fmt.ggml_type is None:
        raise ConformanceSkip(f"{fmt.name} has no GGUF type")
    lay, h, f = s.layout, s.hidden, s.ffn
    blobs = np.stack([s.blobs[e] for e in GROUP])
    ranges = ((0, (f, h)), (lay.gate_up_bytes // 2, (f, h)), (lay.down_offset, (h, f)))
    tensors = []
    for part, (offset, (rows, cols)) in zip(("gate", "up", "down"), ranges):
        nbytes = fmt.matrix_bytes(rows, cols)
        data = blobs[:, offset: offset + nbytes].reshape(len(GROUP), rows, -1)
        tensors.append(SimpleNamespace(name=f"blk.0.ffn_{part}_exps.weight", data=data,
                                       shape=[cols, rows, len(GROUP)],
                                       tensor_type=fmt.ggml_type))
    got = fmt.pack_gguf_experts(*tensors)
    assert np.array_equal(got, blobs[:, : lay.blob_bytes]), \
        "pack_gguf_experts of the format's own type is not a byte copy of the tensors"
    return f"{len(GROUP)} experts of GGUF type {fmt.ggml_type} copied byte for byte"


def check_compile(s: Subject) -> str:
    from ..runtime.compile import compile_cubin, nvcc_available

    sources = s.fmt.kernel_sources()
    if not sources:
        return "no kernels"
    if not nvcc_available():
        raise ConformanceSkip("nvcc not found")
    for src in sources:
        for arch in ARCHES:
            compile_cubin(src, arch)
    return f"{len(sources)} source(s) compile for {' and '.join(ARCHES)}"


# ---------------------------------------------------------------------------- GPU checks


def _placed(fill: np.ndarray, images: list[tuple[int, np.ndarray]], stride: int) -> np.ndarray:
    """`fill` with each (position, image) written at position*stride."""
    want = fill.copy()
    for pos, img in images:
        want[pos * stride: pos * stride + img.size] = img
    return want


def _free(*bufs: Any) -> None:
    for buf in bufs:
        buf.free()


def check_gpu_gather(s: Subject) -> str:
    lay = s.layout
    k, src = s.kernels_for(lay), s.upload_slots([s.blobs[e] for e in GROUP], lay)
    gu, dn, gu_fill, dn_fill = s.group_buffers(lay)
    positions = (15, 0, 7, 3)
    for p, pos in enumerate(positions):
        k.gather(s.stream, src.ptr + p * lay.slot_bytes, pos, gu.ptr, dn.ptr)
    got_gu, got_dn = s.download(gu.ptr, gu.nbytes), s.download(dn.ptr, dn.nbytes)
    _free(gu, dn, src)
    img_gu, img_dn = s.images
    want_gu = _placed(gu_fill, [(pos, img_gu[p]) for p, pos in enumerate(positions)],
                      lay.gate_up_image_bytes)
    want_dn = _placed(dn_fill, [(pos, img_dn[p]) for p, pos in enumerate(positions)],
                      lay.down_image_bytes)
    for name, got, want in (("gate/up", got_gu, want_gu), ("down", got_dn, want_dn)):
        bad = np.flatnonzero(got[: want.size] != want)
        assert bad.size == 0, (f"{name} group buffer differs from images() at {bad.size} "
                               f"byte(s), first at {bad[0]}")
    return f"gathers to positions {positions} equal images() byte for byte"


def check_gpu_gather_batch(s: Subject) -> str:
    lay = s.layout
    k = s.kernels_for(lay)
    if not s.fmt.native:
        try:
            k.gather_batch(s.stream, [0], 0, 0, 0)
        except PluginError:
            return "not native: batched gather refused"
        raise AssertionError("a non-native format accepted gather_batch")
    src = s.upload_slots([s.blobs[e] for e in GROUP], lay)
    cases = [(0, [p % len(GROUP) for p in range(MMQ_GROUP)]), (5, [0, 1, 2, 3]),
             (13, [3, 2, 1])]
    for first, picks in cases:
        one_gu, one_dn, gu_fill, dn_fill = s.group_buffers(lay)
        bat_gu, bat_dn, _, _ = s.group_buffers(lay, (gu_fill, dn_fill))
        ptrs = [src.ptr + p * lay.slot_bytes for p in picks]
        for i, ptr in enumerate(ptrs):
            k.gather(s.stream, ptr, first + i, one_gu.ptr, one_dn.ptr)
        k.gather_batch(s.stream, ptrs, first, bat_gu.ptr, bat_dn.ptr)
        for name, a, b in (("gate/up", one_gu, bat_gu), ("down", one_dn, bat_dn)):
            one, bat = s.download(a.ptr, a.nbytes), s.download(b.ptr, b.nbytes)
            bad = np.flatnonzero(one != bat)
            assert bad.size == 0, (f"batch of {len(picks)} at {first}: {name} buffer differs "
                                   f"from per-expert gathers at {bad.size} byte(s)")
        _free(one_gu, one_dn, bat_gu, bat_dn)
    _free(src)
    return "batches of 16 at 0, 4 at 5, 3 at 13 equal per-expert gathers byte for byte"


def run_gpu_mmq(s: Subject, c: GroupCase, rows_hint: int, in_place: bool = False
                ) -> np.ndarray:
    """Gathers the case's blobs to positions 0..n-1 with the format's gather, encodes the
    activations on the device, runs the MMQ into a NaN-poisoned output; returns it raw
    (uint8 [rows, m*4]). in_place: no gather; mmq_in_place reads each blob in its slot."""
    from ..schedule.vram.in_place import resident_parts

    rt, lay = s.require_gpu(), c.fmt.layout(c.hidden, c.ffn)
    k = s.kernels_for(lay)
    src = s.upload_slots(c.blobs, lay)
    gu, dn, _, _ = s.group_buffers(lay)
    for p in range(0 if in_place else len(c.blobs)):
        k.gather(s.stream, src.ptr + p * lay.slot_bytes, p, gu.ptr, dn.ptr)
    acts = s.device_activations(c.x)
    bounds = s.upload(c.bounds)
    out = rt.alloc(max(c.rows * c.m * 4, 16))
    rt.memset_d8(out.ptr, POISON, out.nbytes, s.stream)
    if in_place:
        parts = resident_parts(src.ptr, tuple(range(len(c.blobs))), lay)
        k.mmq_in_place(s.stream, parts[0 if c.part == "gate_up" else 1], c.expert_ids,
                       acts.ptr, bounds.ptr, out.ptr, c.m, c.k, rows_hint)
    else:
        k.mmq(s.stream, gu.ptr if c.part == "gate_up" else dn.ptr, c.expert_ids, acts.ptr,
              bounds.ptr, out.ptr, c.m, c.k, rows_hint)
    raw = s.download(out.ptr, c.rows * c.m * 4).reshape(c.rows, c.m * 4)
    _free(src, gu, dn, acts, bounds, out)
    return raw


def check_gpu_mmq(row_case: RowCase) -> Callable[[Subject], str]:
    def check(s: Subject) -> str:
        done = []
        for part in ("gate_up", "down"):
            c = s.case(row_case, part)
            raw = run_gpu_mmq(s, c, c.rows_hint())
            # the streamed walk sizes grids from an estimate (row counts live on the device):
            # a kernel must cover every row of bounds whatever rows_hint says
            low = run_gpu_mmq(s, c, 1)
            assert np.array_equal(low, raw), f"{part}: MMQ with rows_hint=1 differs"
            inside = c.group_rows()
            assert np.all(raw[~inside] == POISON), f"{part}: MMQ wrote rows outside its group"
            if not inside.any():
                done.append(f"{part}: nothing written")
                continue
            got = raw.view(np.float32)[inside]
            ref = c.reference()[inside]
            assert not np.isnan(got).any(), f"{part}: MMQ left rows of its experts unwritten"
            if s.fmt.exact:
                diff = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
                assert diff.size == 0, (f"{part}: {diff.size} value(s) differ from the reference "
                                        f"(the format is exact), max |diff| "
                                        f"{np.max(np.abs(got - ref)):.3g}")
                vs_ref = "bit-exact"
            else:
                err = nmse(got, ref)
                assert err <= KERNEL_NMSE, f"{part}: NMSE {err:.3g} vs reference > {KERNEL_NMSE}"
                vs_ref = f"NMSE {err:.3g} vs reference"
            err64 = nmse(got, c.float64_product()[inside])
            assert err64 <= FLOAT64_NMSE, f"{part}: NMSE {err64:.3g} vs float64 > {FLOAT64_NMSE}"
            done.append(f"{part}: {vs_ref}, {err64:.3g} vs float64")
        return "; ".join(done)

    return check


def check_gpu_mmq_in_place(s: Subject) -> str:
    """A format that reads experts in place (in_place_max_rows > 0) gives gather + mmq's
    bytes from the slots, for every row case."""
    if s.fmt.in_place_max_rows <= 0:
        raise ConformanceSkip("the format does not read experts in place")
    for rc in ROW_CASES:
        for part in ("gate_up", "down"):
            c = s.case(rc, part)
            want = run_gpu_mmq(s, c, c.rows_hint())
            for hint in (c.rows_hint(), 1):
                got = run_gpu_mmq(s, c, hint, in_place=True)
                assert np.array_equal(got, want), (f"{rc.name} {part}: mmq_in_place (rows_hint "
                                                   f"{hint}) differs from gather + mmq")
    return f"{len(ROW_CASES)} row cases x 2 parts: the bytes of gather + mmq"


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
    Case("gguf_copy", False, check_gguf_copy),
    *(Case(f"reference_{rc.name}", False, check_reference(rc)) for rc in ROW_CASES),
    Case("kernels_compile", False, check_compile),
    Case("launch_abi", False, check_launch_abi),
    Case("gpu_gather", True, check_gpu_gather),
    Case("gpu_gather_batch", True, check_gpu_gather_batch),
    *(Case(f"gpu_mmq_{rc.name}", True, check_gpu_mmq(rc)) for rc in ROW_CASES),
    Case("gpu_mmq_in_place", True, check_gpu_mmq_in_place),
)


def conformance_cases(fmt: QuantFormat | None = None) -> list[Case]:
    """The named checks (CPU ones first); every format gets the same (`fmt`: for pytest)."""
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
