"""The host stores' memory on the CPU, with a fake driver: real anonymous memory
(strata_rt.runtime.host_arena), page-locked by a recording stand-in for cuMemHostRegister.
The expert store is registered exactly once, after its fill, as PORTABLE | DEVICEMAP memory,
and unregistered when its context closes; a refused registration is a BudgetError naming the
size. The streamed dense layers' store (backends/cuda/dense/host_store.py) follows the same
setting: registered once after its fill, or one page-locked allocation. The same on a
device: tests/test_host_arena_gpu.py."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import weakref

import numpy as np
import pytest

from strata_rt.backends.cuda.context import CudaContext
from strata_rt.errors import BudgetError, StrataError
from strata_rt.runtime import driver_api, host_arena
from strata_rt.runtime.host_arena import HUGE_PAGE, HostArena
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore

SPEC = MoESpec(n_layers=3, hidden=256, ffn=256, n_experts=8, top_k=2)
CUDA_ERROR_OUT_OF_MEMORY = 2


class FakeDriver:
    """cuMemHostRegister_v2, cuMemHostUnregister and cuGetErrorString: calls are logged;
    a registration copies the bytes it locks (what the device would then read)."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.calls: list[tuple] = []
        self.seen: bytes | None = None
        self.current: list[bool] = []
        self.rt: StubRuntime | None = None

    def cuMemHostRegister_v2(self, ptr, size, flags):
        address = ptr.value if isinstance(ptr, ctypes.c_void_p) else ptr
        self.calls.append(("register", address, size, flags))
        if self.rt is not None:
            self.current.append(self.rt.active)
        if self.fail:
            return self.fail
        self.seen = ctypes.string_at(address, size)
        return 0

    def cuMemHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr.value if isinstance(ptr, ctypes.c_void_p) else ptr))
        return 0

    def cuGetErrorString(self, code, out):
        out._obj.value = b"out of memory"
        return 0


class StubRuntime:
    """What CudaContext and HostArena use of a Runtime: ownership, current(), close()."""

    def __init__(self) -> None:
        self._owned: weakref.WeakSet = weakref.WeakSet()  # weakly, as Runtime holds them
        self.active = False
        self.closed = False

    @property
    def owned(self) -> list:
        return list(self._owned)

    def _own(self, obj) -> None:
        self._owned.add(obj)

    def host_arena(self, nbytes: int, what: str = "host memory") -> HostArena:
        return HostArena(self, nbytes, what)

    def pinned(self, sizes, portable: bool = False):
        """Runtime.pinned (cuMemHostAlloc) as store_memory "alloc" calls it: recorded."""
        self.pinned_calls = [*getattr(self, "pinned_calls", []), (dict(sizes), portable,
                                                                   self.active)]
        return _StubPinned(sum(sizes.values()))

    @contextlib.contextmanager
    def current(self):
        was, self.active = self.active, True
        try:
            yield self
        finally:
            self.active = was

    def close(self) -> None:
        self.active = True  # Runtime.close frees what it owns while its context is current
        gc.collect()  # as Runtime.close: what nothing holds is gone from the weak set
        for obj in self.owned:
            obj.free()
        self.closed = True


