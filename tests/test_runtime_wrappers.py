"""The runtime's memory and wrapper logic on the CPU: region planning for arenas, and the
Runtime's refusals, carving, shared-memory opt-ins and ownership run against a stand-in for
pycuda.driver that records each call (the GPU tests run the same paths on a device)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.errors import BudgetError, CudaUnavailableError, StrataError
from strata_rt.runtime import Runtime, plan_regions
from strata_rt.runtime.compile import nvcc_available
from strata_rt.runtime.memory import regions_total

MIB = 1 << 20

# ---------------------------------------------------------------------------- arenas


def test_plan_regions_aligns_every_region_and_keeps_order():
    sizes = {"a": 1, "b": 300, "c": 0, "d": 513, "e": 256}
    regions = plan_regions(sizes, align=256)
    assert list(regions) == list(sizes)
    end = 0
    for name, (off, size) in regions.items():
        assert off % 256 == 0, name
        assert off >= end, f"{name} overlaps the region before it"
        assert size == sizes[name]
        end = off + size
    assert regions == {"a": (0, 1), "b": (256, 300), "c": (768, 0), "d": (768, 513),
                       "e": (1536, 256)}
    assert regions_total(regions) == 1792


def test_plan_regions_other_alignment():
    regions = plan_regions({"x": 3, "y": 5}, align=16)
    assert regions == {"x": (0, 3), "y": (16, 5)}


def test_plan_regions_budget_error_names_need_and_budget():
    sizes = {"ring": 6 * MIB, "gu_buf": 3 * MIB + 1}
    with pytest.raises(BudgetError) as info:
        plan_regions(sizes, budget=9 * MIB)
    msg = str(info.value)
    assert "needs 9.0 MiB, budget 9.0 MiB" in msg  # 9 MiB + 1 byte, aligned
    assert "ring 6.0 MiB" in msg and "gu_buf" in msg
    # exactly at the budget fits
    assert regions_total(plan_regions(sizes, budget=9 * MIB + 256)) == 9 * MIB + 256


@pytest.mark.parametrize("bad", [-1, 1.5, "12", True])
def test_plan_regions_rejects_bad_sizes(bad):
    with pytest.raises(StrataError, match="region 'x' has size"):
        plan_regions({"x": bad})


def test_plan_regions_rejects_non_power_of_two_alignment():
    with pytest.raises(StrataError, match="not a power of two"):
        plan_regions({"x": 1}, align=100)


# ---------------------------------------------------------------------------- wrapper logic
# The Runtime's own logic (refusals, carving, opt-ins, ownership) runs here against a stand-in
# for pycuda.driver that records calls; the GPU tests run the same paths on a device.


class _FakeDriver:
    """Just enough of pycuda.driver's surface for the wrappers, recording what they ask."""

    class Error(Exception):
        pass

    class MemoryError(Error):
        pass

    class LogicError(Error):
        pass

    class device_attribute:  # noqa: N801 (mirrors pycuda's names)
        MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = "optin"

    class function_attribute:  # noqa: N801
        MAX_DYNAMIC_SHARED_SIZE_BYTES = "max_dyn_smem"
        SHARED_SIZE_BYTES = "static_smem"

    class event_flags:  # noqa: N801
        DISABLE_TIMING = 2

    def __init__(self, pin_limit: int = 1 << 30, device_limit: int = 1 << 30):
        self.calls: list[tuple] = []
        self.pin_limit, self.device_limit = pin_limit, device_limit
        self.next_ptr = 0x7000_0000
        drv = self

        class Context:
            def synchronize(self):
                drv.calls.append(("ctx.synchronize",))

            def pop(self):
                drv.calls.append(("ctx.pop",))

            def detach(self):
                drv.calls.append(("ctx.detach",))

        class Device:
            @staticmethod
            def count():
                return 1

            def __init__(self, index):
                self.index = index

            def compute_capability(self):
                return (9, 0)

            def name(self):
                return "Fake H200"

            def get_attribute(self, attr):
                return 232448

            def make_context(self):
                drv.calls.append(("make_context", self.index))
                return Context()

        class Stream:
            _next = 0x100

            def __init__(self):
                Stream._next += 0x10
                self.handle = Stream._next

            def wait_for_event(self, ev):
                drv.calls.append(("wait", self.handle, ev))

            def synchronize(self):
                pass

            def is_done(self):
                return True

        class Event:
            def __init__(self, flags=0):
                self.flags = flags

            def record(self, stream):
                drv.calls.append(("record", self, stream.handle))

            def synchronize(self):
                pass

            def query(self):
                return True

            def time_till(self, other):
                return 1.5

        class Allocation:
            def __init__(self, nbytes):
                self.ptr = drv.next_ptr
                drv.next_ptr += (nbytes + 0xFFFF) & ~0xFFFF

            def __int__(self):
                return self.ptr

            def free(self):
                drv.calls.append(("free", self.ptr))

        class HostAllocation(bytearray):
            def free(self):
                drv.calls.append(("host_free", len(self)))

        class Function:
            def __init__(self, static=0):
                self.static = static

            def get_attribute(self, attr):
                assert attr == "static_smem"
                return self.static

            def prepare(self, arg_types):
                self.arg_types = arg_types
                return self

            def set_attribute(self, attr, value):
                drv.calls.append(("set_attribute", attr, value))

            def prepared_async_call(self, grid, block, stream, *args, shared_size=0):
                drv.calls.append(("launch", grid, block, args, shared_size))

        class Module:
            def __init__(self, data):
                self.data = data

            def get_function(self, name):
                if name not in ("k", "s"):
                    raise drv.LogicError("named symbol not found")
                return Function(1024 if name == "s" else 0)  # s: 1 KiB of static memory

        self.Device, self.Stream, self.Event = Device, Stream, Event
        self._Allocation, self._HostAllocation, self._Module = Allocation, HostAllocation, Module

    def init(self):
        pass

    def mem_get_info(self):
        return (self.device_limit, 2 * self.device_limit)

    def mem_alloc(self, nbytes):
        if nbytes > self.device_limit:
            raise self.MemoryError("cuMemAlloc failed: out of memory")
        return self._Allocation(nbytes)

    def pagelocked_empty(self, n, dtype):
        if n > self.pin_limit:
            raise self.MemoryError("cuMemHostAlloc failed: out of memory")
        return np.ndarray((n,), dtype, buffer=self._HostAllocation(n))  # base = allocation

    def module_from_buffer(self, data):
        return self._Module(data)

    def memcpy_htod_async(self, dst, src, stream):
        self.calls.append(("htod", dst, src.nbytes, stream.handle))


