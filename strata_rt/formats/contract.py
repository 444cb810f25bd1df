"""The format contract: everything about an expert that depends on its bytes.

One subclass per format, registered once through a plugin hook. The base class does the work
every format shares (sizes, the blob layout of "gate rows, up rows, down rows", expert packing,
GGUF conversion through float weights, the native byte-copy gathers); a subclass supplies only
its bytes: quantize, dequantize, the numpy reference of its matmul, and its kernels.

Conventions every format honours (the engine relies on them and never names a format):
- An expert has gate [ffn, hidden], up [ffn, hidden] and down [hidden, ffn] float weights.
- The *gate/up image* in a group buffer holds 2*ffn output rows: gate rows 0..ffn-1 then up rows;
  the MMQ over it yields out[:, :ffn] = gate and out[:, ffn:] = up. The *down image* holds
  hidden output rows. Images sit `image_bytes` apart in the group buffers.
- MMQ rows: activations are stored in sorted order (rows of expert e are bounds[e]..bounds[e+1]-1
  of the activation buffer); output row r of the MMQ belongs to activation row r.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..errors import FormatError
from ..resources import KERNELS_ROOT
from ..runtime.memory import align_up
from .activations import ACTIVATIONS, Q8_1, Activation

if TYPE_CHECKING:
    from ..runtime import Runtime

MMQ_GROUP = 16


def ids16(expert_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The 16 int32 kernel parameters naming a group's experts (unused positions = -1): the
    first parameters of every MMQ kernel."""
    n = len(expert_ids)
    if not 0 < n <= MMQ_GROUP:
        raise FormatError(f"an MMQ group holds 1..{MMQ_GROUP} experts, got {n}")
    if min(expert_ids) < 0:
        raise FormatError(f"expert ids must be >= 0, got {tuple(expert_ids)}")
    return tuple(int(e) for e in expert_ids) + (-1,) * (MMQ_GROUP - n)


