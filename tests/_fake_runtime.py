"""A recording stand-in for strata_rt.runtime.Runtime: the CUDA backend's control flow
(launch sequences, streams, events, graph capture, the input gate) is tested on the CPU with
it. tests/test_cuda_engine_cpu.py and tests/test_lanes.py install it with `install`."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from strata_rt.errors import PlanHazardError
from strata_rt.runtime.memory import plan_regions, regions_total

GIB = 1 << 30


class FakeEvent:
    def __init__(self, name):
        self.name, self.recorded, self.timing = name, False, False

    def record(self, stream):
        self.recorded = True
        stream.log.append(("record", self.name))

    def synchronize(self):
        assert self.recorded

    def elapsed_ms(self, later):
        return 0.25


class FakeStream:
    def __init__(self, name):
        self.name, self.handle, self.log = name, id(self), []

    def wait(self, ev):
        if not ev.recorded:
            raise PlanHazardError(f"{self.name} waits on never-recorded {ev.name}")
        self.log.append(("wait", ev.name))

    def synchronize(self):
        pass


class FakeKernel:
    def __init__(self, rt, name, types):
        self.rt, self.name, self.types = rt, name, types

    def launch(self, grid, block, stream, args, shared=0):
        assert len(args) == len(self.types), (self.name, len(args), self.types)
        assert all(isinstance(a, (int, float, np.integer)) for a in args), (self.name, args)
        assert min(grid) >= 1 and min(block) >= 1, (self.name, grid, block)
        self.rt.launches.append(self.name)
        self.rt.launched_on.append((self.name, stream.name, tuple(args)))


class FakeModule:
    def __init__(self, rt, source):
        self.rt, self.text = rt, Path(source).read_text()

    def kernel(self, name, types, overlap=False):
        return FakeKernel(self.rt, name, types)


class FakeArena:
    def __init__(self, sizes, budget=None, base=1 << 36):
        self.regions = plan_regions(sizes, budget=budget)
        self.total = regions_total(self.regions)
        self.base_ptr = base
        self._host = np.zeros(self.total, np.uint8)

    def ptr(self, name):
        return self.base_ptr + self.regions[name][0]

    def free(self):
        pass

    def view(self, name, dtype=np.uint8, shape=None):
        off, size = self.regions[name]
        arr = self._host[off: off + size].view(dtype)
        return arr if shape is None else arr.reshape(shape)


class FakeHostArena:
    """A HostArena of the fake runtime: numpy memory. `register` counts its calls and keeps
    what registration sees: whether the runtime's context was current, and the bytes then."""

    def __init__(self, rt, nbytes, what):
        self.rt, self.nbytes, self.what = rt, nbytes, what
        self.array = np.zeros(nbytes, np.uint8)
        self.length = nbytes
        self.registered = 0
        self.registered_current: bool | None = None
        self.registered_bytes: bytes | None = None

    def register(self):
        self.registered += 1
        self.registered_current = self.rt.active
        self.registered_bytes = self.array.tobytes()

    def free(self):
        pass


class FakeGraph:
    def __init__(self, rt):
        self.rt = rt

    def launch(self, stream):
        self.rt.launches.append("graph")

    def upload(self, stream):
        self.uploaded = True

    def hold(self, obj):
        self.held = obj

    def free(self):
        pass


class FakeGate:
    """The input gate: enqueues are logged as launches; nothing passes it on the host, so
    the next chunk's pass finds it open and closes it (InputPass.settle)."""

    def __init__(self, rt):
        self.rt, self.is_open, self.opened = rt, False, 0

    def enqueue(self, stream):
        self.rt.launches.append("gate")

    def open(self):
        self.is_open, self.opened = True, self.opened + 1

    def close(self):
        self.is_open = False




class NullCublas:
    """cuBLAS for the fake runtime (dense.kernels.Cublas): GEMMs that do nothing."""

    version = (0, 0, 0)

    def __init__(self, workspace, workspace_bytes, owner=None):
        pass

    def gemm(self, stream, x, w, out, rows, n_out, k, out_f32, accumulate):
        pass

    def destroy(self):
        pass