@pytest.fixture
def fake(monkeypatch):
    from strata_rt.runtime import device as device_mod

    drv = _FakeDriver(pin_limit=64 * MIB, device_limit=256 * MIB)
    monkeypatch.setattr(device_mod, "_load_driver", lambda: (drv, ""))
    return drv


def test_fake_open_owns_context_and_frees_on_close(fake):
    rt = Runtime.open()
    assert (rt.arch, rt.name, rt.max_shared_optin) == ("sm_90", "Fake H200", 232448)
    buf = rt.alloc(1000)
    arena = rt.device_arena({"a": 10, "b": 20})
    rt.close()
    names = [c[0] for c in fake.calls]
    assert names[0] == "make_context"
    assert ("free", buf.ptr) in fake.calls and ("free", arena.base_ptr) in fake.calls
    assert names[-2:] == ["ctx.pop", "ctx.detach"], "context must be popped then detached"
    rt.close()  # a second close is harmless
    assert [c[0] for c in fake.calls].count("ctx.detach") == 1


def test_fake_missing_device(fake):
    with pytest.raises(CudaUnavailableError, match="device 3 asked for, 1 CUDA device"):
        Runtime.open(device=3)


def test_fake_unrecorded_wait_is_refused(fake):
    from strata_rt.errors import PlanHazardError

    rt = Runtime.open()
    s, ev = rt.stream("compute"), rt.event("used[2]")
    with pytest.raises(PlanHazardError, match=r"stream 'compute'.*'used\[2\]'.*never recorded"):
        s.wait(ev)
    assert not any(c[0] == "wait" for c in fake.calls), "nothing may reach the driver"
    with pytest.raises(PlanHazardError):
        ev.synchronize()
    ev.record(s)
    s.wait(ev)
    assert ev.recorded and ev.stream == "compute"
    assert ("wait", s.handle, ev.raw) in fake.calls
    assert ev.raw.flags == _FakeDriver.event_flags.DISABLE_TIMING
    with pytest.raises(StrataError, match="without timing"):
        ev.elapsed_ms(ev)
    t0, t1 = rt.event("t0", timing=True), rt.event("t1", timing=True)
    t0.record(s)
    t1.record(s)
    assert t0.elapsed_ms(t1) == 1.5
    rt.close()


