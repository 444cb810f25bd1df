"""A Products op on the CUDA backend: one group's gate/up MMQ, SwiGLU and down MMQ, reading
the group buffers, the image cache's block or (in place) the resident slots; a LayerProducts:
the same three launches over every expert of its layer, the matmuls reading each expert's
part where its resident slot holds it through the layer's row of the `products_table` region
(FormatKernels.mmq_table: expert e's blob address at entry e, written from the op's slots when
they change, table_rows). The rows each launch is told to expect come from the host's exact
counts (staging) or a hint (walk: the counts stay on the device and the kernels loop over row
tiles past it). Its own module to keep the executor to dispatch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ....errors import StrataError
from ....schedule.plan import LayerProducts, Products
from ....schedule.vram.image_cache import block_bytes
from ....schedule.vram.in_place import resident_parts
from ....schedule.vram.lanes import walk_rows_hint
from ....schedule.vram.memory_plan import EXPERT_TABLE_ENTRY
from ..backend_view import ExpertsView

if TYPE_CHECKING:
    import numpy as np

    from ....runtime import Stream
    from ....weights.model import Model
    from ..layer_kernels import LayerKernels


class ProductsHost(ExpertsView, Protocol):
    """What a Products op reads of the backend that runs it (executor.CudaBackend), besides
    what every expert op reads."""

    @property
    def model(self) -> Model: ...
    @property
    def kernels(self) -> LayerKernels: ...
    @property
    def _counts(self) -> np.ndarray | None: ...
    def _lane(self, op: Products) -> tuple[Stream, int, int]: ...
    def _bounds_ptr(self, layer: int) -> int: ...


def product_ops(b: ProductsHost) -> dict[type, Callable[[Any], None]]:
    """The executor's dispatch of the product ops."""
    return {Products: lambda op: run_products(b, op),
            LayerProducts: lambda op: run_layer_products(b, op)}


def _rows(b: ProductsHost, ids: Sequence[int]) -> tuple[int, int] | None:
    """(rows_hint, group_rows) of launches over experts `ids` (ascending; the SwiGLU covers
    ids[0]..ids[-1]): the rows the matmuls are told to expect per expert and the SwiGLU's rows
    in all; None when the host's exact counts give the experts no row (nothing to launch)."""
    spec, lo, hi = b.spec, ids[0], ids[-1] + 1
    if b._counts is not None:  # staging: exact counts are on the host
        group_rows = int(b._counts[lo:hi].sum())
        return None if group_rows == 0 else (int(b._counts[list(ids)].max()), group_rows)
    # walk: counts stay on the device; kernels loop over row tiles past the hint
    return walk_rows_hint(b._T, spec), min(b._T * spec.top_k, len(ids) * b._T)


def run_products(b: ProductsHost, op: Products) -> None:
    """Enqueues op's three launches on its lane's stream."""
    spec, p, (s, gu_buf, dn_buf) = b.spec, b._device().ptr, b._lane(op)
    gu_w: int | list[int] = gu_buf
    dn_w: int | list[int] = dn_buf
    H, F = spec.hidden, spec.ffn
    ids = op.expert_ids
    lo, hi = ids[0], ids[-1] + 1
    rows = _rows(b, ids)
    if rows is None:
        return
    rows_hint, group_rows = rows
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


def run_layer_products(b: ProductsHost, op: LayerProducts) -> None:
    """Enqueues op's three launches on the compute stream, after its layer's table row."""
    spec, dev = b.spec, b._device()
    p, H, F, E = dev.ptr, spec.hidden, spec.ffn, spec.n_experts
    if op.stream != "compute":
        raise StrataError(f"LayerProducts(layer {op.layer}) on {op.stream}: it runs on the "
                          "compute stream, which holds the layer's routing")
    if sorted(e for part in op.parts for e in part.expert_ids) != list(range(E)) \
            or any(part.slots is None for part in op.parts):
        raise StrataError(f"LayerProducts(layer {op.layer}) does not read each of the "
                          f"layer's {E} experts in place once")
    rows = _rows(b, range(E))
    if rows is None:
        return
    rows_hint, group_rows = rows
    table = layer_table(b, op)
    lay, fk, bounds = b.model.formats.layout(op.layer), b.fks[op.layer], b._bounds_ptr(op.layer)
    b._mark("gemm gate/up")
    fk.mmq_table(dev.compute, table, lay.gate_up_offset, p["act_hidden"], bounds,
                 p["gate_up_out"], 2 * F, H, rows_hint, E)
    b._mark("swiglu+quantize")
    b.kernels.swiglu(dev.compute, bounds, 0, E, group_rows)
    b._mark("gemm down")
    fk.mmq_table(dev.compute, table, lay.down_offset, p["act_ffn"], bounds, p["down_out"], H, F,
                 rows_hint, E)


def layer_table(b: ProductsHost, op: LayerProducts) -> int:
    """The device address of op's layer's row of the products table, holding each expert's
    blob address (its resident slot's), written when the layer's slots change."""
    dev, E, slots = b._device(), b.spec.n_experts, op.slots
    ptr = dev.ptr["products_table"] + (op.layer - b.first) * E * EXPERT_TABLE_ENTRY
    base, step = dev.ptr["resident"], b.lay.slot_bytes
    dev.products_rows.write(b.rt, dev.compute, op.layer, ptr, slots,
                            lambda: [base + s * step for s in slots])
    return ptr
