"""The runtime's CPU-side parts: arena bookkeeping, the nvcc compile cache, and the one clear
error when CUDA is absent."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_rt.errors import BudgetError, CudaUnavailableError, KernelBuildError, StrataError
from strata_rt.runtime import Runtime, cuda_available, plan_regions
from strata_rt.runtime.compile import compile_cubin, nvcc_available, nvcc_path
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


# ---------------------------------------------------------------------------- no CUDA


def _run_without_pycuda(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter where importing pycuda fails."""
    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pycuda' or name.startswith('pycuda.'):\n"
        "            raise ImportError('pycuda blocked for this test')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent.parent)


def test_importing_runtime_does_not_import_pycuda():
    done = _run_without_pycuda(
        "import strata_rt, strata_rt.runtime, strata_rt.runtime.compile\n"
        "assert 'pycuda' not in sys.modules\nprint('ok')\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_runtime_open_without_pycuda_names_reference_backend():
    done = _run_without_pycuda(
        "from strata_rt.runtime import Runtime, cuda_available\n"
        "from strata_rt.errors import CudaUnavailableError\n"
        "ok, why = cuda_available()\n"
        "assert ok is False and 'pycuda' in why, why\n"
        "try:\n"
        "    Runtime.open()\n"
        "except CudaUnavailableError as e:\n"
        "    print(e)\n")
    assert done.returncode == 0, done.stderr
    assert "CUDA is not available" in done.stdout
    assert "reference" in done.stdout and "pycuda" in done.stdout


def test_cuda_available_never_raises():
    ok, why = cuda_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(CudaUnavailableError, match="reference"):
            Runtime.open()


# ---------------------------------------------------------------------------- compile cache

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (set STRATA_NVCC)")

TINY = """
#include "common/{header}"
extern "C" __global__ void scale_add(float* y, const float* x, float a, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]) + OFFSET;
}}
"""


@pytest.fixture
def counting_nvcc(tmp_path, monkeypatch):
    """STRATA_NVCC = a wrapper that logs each invocation, then runs the real nvcc; the cache
    goes to a fresh folder. Returns a function giving the number of compiles so far."""
    real = nvcc_path()
    log = tmp_path / "nvcc.log"
    wrapper = tmp_path / "nvcc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("STRATA_NVCC", str(wrapper))
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))

    def compiles() -> int:
        if not log.exists():
            return 0
        return sum("-cubin" in line for line in log.read_text().splitlines())

    return compiles


@pytest.fixture
def tiny_kernel(tmp_path, monkeypatch):
    """A kernel source that includes a header from kernels/common (a temporary one)."""
    from strata_rt.runtime import compile as compile_mod

    root = tmp_path / "kernels"
    (root / "common").mkdir(parents=True)
    (root / "common" / "tiny.cuh").write_text("#define OFFSET 0.0f\n")
    (root / "tiny").mkdir()
    src = root / "tiny" / "tiny.cu"
    src.write_text(TINY.format(header="tiny.cuh"))
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", root)
    return src


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_real_cubin_for_each_arch(counting_nvcc, tiny_kernel, arch):
    cubin = compile_cubin(tiny_kernel, arch)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF", "a cubin is an ELF file"
    assert b"scale_add" in data
    assert arch in cubin.name
    assert counting_nvcc() == 1


@needs_nvcc
def test_compile_cache_hit_runs_no_nvcc(counting_nvcc, tiny_kernel):
    first = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert counting_nvcc() == 1
    again = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert again == first
    assert counting_nvcc() == 1, "second compile of the same input must come from the cache"
    assert not [p for p in first.parent.iterdir() if p.suffix == ".tmp"], "temp file left"


@needs_nvcc
def test_compile_cache_misses_on_define_arch_flag_and_header_change(counting_nvcc, tiny_kernel):
    base = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    seen = {base}
    for path in (compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 256}),
                 compile_cubin(tiny_kernel, "sm_80", {"BLOCK": 128}),
                 compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128}, ("-lineinfo",))):
        assert path not in seen
        seen.add(path)
    assert counting_nvcc() == 4
    header = tiny_kernel.parent.parent / "common" / "tiny.cuh"
    header.write_text("#define OFFSET 1.0f\n")
    changed = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert changed != base and counting_nvcc() == 5, "an include change must recompile"


@needs_nvcc
def test_compile_error_carries_compiler_message(counting_nvcc, tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }\n')
    with pytest.raises(KernelBuildError) as info:
        compile_cubin(bad, "sm_90", {"N": 3})
    msg = str(info.value)
    assert "broken.cu" in msg and "sm_90" in msg and "-DN=3" in msg
    assert "undeclared_name" in msg, "nvcc's own diagnostic must be in the message"
    assert not list((tmp_path / "cache").glob("*.cubin")), "a failed build must cache nothing"


def test_compile_without_nvcc_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_NVCC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not nvcc_available()
    src = tmp_path / "k.cu"
    src.write_text("")
    with pytest.raises(KernelBuildError, match="nvcc not found.*STRATA_NVCC"):
        compile_cubin(src, "sm_90")


def test_compile_missing_source_and_bad_arch(tmp_path):
    with pytest.raises(KernelBuildError, match="cannot read"):
        compile_cubin(tmp_path / "absent.cu", "sm_90")
    src = tmp_path / "k.cu"
    src.write_text("")
    with pytest.raises(KernelBuildError, match="expected sm_XY"):
        compile_cubin(src, "compute_90")


def test_cache_dir_follows_switch(monkeypatch, tmp_path):
    from strata_rt.runtime.compile import cache_dir

    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("STRATA_KERNEL_CACHE")
    assert cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "strata_rt" / "kernels"


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
                if name != "k":
                    raise drv.LogicError("named symbol not found")
                return Function()

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
    with pytest.raises(StrataError, match="no kernel 'other'"):
        mod.kernel("other", "P")
    with pytest.raises(StrataError, match=r"argument codes \['d'\]"):
        mod.kernel("k", "Pd")
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


@needs_nvcc
def test_check_kernels_reports_each_source_and_arch(counting_nvcc, tmp_path, monkeypatch):
    from strata_rt.runtime import check_kernels
    from strata_rt.runtime import compile as compile_mod

    common = tmp_path / "kernels" / "common"
    common.mkdir(parents=True)
    (common / "good.cu").write_text('extern "C" __global__ void good(int* p) { *p = 1; }\n')
    (common / "bad.cu").write_text('extern "C" __global__ void bad(int* p) { *p = nope; }\n')
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", tmp_path / "kernels")
    results = check_kernels([], ("sm_80", "sm_90"))
    got = {(r.source.name, r.arch): r for r in results}
    assert set(got) == {(n, a) for n in ("good.cu", "bad.cu") for a in ("sm_80", "sm_90")}
    assert all(got[("good.cu", a)].ok for a in ("sm_80", "sm_90"))
    bad = got[("bad.cu", "sm_90")]
    assert not bad.ok and "nope" in bad.message and bad.owner == "common"