def test_fake_pinned_arena_views_and_pin_failure(fake):
    rt = Runtime.open()
    pa = rt.pinned({"experts": 1001, "scales": 64})
    assert pa.offset("scales") == 1024 and pa.total == 1280
    v = pa.view("scales", np.float32, (4, 4))
    v[:] = 3.0
    assert pa.view("scales", np.float32)[0] == 3.0, "views share the one allocation"
    assert pa.host_ptr("scales") - pa.host_ptr("experts") == 1024
    with pytest.raises(StrataError, match="not a whole number of float64"):
        pa.view("experts", np.float64)
    with pytest.raises(StrataError, match="no region 'nope'; regions: experts, scales"):
        pa.view("nope")
    with pytest.raises(BudgetError, match=r"could not pin 100\.0 MiB .*for big"):
        rt.pinned({"big": 100 * MIB})
    rt.close()
    assert ("host_free", 1280) in fake.calls


def test_fake_device_arena_and_budget(fake):
    rt = Runtime.open()
    da = rt.device_arena({"ring": 3000, "bounds": 36})
    assert da.ptr("bounds") == da.base_ptr + 3072 and da.nbytes("bounds") == 36
    report = da.report()
    assert "ring" in report and "3,000" in report and "total" in report
    with pytest.raises(BudgetError, match=r"needs 2\.0 MiB, budget 1\.0 MiB"):
        rt.device_arena({"x": 2 * MIB}, budget=MIB)
    with pytest.raises(BudgetError, match=r"needs 512\.0 MiB, free 256\.0 MiB"):
        rt.alloc(512 * MIB)
    rt.close()


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found")
def test_fake_module_kernel_launch_and_shared_opt_in(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }\n')
    rt = Runtime.open()
    mod = rt.module(src)
    assert mod.raw.data[:4] == b"\x7fELF", "the cubin's bytes are what gets loaded"
    assert rt.module(src) is mod
    k = mod.kernel("k", "P")
    s = rt.stream("s")
    k.launch((2, 1, 1), (32,), s, (0x1000,))
    k.launch((2, 1, 1), (32, 1, 1), s, (0x1000,), shared=100 * 1024)
    k.launch((2, 1, 1), (32, 1, 1), s, (0x1000,), shared=64 * 1024)
    launches = [c for c in fake.calls if c[0] == "launch"]
    opt_ins = [c for c in fake.calls if c[0] == "set_attribute"]
    assert launches[0][2] == (32, 1, 1), "block is padded to three dimensions"
    assert [c[4] for c in launches] == [0, 100 * 1024, 64 * 1024]
    assert opt_ins == [("set_attribute", "max_dyn_smem", 100 * 1024)], "opt in once, when needed"
    with pytest.raises(StrataError, match="device allows at most 232448"):
        k.launch((1, 1, 1), (32, 1, 1), s, (0,), shared=232448 + 1)
    # static shared memory counts into both limits: 48 KiB dynamic beside 1 KiB static opts in
    ks = mod.kernel("s", "P")
    ks.launch((1, 1, 1), (32, 1, 1), s, (0,), shared=47 * 1024)
    ks.launch((1, 1, 1), (32, 1, 1), s, (0,), shared=48 * 1024)
    assert [c for c in fake.calls if c[0] == "set_attribute"][1:] == [
        ("set_attribute", "max_dyn_smem", 48 * 1024)]
    with pytest.raises(StrataError, match="1024 static, the device allows at most 231424"):
        ks.launch((1, 1, 1), (32, 1, 1), s, (0,), shared=232448)
    with pytest.raises(StrataError, match="no kernel 'other'"):
        mod.kernel("other", "P")
    with pytest.raises(StrataError, match=r"argument codes \['X'\]"):
        mod.kernel("k", "PX")
    rt.close()


def test_fake_memcpy_requires_contiguous_host(fake):
    rt = Runtime.open()
    s = rt.stream("copy")
    host = np.zeros((4, 4), np.float32)
    rt.memcpy_htod(0x2000, host, s)
    assert fake.calls[-1] == ("htod", 0x2000, 64, s.handle)
    with pytest.raises(StrataError, match="C-contiguous"):
        rt.memcpy_htod(0x2000, host[:, ::2], s)
    rt.close()
