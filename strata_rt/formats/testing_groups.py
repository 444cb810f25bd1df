"""The inputs the conformance suite and the format tests share: MMQ groups with chosen row
counts (GroupCase), the row-count cases every format is checked on (ROW_CASES), and the subject
of a conformance run (Subject: one format, its inputs built once, its device helpers).

A group case is a layer of sorted activation rows (row counts per expert, bounds from their
prefix sums), a group of experts at positions 0..n-1 with their blobs and images, and the float
inputs; the exact float64 product of the dequantized images is the yardstick.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .contract import MMQ_GROUP, ExpertLayout, FormatKernels, QuantFormat

if TYPE_CHECKING:
    from ..runtime import Runtime

PARTS = ("gate_up", "down")
#: the experts of the packed group (pack_expert of Gaussian weights) in a layer of six
GROUP = (1, 2, 3, 4)
#: rows of the six experts of that layer
ROW_COUNTS = (3, 0, 1, 17, 2, 5)


#: device buffers are filled with this byte first (float32 0xFFFFFFFF is NaN)
POISON = 0xFF

class ConformanceSkip(Exception):
    """A check that cannot run here (no nvcc, no runtime, no kernels); not a failure."""


@dataclass(frozen=True)
class RowCase:
    """Rows of every expert of a layer, the group's expert ids, and the geometry: "wide" is
    hidden = 2u, ffn = u; "tall" is hidden = u, ffn = 2u (u = lcm(dim_multiple, 128))."""

    name: str
    counts: tuple[int, ...]
    expert_ids: tuple[int, ...]
    shape: str = "wide"

    def dims(self, fmt: QuantFormat) -> tuple[int, int]:
        u = math.lcm(fmt.dim_multiple, 128)
        return (2 * u, u) if self.shape == "wide" else (u, 2 * u)


#: zero rows, one row, counts off every tile size, experts outside the group, ffn > hidden, a
#: full group of 16, and a group with no rows at all (its MMQ must write nothing)
ROW_CASES = (
    RowCase("mixed", ROW_COUNTS, GROUP),
    RowCase("tile_edges", (64, 0, 65, 130, 1, 33), (0, 2, 3, 5), "tall"),
    RowCase("full_group", tuple(range(1, MMQ_GROUP + 1)) + (4,), tuple(range(MMQ_GROUP))),
    RowCase("empty", (0, 0, 0, 6), (0, 1, 2)),
)


def part_shape(part: str, hidden: int, ffn: int) -> tuple[int, int]:
    """(m, k) of the products of `part` ("gate_up" or "down")."""
    return (2 * ffn, hidden) if part == "gate_up" else (hidden, ffn)


@dataclass
class GroupCase:
    """One MMQ call: a group buffer of n images, the layer's activations and bounds."""

    fmt: QuantFormat
    hidden: int
    ffn: int
    part: str
    expert_ids: tuple[int, ...]
    bounds: np.ndarray          # int32 [n_layer_experts + 1]
    x: np.ndarray               # float32 [rows, k], sorted by expert
    blobs: list[np.ndarray]     # uint8 blob per group position
    image: np.ndarray = field(init=False)    # uint8 [n, image_bytes]
    weights: list[np.ndarray] = field(init=False)  # float32 [m, k] per position

    def __post_init__(self) -> None:
        m, k = self.shape
        images = [np.asarray(self.fmt.images(b, self.hidden, self.ffn)[PARTS.index(self.part)],
                             dtype=np.uint8) for b in self.blobs]
        self.image = np.stack(images)
        self.weights = [self.fmt.image_matrix(img, m, k) for img in images]

    @property
    def shape(self) -> tuple[int, int]:
        return part_shape(self.part, self.hidden, self.ffn)

    @property
    def m(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @cached_property
    def acts(self) -> Any:
        return self.fmt.prepare_activations(self.x)

    def rows_hint(self) -> int:
        """The largest row count of the group's experts (what the staging path passes)."""
        return int(max(self.bounds[e + 1] - self.bounds[e] for e in self.expert_ids))

    def group_rows(self) -> np.ndarray:
        """Mask of the activation rows the group's experts own."""
        mask = np.zeros(self.rows, dtype=bool)
        for e in self.expert_ids:
            mask[self.bounds[e]: self.bounds[e + 1]] = True
        return mask

    def float64_product(self) -> np.ndarray:
        """The exact product of the dequantized images and the float inputs (other rows 0)."""
        out = np.zeros((self.rows, self.m), dtype=np.float64)
        for p, e in enumerate(self.expert_ids):
            r0, r1 = self.bounds[e], self.bounds[e + 1]
            out[r0:r1] = self.x[r0:r1].astype(np.float64) @ self.weights[p].astype(np.float64).T
        return out

    def reference(self) -> np.ndarray:
        """fmt.mmq_reference of the case (computed once)."""
        if "_reference" not in self.__dict__:
            self.__dict__["_reference"] = np.asarray(self.fmt.mmq_reference(
                self.image, self.expert_ids, self.acts, self.bounds, self.m, self.k))
        return self.__dict__["_reference"]


def make_case(fmt: QuantFormat, rng: np.random.Generator, hidden: int, ffn: int, part: str,
              counts: list[int] | tuple[int, ...], expert_ids: tuple[int, ...],
              blobs: list[np.ndarray] | None = None) -> GroupCase:
    """counts: rows of every expert of the layer; expert_ids: the group; blobs: one per group
    position (default: fmt.random_expert). A few rows get large outliers and one 32-value
    group is zeroed, the activation encodings' edge cases."""
    bounds = np.zeros(len(counts) + 1, dtype=np.int32)
    bounds[1:] = np.cumsum(counts)
    if blobs is None:
        blobs = [fmt.random_expert(rng, hidden, ffn) for _ in expert_ids]
    k = part_shape(part, hidden, ffn)[1]
    x = rng.standard_normal((int(bounds[-1]), k), dtype=np.float32)
    if x.shape[0]:
        x[rng.integers(x.shape[0])] *= 40.0
        x[rng.integers(x.shape[0]), :32] = 0.0
    return GroupCase(fmt, hidden, ffn, part, tuple(expert_ids), bounds, x, list(blobs))


class Subject:
    """One format under test with the inputs every check shares (built lazily, once)."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime | None = None,
                 seed: int | None = None):
        self.fmt = fmt
        self.runtime = runtime
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
        self.rng = np.random.default_rng(self.seed)
        self.hidden, self.ffn = ROW_CASES[0].dims(fmt)
        self._cases: dict[tuple[str, str], GroupCase] = {}

    @cached_property
    def layout(self) -> ExpertLayout:
        return self.fmt.layout(self.hidden, self.ffn)

    def gaussian(self, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)

    @cached_property
    def weights(self) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Float gate, up, down of each expert of the packed group."""
        h, f = self.hidden, self.ffn
        return {e: (self.gaussian(f, h, h ** -0.5), self.gaussian(f, h, h ** -0.5),
                    self.gaussian(h, f, f ** -0.5)) for e in GROUP}

    @cached_property
    def blobs(self) -> dict[int, np.ndarray]:
        """The packed group: pack_expert of `weights`, or random_expert for a format that
        does not quantize."""
        if not self.fmt.quantizes:
            return {e: self.fmt.random_expert(self.rng, self.hidden, self.ffn) for e in GROUP}
        return {e: self.fmt.pack_expert(*w) for e, w in self.weights.items()}

    @cached_property
    def images(self) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [len(GROUP), image_bytes] gate/up and down images, position p = GROUP[p]."""
        pairs = [self.fmt.images(self.blobs[e], self.hidden, self.ffn) for e in GROUP]
        return (np.stack([np.asarray(a, np.uint8) for a, _ in pairs]),
                np.stack([np.asarray(b, np.uint8) for _, b in pairs]))

    def case(self, row_case: RowCase, part: str) -> GroupCase:
        """The group case of `row_case` for `part`; both parts share the blobs. "mixed" uses the
        packed group, the others random_expert blobs."""
        key = (row_case.name, part)
        if key not in self._cases:
            hidden, ffn = row_case.dims(self.fmt)
            other = (row_case.name, PARTS[1 - PARTS.index(part)])
            if other in self._cases:
                blobs = self._cases[other].blobs
            elif row_case.name == ROW_CASES[0].name:
                blobs = [self.blobs[e] for e in GROUP]
            else:
                blobs = [self.fmt.random_expert(self.rng, hidden, ffn)
                         for _ in row_case.expert_ids]
            self._cases[key] = make_case(self.fmt, self.rng, hidden, ffn, part, row_case.counts,
                                         row_case.expert_ids, blobs)
        return self._cases[key]

    # ------------------------------------------------------------------ device helpers
    def require_gpu(self) -> Runtime:
        if self.runtime is None:
            raise ConformanceSkip("no runtime given (GPU checks need a CUDA device)")
        if not self.fmt.kernel_sources():
            raise ConformanceSkip(f"{self.fmt.name} has no kernels")
        return self.runtime

    def kernels_for(self, layout: ExpertLayout) -> FormatKernels:
        key = (layout.hidden, layout.ffn)
        cache = self.__dict__.setdefault("_kernels", {})
        if key not in cache:
            cache[key] = self.fmt.kernels(self.require_gpu(), layout)
        return cache[key]

    @cached_property
    def stream(self) -> Any:
        return self.require_gpu().stream("conformance")

    def upload(self, host: np.ndarray) -> Any:
        rt = self.require_gpu()
        host = np.ascontiguousarray(host)
        buf = rt.alloc(max(host.nbytes, 16))
        if host.nbytes:
            rt.memcpy_htod(buf.ptr, host.reshape(-1).view(np.uint8), self.stream)
        return buf

    def download(self, ptr: int, nbytes: int) -> np.ndarray:
        host = np.empty(nbytes, dtype=np.uint8)
        self.require_gpu().memcpy_dtoh(host, ptr, self.stream)
        self.stream.synchronize()
        return host

    def device_activations(self, x: np.ndarray) -> Any:
        """x encoded on the device by the shared activation kernel, checked against the numpy
        twin byte for byte (so an MMQ failure after it is the MMQ's)."""
        from .activations import ActivationKernels

        rt, act = self.require_gpu(), self.fmt.activation
        rows, k = x.shape
        dx = self.upload(x)
        acts = rt.alloc(max(act.nbytes(rows, k), 16))
        rt.memset_d8(acts.ptr, POISON, acts.nbytes, self.stream)
        ActivationKernels(rt).launch(act, self.stream, dx.ptr, k, 0, acts.ptr, rows, k)
        got = self.download(acts.ptr, act.nbytes(rows, k))
        dx.free()
        want = act.device_bytes(self.fmt.prepare_activations(x))
        assert np.array_equal(got, want), f"device {act} activations differ from the numpy twin"
        return acts

    def upload_slots(self, blobs: list[np.ndarray], layout: ExpertLayout) -> Any:
        """Blobs in one device buffer at slot stride (like the ring or the cache), each slot's
        tail filled with random bytes."""
        host = self.rng.integers(0, 256, (len(blobs), layout.slot_bytes), dtype=np.uint8)
        for p, blob in enumerate(blobs):
            host[p, : layout.blob_bytes] = blob
        return self.upload(host)

    def group_buffers(self, layout: ExpertLayout, fill: tuple | None = None):
        """Device gate/up and down group buffers (MMQ_GROUP positions) filled with `fill`
        (random bytes when None); returns (gu, down, gu_fill, down_fill)."""
        sizes = (MMQ_GROUP * layout.gate_up_image_bytes, MMQ_GROUP * layout.down_image_bytes)
        fills = fill if fill is not None else tuple(
            self.rng.integers(0, 256, n, dtype=np.uint8) for n in sizes)
        return self.upload(fills[0]), self.upload(fills[1]), fills[0], fills[1]