class FakeRuntime:
    """Records what the backend enqueues; the bounds read-back returns a random routing."""

    arch = "sm_90"

    def __init__(self, rng, spec, device=0):
        self.rng, self.spec, self.device_index = rng, spec, device
        #: (dst, src, bytes, stream name, source runtime's device) of every device copy
        self.peer_copies: list[tuple[int, int, int, str, int]] = []
        #: how often current() made this runtime's context current, and whether it is now
        self.activations, self.active = 0, False
        self.portable: list[bool] = []
        #: (sizes, arena) of every pinned allocation, in order (under store_memory "alloc" the
        #: host stores' too: one region "store" each)
        self.pinned_arenas: list[tuple[dict[str, int], FakeArena]] = []
        #: the host arenas asked for (the expert store's, the streamed dense layers': filled,
        #: then registered)
        self.host_arenas: list[FakeHostArena] = []
        #: (source address, bytes, stream name) of every device -> host copy
        self.dtoh: list[tuple[int, int, str]] = []
        #: (destination address, host array as given, stream name) of every host -> device
        #: copy (the array itself, not a snapshot: the caller owns its bytes)
        self.htod: list[tuple[int, np.ndarray, str]] = []
        self._arenas = 0
        self.launches: list[str] = []
        #: (kernel, stream name, arguments) of every kernel launch
        self.launched_on: list[tuple[str, str, tuple]] = []
        self.copies = 0
        self.closed = False
        self.arena = None
        self.arenas: list[FakeArena] = []
        self.gates: list[FakeGate] = []

    def free_bytes(self):
        return 8 * GIB

    def stream(self, name):
        return FakeStream(name)

    def event(self, name, timing=False):
        return FakeEvent(name)

    def pinned(self, sizes, portable=False):
        self.portable.append(portable)
        self.pinned_arenas.append((dict(sizes), FakeArena(sizes)))
        return self.pinned_arenas[-1][1]

    def host_arena(self, nbytes, what="host memory"):
        self.host_arenas.append(FakeHostArena(self, nbytes, what))
        return self.host_arenas[-1]

    @contextlib.contextmanager
    def current(self):
        was, self.active = self.active, True
        self.activations += 1
        try:
            yield self
        finally:
            self.active = was

    def memcpy_peer(self, dst, src, src_runtime, nbytes, stream):
        assert self.active, "a copy enqueued outside its runtime's current()"
        self.peer_copies.append((dst, src, nbytes, stream.name, src_runtime.device_index))

    def gate(self, word):
        assert word.dtype == np.uint32 and word.size == 1
        self.gates.append(FakeGate(self))
        return self.gates[-1]

    def device_arena(self, sizes, budget=None):
        # each arena (two split parts on one runtime hold one each) at its own addresses
        self.arena = FakeArena(sizes, budget, base=(1 << 36) + self._arenas * (1 << 34))
        self._arenas += 1
        self.arenas.append(self.arena)
        return self.arena

    def region(self, name):
        """The address of region `name` in the newest arena that has one (the engine's arena
        holds the model's regions; small ones, as the device argmax's, come after it)."""
        return next(a.ptr(name) for a in reversed(self.arenas) if name in a.regions)

    def module(self, source, defines=None, extra_flags=(), *, arch=None):
        return FakeModule(self, source)

    def memcpy_htod(self, dst, host, stream):
        self.copies += 1
        self.htod.append((dst, host, stream.name))

    def memcpy_dtoh(self, host, src, stream):
        self.dtoh.append((src, host.nbytes, stream.name))
        if host.dtype == np.int32:  # row bounds: a random routing of self.tokens tokens
            E = self.spec.n_experts
            for row in host.reshape(-1, E + 1):
                counts = self.rng.multinomial(self.tokens * self.spec.top_k, np.ones(E) / E)
                row[0] = 0
                row[1:] = np.cumsum(counts)

    def memset_d8(self, ptr, byte, nbytes, stream):
        pass

    @contextlib.contextmanager
    def capture(self, stream):
        before = len(self.launches)
        yield FakeGraph(self)
        del self.launches[before:]  # captured work does not run

    def close(self):
        self.closed = True


class FakeBuffer:
    """A device allocation of BenchRuntime: an address and a size."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes

    def free(self):
        pass


class BenchRuntime(FakeRuntime):
    """The recording runtime plus what the benchmarks call: allocations at distinct aligned
    addresses, pinned arenas that can be freed, device copies, synchronize."""

    name, max_shared_optin, f16_gemm = "fake", 232448, "own"
    #: as Runtime: sm_90 launches the exact routing chain overlapped (bench_routing toggles it)
    overlap_launches = True

    def __init__(self, rng, spec, device=0):
        super().__init__(rng, spec, device)
        self.next = 1 << 36

    def alloc(self, nbytes):
        buf = FakeBuffer(self.next, nbytes)
        self.next += -(-max(nbytes, 1) // 4096) * 4096
        return buf

    def pinned(self, sizes, portable=False):
        arena = super().pinned(sizes, portable)
        arena.free = lambda: None
        return arena

    def memcpy_dtod(self, dst, src, nbytes, stream):
        self.copies += 1

    def synchronize(self):
        pass


#: the launch name a recording mmq_table (table_kernels) logs
MMQ_TABLE = "mmq_table"


def table_kernels(monkeypatch, fmt) -> None:
    """Gives the kernels class of `fmt` a recording mmq_table, whatever the formats ship, so
    the format offers table products (QuantFormat.offers_mmq_table): each call is logged on
    its kernels' runtime as a launch named MMQ_TABLE with its arguments (table, offset, acts,
    bounds, out, m, k, rows_hint, n_experts)."""

    def mmq_table(self, stream, table, offset, acts, bounds, out, m, k, rows_hint, n_experts):
        args = (table, offset, acts, bounds, out, m, k, rows_hint, n_experts)
        assert all(isinstance(a, int | np.integer) for a in args), args
        self.runtime.launches.append(MMQ_TABLE)
        self.runtime.launched_on.append((MMQ_TABLE, stream.name, args))

    monkeypatch.setattr(fmt.kernels_class(), "mmq_table", mmq_table)


def install(monkeypatch, rng, spec, cls: type[FakeRuntime] = FakeRuntime) -> dict:
    """Runtime.open returns a `cls` (kept in the returned dict under "rt"); the CUTLASS
    library stays out (the fake runs no library kernels)."""
    import strata_rt.runtime as runtime_pkg

    holder: dict = {"rts": []}

    def open_fake(device=0):
        holder["rt"] = cls(rng, spec, device)
        holder["rts"].append(holder["rt"])
        return holder["rt"]

    monkeypatch.setattr(runtime_pkg.Runtime, "open", staticmethod(open_fake))
    monkeypatch.delenv("STRATA_CUDA_GRAPH", raising=False)
    monkeypatch.setenv("STRATA_F16_GEMM", "own")
    return holder
