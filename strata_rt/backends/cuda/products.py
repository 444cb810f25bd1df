"""A Products op on the CUDA backend: one group's gate/up MMQ, SwiGLU and down MMQ, reading
the group buffers, the image cache's block or (in place) the resident slots. The rows each
launch is told to expect come from the host's exact counts (staging) or a hint (walk: the
counts stay on the device and the kernels loop over row tiles past it). Its own module to keep
the executor to dispatch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ...schedule.image_cache import block_bytes
from ...schedule.in_place import resident_parts
from ...schedule.lanes import walk_rows_hint

if TYPE_CHECKING:
    import numpy as np

    from ...formats.contract import ExpertLayout, FormatKernels
    from ...runtime import Stream
    from ...schedule.plan import Products
    from ...weights.model import Model, MoESpec
    from .device_state import DeviceState
    from .layer_kernels import LayerKernels


class ProductsHost(Protocol):
    """What a Products op reads of the backend that runs it (executor.CudaBackend)."""

    @property
    def spec(self) -> MoESpec: ...
    @property
    def model(self) -> Model: ...
    @property
    def lay(self) -> ExpertLayout: ...
    @property
    def fks(self) -> list[FormatKernels]: ...
    @property
    def kernels(self) -> LayerKernels: ...
    @property
    def _T(self) -> int: ...
    @property
    def _counts(self) -> np.ndarray | None: ...
    def _device(self) -> DeviceState: ...
    def _lane(self, op: Products) -> tuple[Stream, int, int]: ...
    def _bounds_ptr(self, layer: int) -> int: ...
    def _mark(self, phase: str) -> None: ...


def run_products(b: ProductsHost, op: Products) -> None:
    """Enqueues op's three launches on its lane's stream."""
    spec, p, (s, gu_buf, dn_buf) = b.spec, b._device().ptr, b._lane(op)
    gu_w: int | list[int] = gu_buf
    dn_w: int | list[int] = dn_buf
    H, F = spec.hidden, spec.ffn
    ids = op.expert_ids
    lo, hi = ids[0], ids[-1] + 1
    if b._counts is not None:  # staging: exact counts are on the host
        rows_hint = int(b._counts[list(ids)].max())
        group_rows = int(b._counts[lo:hi].sum())
        if group_rows == 0:
            return
    else:  # walk: counts stay on the device; kernels loop over row tiles past the hint
        rows_hint = walk_rows_hint(b._T, spec)
        group_rows = min(b._T * spec.top_k, len(ids) * b._T)
    bounds = b._bounds_ptr(op.layer)
    fk = b.fks[op.layer]
    mmq: Callable[..., None] = fk.mmq
    if op.slots is not None:  # in place: each expert's parts where its slot holds them
        mmq = fk.mmq_in_place
        gu_w, dn_w = resident_parts(p["resident"], op.slots,
                                    b.model.formats.layout(op.layer), b.lay.slot_bytes)
    elif op.cached is not None:
        gu_block, dn_block = block_bytes(b.lay)
        gu_w = p["image_gate_up"] + op.cached * gu_block
        dn_w = p["image_down"] + op.cached * dn_block
    b._mark("gemm gate/up")
    mmq(s, gu_w, ids, p["act_hidden"], bounds, p["gate_up_out"], 2 * F, H, rows_hint)
    b._mark("swiglu+quantize")
    b.kernels.swiglu(s, bounds, lo, hi, group_rows)
    b._mark("gemm down")
    mmq(s, dn_w, ids, p["act_ffn"], bounds, p["down_out"], H, F, rows_hint)