def expert_rows(expert_ids: tuple[int, ...],
                bounds: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(group position, first row, end row) of each expert of a group, as the MMQ kernels read
    them from bounds: the loop every mmq_reference runs."""
    ids16(expert_ids)
    b = np.asarray(bounds, dtype=np.int64)
    for p, e in enumerate(expert_ids):
        yield p, int(b[e]), int(b[e + 1])


def first_misaligned(named: dict[str, int], align: int = 16) -> str | None:
    """Why a vectorized kernel (16-byte loads and stores) cannot take these addresses and
    sizes, naming the first offending one; None when all are multiples of `align`."""
    for label, value in named.items():
        if value % align:
            return f"{label} = {value} (0x{value:x}) is not a multiple of {align}"
    return None


@dataclass(frozen=True)
class ExpertLayout:
    """Where an expert's parts sit in its blob and how big its images are in a group buffer."""

    hidden: int
    ffn: int
    gate_up_offset: int
    gate_up_bytes: int
    down_offset: int
    down_bytes: int
    blob_bytes: int
    gate_up_image_bytes: int
    down_image_bytes: int

    @property
    def slot_bytes(self) -> int:
        """Bytes one VRAM slot or ring slot takes (blob rounded up to SLOT_ALIGN)."""
        return align_up(self.blob_bytes)


class QuantFormat:
    """Base class of a quantization format. Subclasses set the identity attributes and
    implement quantize/dequantize/mmq_reference and `kernels`."""

    #: short unique name used in configs and on the command line
    name: ClassVar[str]
    #: GGUF tensor type id when GGUF has this type, else None
    ggml_type: ClassVar[int | None] = None
    #: weights per quantization block along a row, and bytes per block
    block_values: ClassVar[int]
    block_bytes: ClassVar[int]
    #: True when an expert blob is plain byte ranges that one batched launch may copy
    native: ClassVar[bool] = False
    #: folder under kernels/ holding this format's CUDA sources
    kernel_dir: ClassVar[str]
    #: NMSE a quantize/dequantize round trip of Gaussian weights stays under (conformance)
    roundtrip_nmse: ClassVar[float] = 0.1
    #: dimension multiples the format needs (hidden and ffn must divide by this)
    dim_multiple: ClassVar[int] = 256
    #: one line for `strata plugins`
    description: ClassVar[str] = ""

    # The properties below may depend on the MMQ variant an object runs (for_variant), so the
    # engine, the registry and the conformance suite read them from the object. A format with
    # one arithmetic sets them as class attributes (`activation = Q8_1`, `exact = True`).
    @property
    def activation(self) -> Activation:
        """Activation encoding the MMQ consumes: strata_rt.formats.activations.Q8_1 or F16 (a
        class attribute may give the name, "q8_1" or "f16"); kernels/common builds both."""
        return Q8_1

    @property
    def exact(self) -> bool:
        """True when the GPU MMQ is bit-identical to mmq_reference (the conformance suite then
        compares bytes); False: it agrees within the suite's KERNEL_NMSE."""
        return False

    @property
    def in_place_max_rows(self) -> int:
        """Rows per expert (the walk's rows hint, strata_rt.schedule.vram.lanes.walk_rows_hint)
        up to which a chunk's products read resident experts in place (FormatKernels.mmq_in_place)
        instead of gathering them first; 0: never (the kernels have no mmq_in_place). Reading
        in place must give the gathered path's bytes, so the engine may choose per chunk
        (strata_rt.schedule.vram.in_place)."""
        return 0

    @property
    def image_dtype(self) -> type[np.floating] | None:
        """The element type the group-buffer images hold when it is narrower than what
        dequantize gives (images of fp16-rounded weights): the conformance suite's image check
        then compares with the weights rounded to it. None: the images are the exact weights."""
        return None

    @property
    def quantizes(self) -> bool:
        """Whether `quantize` encodes float weights. False for a format whose bytes only come
        from files another tool wrote: the conformance suite then builds its experts with
        random_expert and skips the round trips."""
        return True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Turns an activation given by name into its object; an unknown name is left for the
        registry to refuse with the list of valid ones."""
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("activation")
        if isinstance(kind, str) and kind in ACTIVATIONS:
            # a class attribute of the subclass, in place of the name (mypy sees the property)
            cls.activation = ACTIVATIONS[kind]  # type: ignore[method-assign, assignment]

    # ---------------------------------------------------------------- sizes and layout
    def row_bytes(self, cols: int) -> int:
        if cols % self.block_values:
            raise FormatError(
                f"{self.name}: a row of {cols} values is not a multiple of the block size "
                f"{self.block_values}")
        return cols // self.block_values * self.block_bytes

    def matrix_bytes(self, rows: int, cols: int) -> int:
        return rows * self.row_bytes(cols)

    def check_dims(self, hidden: int, ffn: int) -> None:
        for label, v in (("hidden", hidden), ("ffn", ffn)):
            if v <= 0 or v % self.dim_multiple:
                raise FormatError(
                    f"{self.name}: {label}={v} must be a positive multiple of {self.dim_multiple}")

    def layout(self, hidden: int, ffn: int) -> ExpertLayout:
        """Default blob: gate rows, up rows, down rows, each in the format's row encoding, no
        padding; the blob's gate+up range is the gate/up image and its down range the down
        image. Formats whose blob is arranged otherwise override this and `gather`."""
        self.check_dims(hidden, ffn)
        gu = 2 * self.matrix_bytes(ffn, hidden)
        dn = self.matrix_bytes(hidden, ffn)
        return ExpertLayout(hidden, ffn, 0, gu, gu, dn, gu + dn, gu, dn)

    # ---------------------------------------------------------------- host side (numpy)
    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """float32 [rows, cols] -> uint8 [rows, row_bytes(cols)] in this format's encoding."""
        raise NotImplementedError

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """uint8 bytes of a [rows, cols] matrix -> float32 [rows, cols] (the exact reference)."""
        raise NotImplementedError

    def check_weights(self, weights: np.ndarray) -> np.ndarray:
        """Validates a float matrix handed to quantize; returns it as float32."""
        w = np.asarray(weights)
        if w.ndim != 2:
            raise FormatError(f"{self.name}: weights must be 2-D, got shape {w.shape}")
        self.row_bytes(w.shape[1])
        w = w.astype(np.float32, copy=False)
        bad = ~np.isfinite(w)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise FormatError(
                f"{self.name}: weights hold {int(bad.sum())} NaN/Inf value(s), first at "
                f"row {r}, column {c}")
        return w

    def pack_expert(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        """Float weights of one expert -> its blob (uint8 [layout.blob_bytes])."""
        ffn, hidden = gate.shape
        lay = self.layout(hidden, ffn)
        if up.shape != (ffn, hidden) or down.shape != (hidden, ffn):
            raise FormatError(
                f"{self.name}: expert shapes gate {gate.shape}, up {up.shape}, down {down.shape}"
                f" do not agree (want gate/up [ffn, hidden] and down [hidden, ffn])")
        blob = np.concatenate([self.quantize(m).reshape(-1) for m in (gate, up, down)])
        assert blob.size == lay.blob_bytes
        return blob

    def unpack_expert(self, blob: np.ndarray, hidden: int, ffn: int):
        """Blob -> (gate, up, down) float32, the exact dequantized weights."""
        lay = self.layout(hidden, ffn)
        b = np.asarray(blob, dtype=np.uint8).reshape(-1)[: lay.blob_bytes]
        half = lay.gate_up_bytes // 2
        gate = self.dequantize(b[:half], (ffn, hidden))
        up = self.dequantize(b[half: lay.gate_up_bytes], (ffn, hidden))
        down = self.dequantize(b[lay.down_offset: lay.down_offset + lay.down_bytes],
                               (hidden, ffn))
        return gate, up, down

    def random_expert(self, rng: np.random.Generator, hidden: int, ffn: int) -> np.ndarray:
        """A valid blob for a synthetic model. Default: Gaussian weights, quantized."""
        scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
        gate = rng.standard_normal((ffn, hidden), dtype=np.float32) * scale_in
        up = rng.standard_normal((ffn, hidden), dtype=np.float32) * scale_in
        down = rng.standard_normal((hidden, ffn), dtype=np.float32) * scale_out
        return self.pack_expert(gate, up, down)

    def images(self, blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
        """Blob -> (gate/up image, down image): the bytes the gathers place in the group
        buffers. The numpy twin of `gather`; formats that rebuild images override it."""
        lay = self.layout(hidden, ffn)
        b = np.asarray(blob, dtype=np.uint8).reshape(-1)
        return (b[lay.gate_up_offset: lay.gate_up_offset + lay.gate_up_bytes],
                b[lay.down_offset: lay.down_offset + lay.down_bytes])

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """Dequantizes one image (gate/up: rows=2*ffn, cols=hidden; down: hidden, ffn)."""
        return self.dequantize(image, (rows, cols))

    def pack_gguf_experts(self, gate: Any, up: Any, down: Any) -> np.ndarray:
        """GGUF `ffn_{gate,up,down}_exps` tensors (gguf ReaderTensor) -> uint8
        [n_experts, blob_bytes]. Default: dequantize with the gguf package, then quantize
        expert by expert. Formats whose GGUF type matches override to copy raw bytes."""
        from gguf.quants import dequantize as gguf_dequantize

        mats = []
        for t in (gate, up, down):
            mats.append(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))
        n = mats[0].shape[0]
        return np.stack([self.pack_expert(mats[0][e], mats[1][e], mats[2][e]) for e in range(n)])

    def gguf_part_types(self) -> tuple[int | None, int | None, int | None]:
        """The GGUF types of the gate, up and down tensors this format's blob holds as they
        are (copied, not converted); None: it has no GGUF type."""
        return (self.ggml_type,) * 3

    # ---------------------------------------------------------------- matmul reference
    def prepare_activations(self, x: np.ndarray) -> Any:
        """numpy twin of the activation kernel: float32 [rows, K] -> what mmq_reference takes."""
        return self.activation.prepare(x)

    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """The numpy mirror of this format's MMQ arithmetic, in the kernel's order (bit for bit
        when `exact`).

        image: uint8 [n, image_bytes], position p holding expert expert_ids[p] (gate/up:
        m = 2*ffn, k = hidden; down: m = hidden, k = ffn); acts: from prepare_activations over
        all rows of the layer; bounds: int [n_experts_of_layer + 1] row offsets. Returns float32
        [rows, m] where rows = len(acts rows); rows of experts not in expert_ids are zero.
        `expert_rows(expert_ids, bounds)` gives the (position, first row, end row) to loop over."""
        raise NotImplementedError

    # ---------------------------------------------------------------- device side
    def kernel_sources(self) -> list[Path]:
        """The .cu files this format compiles (its own folder; kernels/common is included)."""
        return sorted((KERNELS_ROOT / self.kernel_dir).glob("*.cu"))

    def kernels(self, runtime: Runtime, layout: ExpertLayout) -> FormatKernels:
        """Compile (cached) and load this format's kernels on `runtime` for one expert
        geometry; returns its launchers (an instance of kernels_class())."""
        cls = self.kernels_class()
        if cls is None:
            from ..errors import PluginError

            raise PluginError(f"format {self.name} has no kernels: it runs only on the "
                              "reference backend")
        return cls(self, runtime, layout)

    def offers_batched_gather(self) -> bool:
        """Whether this format's launchers override gather_batch (the registry refuses a
        non-native format that does)."""
        cls = self.kernels_class()
        return cls is not None and cls.gather_batch is not FormatKernels.gather_batch

    def offers_gemv_routed(self) -> bool:
        """Whether this format's launchers override gemv_routed (a decode step may then run
        plan.RoutedExperts; STRATA_DECODE=gemv refuses a model with a layer that lacks it)."""
        cls = self.kernels_class()
        return cls is not None and cls.gemv_routed is not FormatKernels.gemv_routed

    def offers_mmq_table(self) -> bool:
        """Whether a layer of this format may run its resident experts' products as one
        launch per product over a table of slot addresses (FormatKernels.mmq_table; the
        planners then merge a layer's in-place Products into plan.LayerProducts)."""
        cls = self.kernels_class()
        return (self.in_place_max_rows > 0 and cls is not None
                and cls.mmq_table is not FormatKernels.mmq_table)

    def kernels_class(self) -> type[FormatKernels] | None:
        """The FormatKernels subclass holding this format's launchers (None: no kernels).
        Importable without CUDA, so the registry can inspect it on any machine."""
        return None

    def mmq_variants(self) -> tuple[str, ...]:
        """Names of the MMQ kernels this format can run (STRATA_MMQ_KERNEL picks one)."""
        return ("default",)

    def for_variant(self, name: str | None) -> QuantFormat:
        """The format object that runs MMQ variant `name` (None: the default, the first of
        mmq_variants()). A variant may change more than the kernel (image layout, activation
        encoding, gathers, the numpy reference), so the caller uses the returned object for
        everything: sizes, images, activations, kernels and mmq_reference alike. The base
        class has one arithmetic for all its variants and returns self once the name checks."""
        variants = self.mmq_variants()
        if name is not None and name not in variants:
            raise FormatError(f"format {self.name}: MMQ variant {name!r} (STRATA_MMQ_KERNEL) is "
                              f"unknown; valid: {', '.join(variants)}")
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class FormatKernels:
    """Launchers for one format's kernels on one runtime. All pointers are device addresses
    (ints); every launch goes on the given stream through a prepared call.

    gather(stream, src, pos, gu_buf, down_buf): copy one expert blob at `src` into position
        `pos` of the group buffers (gate/up image at gu_buf + pos*gate_up_image_bytes, down
        image at down_buf + pos*down_image_bytes).
    gather_batch(stream, srcs, first_pos, gu_buf, down_buf): native formats only; one launch
        for len(srcs) <= 16 experts at positions first_pos.. first_pos+len(srcs)-1, same bytes
        as len(srcs) calls of gather.
    gather_routed(stream, srcs, gu_buf, down_buf, bounds, first_expert): optional; as
        gather_batch at positions 0.., the members being experts first_expert.. of a layer,
        but a member whose expert has no rows in `bounds` (the layer's device row offsets) is
        skipped on the device, and sources may be page-locked host memory read over PCIe.
        A whole model's decode step then replays as a CUDA graph and still gathers only its
        routed experts; formats without it decode through the staging ring.
    mmq(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint): the products of a
        group: weights = group buffer (position p's image at weights + p*image_bytes),
        expert_ids = the experts at positions 0..n-1 (n <= 16, passed by value as kernel
        parameters, so a launch needs no host-to-device copy), bounds = device int32
        [n_experts_of_layer + 1] row offsets from the counting sort (expert e owns activation
        rows bounds[e]..bounds[e+1]-1; zero rows = early exit), acts = the activation buffer in
        the format's encoding (all rows of the layer, sorted by expert), out = float32 [rows, m]
        written at the same row indices. rows_hint sizes the grid (row tiles per expert); the
        kernel reads exact counts from bounds and loops over row tiles, so every rows_hint >= 1
        is correct (the streamed walk passes an estimate: its counts never reach the host).

    mmq_in_place(stream, sources, expert_ids, acts, bounds, out, m, k, rows_hint): optional
        (formats with in_place_max_rows > 0); mmq with position p's part of the expert read
        where it lies, at sources[p] (its resident slot plus the part's offset in the blob),
        so no gather precedes the products; the same bytes as gathering, then mmq.
    mmq_table(stream, table, offset, acts, bounds, out, m, k, rows_hint, n_experts):
        optional (formats that offer mmq_in_place); the products of every expert of a layer
        in one launch: table = device uint64 [n_experts] (8-byte aligned) of blob addresses,
        expert e's part at table[e] + offset (offset a multiple of 16; an entry of 0 skips the
        expert), grid (m / weight rows per block, n_experts, row tiles); for each expert the
        same bytes as mmq_in_place with that expert's part as its source.
    gemv_routed(stream, experts, ids, row_of, acts, mid, out, pairs, host_reads=False):
        optional; a decode
        step's expert products as matrix-vector launches over the layer's `pairs` routed
        (token, k) pairs (plan.RoutedExperts): experts = device table of the layer's
        n_experts blob addresses (uint64; resident slot or device-mapped host store), ids /
        row_of = the routing's expert and sorted row of each pair, acts = the fp16
        activations [rows, hidden], mid = fp16 SwiGLU rows [rows, ffn] it writes, out = float32
        [rows, hidden] at row row_of[p] (what the combine reads, as mmq writes it). The
        activation encoding must be F16; the results agree with gathering, mmq and SwiGLU
        within float32 rounding of the sums (not bit for bit). Formats without it decode
        through the routed gathers (QuantFormat.offers_gemv_routed says which). host_reads:
        some of the table's experts lie in pinned host memory, so the launches may trade speed
        on device memory for more loads in flight (a hint; the results must not depend on it
        beyond the float32 rounding of the sums). A plugin's override must take it.

    The MMQ kernel ABI every format follows (strata_rt.formats.launchers.launch_mmq launches it; the
    conformance suite checks it against the compiled kernel's parameters):
        kernel(Ids16 ids, weights, acts, bounds, out, int m, int k)
        grid = (m / weight rows per block, group position, row tiles), row tile t of expert e
        covering rows bounds[e] + t*tile ... and then every gridDim.z-th tile after it.
    Ids16 is `struct { int v[16]; }` from kernels/common/mma.cuh, filled by `ids16`.
    """

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        self.fmt = fmt
        self.runtime = runtime
        self.layout = layout

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        raise NotImplementedError

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        from ..errors import PluginError

        raise PluginError(
            f"format {self.fmt.name} is not native: its gathers run one expert per launch; "
            "the runtime must not ask it to batch")

    def gather_routed(self, stream, srcs: list[int], gu_buf: int, down_buf: int, bounds: int,
                      first_expert: int) -> None:
        from ..errors import PluginError

        raise PluginError(f"format {self.fmt.name} has no routed gather; its decode steps take "
                          "the staging ring")

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        raise NotImplementedError

    def mmq_in_place(self, stream, sources: list[int], expert_ids: tuple[int, ...], acts: int,
                     bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        from ..errors import PluginError

        raise PluginError(f"format {self.fmt.name} cannot read experts in place (its "
                          "in_place_max_rows is 0); its products read the group buffers")

    def mmq_table(self, stream, table: int, offset: int, acts: int, bounds: int, out: int,
                  m: int, k: int, rows_hint: int, n_experts: int) -> None:
        from ..errors import PluginError

        raise PluginError(f"format {self.fmt.name} has no table products; a layer's resident "
                          "experts run one in-place launch per group")

    def gemv_routed(self, stream, experts: int, ids: int, row_of: int, acts: int, mid: int,
                    out: int, pairs: int, host_reads: bool = False) -> None:
        from ..errors import PluginError

        raise PluginError(f"format {self.fmt.name} has no matrix-vector kernels for routed "
                          "experts; its decode steps take the routed gathers")
