"""A RoutedExperts op on the CUDA backend: a layer's expert products as the format's
matrix-vector launches over the routed (token, k) pairs (FormatKernels.gemv_routed), each
block reading its expert where the op's sources say it lies.

The kernels index a device table of blob addresses by expert id (the `expert_table` region:
one uint64 per expert of every layer this backend runs), since the routed set never reaches
the host. A layer's row is written from the op's sources the first time they are seen (a
resident slot's address, or the pinned host store's device-mapped address plus the expert's
offset) by a copy on the compute stream ahead of the launches (table_rows); the driver runs a
plan plainly before it captures it, so every row is in place (and every kernel module loaded,
which the launchers do on first use) before a capture, which then holds the launches alone.
Its own module to keep the executor to dispatch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ....errors import StrataError
from ....schedule.plan import HOST, RESIDENT, RoutedExperts, Source
from ....schedule.vram.memory_plan import EXPERT_TABLE_ENTRY
from ..backend_view import ExpertsView
from .table_rows import TableRows

if TYPE_CHECKING:
    from ....weights.store import ExpertStore

class RoutedHost(ExpertsView, Protocol):
    """What a RoutedExperts op reads of the backend that runs it (executor.CudaBackend),
    besides what every expert op reads."""

    @property
    def store(self) -> ExpertStore: ...
    def store_device_address(self) -> int: ...


class RoutedExpertsRunner:
    """The host copy of the expert table and which sources each layer's row holds."""

    def __init__(self, backend: RoutedHost):
        self.b = backend
        #: per layer: the sources its row was written from, and the row's host copy
        self.rows = TableRows()

    def address(self, layer: int, expert: int, src: Source) -> int:
        """The device address of an expert's blob at `src` (a resident slot or the host
        store; a ring slot is refused: no Copy feeds this op)."""
        kind, idx = src
        dev = self.b._device()
        if kind == RESIDENT:
            return dev.ptr["resident"] + idx * self.b.lay.slot_bytes
        if kind == HOST:
            return self.b.store_device_address() + self.b.store.offset(layer, expert)
        raise StrataError(f"RoutedExperts(layer {layer}) reads expert {expert} from {kind} "
                          f"{idx}: it reads resident slots and the host store only")

    def table(self, op: RoutedExperts) -> int:
        """The device address of op's layer's row, written from op.sources when they are new."""
        b, dev = self.b, self.b._device()
        E, at = b.spec.n_experts, op.layer - b.first
        if len(op.sources) != E:
            raise StrataError(f"RoutedExperts(layer {op.layer}) names {len(op.sources)} sources "
                              f"for {E} experts")
        ptr = dev.ptr["expert_table"] + at * E * EXPERT_TABLE_ENTRY
        self.rows.write(b.rt, dev.compute, op.layer, ptr, op.sources, lambda: [
            self.address(op.layer, e, s) for e, s in enumerate(op.sources)])
        return ptr

    def run(self, op: RoutedExperts) -> None:
        """Enqueues op's two launches on its stream, after its table row."""
        b = self.b
        if op.stream != "compute":
            raise StrataError(f"RoutedExperts(layer {op.layer}) on {op.stream}: it runs on the "
                              "compute stream, which holds the layer's routing")
        table = self.table(op)
        dev = b._device()
        p = dev.ptr
        b._mark("gemv experts")
        b.fks[op.layer].gemv_routed(dev.compute, table, p["topk_ids"], p["row_of"],
                                    p["act_hidden"], p["act_ffn"], p["down_out"],
                                    b._T * b.spec.top_k,
                                    host_reads=any(kind == HOST for kind, _ in op.sources))