class _StubPinned:
    """A PinnedArena's view of its one region, in plain memory."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, np.uint8)

    def view(self, name: str) -> np.ndarray:
        return self.array


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(host_arena, "libcuda", lambda: fake)
    monkeypatch.setattr(driver_api, "libcuda", lambda: fake)
    return fake


@pytest.fixture
def context(monkeypatch, driver, request):
    import strata_rt.runtime as runtime_pkg

    rts: list[StubRuntime] = []

    def open_stub(device=0):
        rts.append(StubRuntime())
        driver.rt = rts[-1]
        return rts[-1]

    monkeypatch.setattr(runtime_pkg.Runtime, "open", staticmethod(open_stub))
    ctx = CudaContext((0,), getattr(request, "param", "register"))
    yield ctx, rts[0]
    ctx.close()


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.synthetic(SPEC, 5, pool_bytes=5 * 40_000)  # a tiled pool (index), 3 layers


def test_the_store_is_registered_once_after_its_fill(context, driver, model):
    ctx, rt = context
    store = ExpertStore(model, ctx.host_alloc, ctx.host_pin)
    want = ExpertStore(model).arena  # plain numpy, no pin step
    assert store.arena.tobytes() == want.tobytes()
    ((call, ptr, size, flags),) = driver.calls
    assert call == "register" and flags == 0x01 | 0x02  # PORTABLE | DEVICEMAP
    assert flags == host_arena.REGISTER_FLAGS
    assert driver.current == [True]  # in the runtime's context
    assert ptr == store.arena.ctypes.data and ptr % HUGE_PAGE == 0
    assert size % HUGE_PAGE == 0 and store.nbytes <= size < store.nbytes + HUGE_PAGE
    # what the registration locked is the filled store (the tail past it never written)
    assert driver.seen is not None and driver.seen[: store.nbytes] == want.tobytes()
    assert set(driver.seen[store.nbytes:]) <= {0}
    assert set(store.timings) == {"alloc_s", "fill_s", "pin_s"}
    del store  # nothing here holds the arena: the context must, until its runtime (which
    ctx.close()  # holds it weakly) has freed it
    assert driver.calls[1:] == [("unregister", ptr)] and rt.closed


def test_a_freed_arena_is_freed_once(driver):
    rt = StubRuntime()
    arena = HostArena(rt, 5, "a test")
    arena.register()
    arena.free()
    assert arena.array is None and not arena.registered
    arena.free()  # a second free does nothing
    assert [c[0] for c in driver.calls] == ["register", "unregister"]


def test_a_refused_registration_is_a_budget_error_naming_the_size(context, driver, model):
    ctx, rt = context
    driver.fail = CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(BudgetError) as info:
        ExpertStore(model, ctx.host_alloc, ctx.host_pin)
    (arena,) = rt.owned
    size = arena.length
    text = str(info.value)
    assert f"{size / (1 << 20):.1f} MiB" in text and "the expert store" in text
    assert "ulimit -l" in text and "CUDA error 2 (out of memory)" in text and "RAM" in text
    ctx.close()  # nothing was locked: the memory is unmapped, nothing unregistered
    assert [c[0] for c in driver.calls] == ["register"] and arena.array is None


def test_the_arena_is_fresh_aligned_memory_registered_once(driver):
    rt = StubRuntime()
    arena = HostArena(rt, 3 * HUGE_PAGE + 5, "a test")
    assert rt.owned == [arena]
    assert arena.array is not None and arena.array.size == 3 * HUGE_PAGE + 5
    assert arena.ptr % HUGE_PAGE == 0 and arena.length == 4 * HUGE_PAGE
    assert not arena.array.any()  # anonymous memory reads as zeros before its first write
    arena.array[:] = 7
    arena.register()
    with pytest.raises(StrataError, match="registered twice"):
        arena.register()
    assert [c[0] for c in driver.calls] == ["register"]
    rt.close()
    with pytest.raises(StrataError, match="after it was freed"):
        arena.register()


def test_host_pin_refuses_memory_it_did_not_hand_out(context):
    ctx, _ = context
    with pytest.raises(StrataError, match="not one this context's host_alloc"):
        ctx.host_pin(np.zeros(16, np.uint8))


def test_the_reference_backend_pins_nothing(model):
    from strata_rt.backends.reference.context import NumpyContext

    ctx = NumpyContext()
    store = ExpertStore(model, ctx.host_alloc, ctx.host_pin)
    assert store.arena.tobytes() == ExpertStore(model).arena.tobytes()


@pytest.mark.parametrize("context", ["alloc"], indirect=True)
def test_store_memory_alloc_page_locks_first_and_registers_nothing(context, driver, model):
    ctx, rt = context
    store = ExpertStore(model, ctx.host_alloc, ctx.host_pin)
    assert store.arena.tobytes() == ExpertStore(model).arena.tobytes()
    assert rt.pinned_calls == [({"store": store.nbytes}, False, True)]  # in its context
    assert driver.calls == [] and rt.owned == []  # no mapping, nothing registered


def test_host_pin_locks_the_arena_it_is_given_and_names_it(context, driver, caplog):
    """host_alloc hands out one arena per store, each named for what it holds; host_pin
    registers the one whose array it is given, once, and logs its size and seconds."""
    ctx, rt = context
    experts = ctx.host_alloc(3 * HUGE_PAGE)
    dense = ctx.host_alloc(HUGE_PAGE + 7, "the streamed dense layers")
    assert [a.what for a in ctx._arenas] == ["the expert store", "the streamed dense layers"]
    dense[:] = 5
    with caplog.at_level("INFO", logger="strata_rt.backends.cuda.context"):
        ctx.host_pin(dense)
    ((call, ptr, size, flags),) = driver.calls
    assert (call, ptr, size) == ("register", dense.ctypes.data, 2 * HUGE_PAGE)
    assert flags == host_arena.REGISTER_FLAGS and driver.current == [True]
    assert driver.seen is not None and set(driver.seen[: dense.size]) == {5}
    assert "page-locked 4.0 MiB of host memory for the streamed dense layers in" in caplog.text
    assert [a.registered for a in ctx._arenas] == [False, True]
    ctx.host_pin(experts)
    assert [c[1] for c in driver.calls] == [dense.ctypes.data, experts.ctypes.data]
    with pytest.raises(StrataError, match="registered twice"):
        ctx.host_pin(dense)


@pytest.fixture(scope="module")
def whole():
    from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec

    spec = Qwen3Spec(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                     ffn=256, n_experts=8, top_k=2, context=256)
    return Qwen3Model.synthetic(spec, 5, "iq3_xxs")


@pytest.mark.parametrize("context", ["alloc", "register"], indirect=True)
def test_the_dense_host_store_follows_store_memory(context, driver, whole, monkeypatch,
                                                   caplog):
    """The streamed dense layers' store (dense.host_store) of a part's layers 1 and 2:
    "register", an arena the fill writes unregistered and that is registered once after it,
    holding each layer's slot image at the start of its row; "alloc", one page-locked
    allocation in the runtime's context, nothing registered. Either way the copies' source
    rows are those bytes."""
    import strata_rt.backends.cuda.dense.host_store as hs
    from strata_rt.backends.cuda.dense.slots import dense_slot_bytes
    from strata_rt.models.qwen3.whole_memory import DenseLayout, DenseTypes

    ctx, rt = context
    spec = whole.spec
    layout = DenseLayout.of(spec, DenseTypes.of_model(whole))
    part = DenseLayout(layout.slots[1:], layout.head_type)  # layers 1 and 2
    images = [dense_slot_bytes(whole, 1 + i, s).tobytes() for i, s in enumerate(part.slots)]
    calls_at_fill: list[int] = []

    def watched(w, layer, slot):
        calls_at_fill.append(len(driver.calls))
        return dense_slot_bytes(w, layer, slot)

    monkeypatch.setattr(hs, "dense_slot_bytes", watched)
    with caplog.at_level("INFO", logger="strata_rt.backends.cuda.context"):
        store = hs.DenseHostStore(ctx, whole, 1, part)
    n = 2 * part.slot_bytes
    assert store.rows.shape == (2, part.slot_bytes) and store.rows.dtype == np.uint8
    assert [store.layer(i, len(b)).tobytes() for i, b in enumerate(images)] == images
    assert set(store.timings) == {"alloc_s", "fill_s", "pin_s"}
    assert calls_at_fill == [0, 0]  # nothing registered while the images were written
    if ctx.store_memory == "register":
        (arena,) = rt.owned
        assert arena.what == hs.WHAT and arena.registered and arena.nbytes == n
        ((call, ptr, _, flags),) = driver.calls
        assert call == "register" and ptr == store.rows.ctypes.data and driver.current == [True]
        assert driver.seen is not None and driver.seen[:n] == store.rows.tobytes()
        assert f"for {hs.WHAT} in" in caplog.text
    else:
        assert rt.pinned_calls == [({"store": n}, False, True)] and driver.calls == []
        assert rt.owned == [] and f"for {hs.WHAT} (cuMemHostAlloc) in" in caplog.text


def test_store_memory_is_an_engine_switch_resolved_once(monkeypatch):
    from strata_rt.config.settings.engine_config import EngineConfig
    from strata_rt.errors import ConfigError

    model = {"synthetic": {"n_layers": 1, "hidden": 64, "ffn": 64, "n_experts": 4,
                           "top_k": 2}}
    monkeypatch.delenv("STRATA_STORE_MEMORY", raising=False)
    assert EngineConfig(model=model).resolve().store_memory == "alloc"
    monkeypatch.setenv("STRATA_STORE_MEMORY", "register")
    assert EngineConfig(model=model).resolve().store_memory == "register"
    assert EngineConfig(model=model, store_memory="alloc").resolve().store_memory == "alloc"
    with pytest.raises(ConfigError, match="store_memory: got 'pinned'"):
        EngineConfig(model=model, store_memory="pinned").resolve()
    with pytest.raises(StrataError, match="store_memory: got 'x'"):
        CudaContext.__init__(CudaContext.__new__(CudaContext), (0,), "x")
