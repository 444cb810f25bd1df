"""The runtime on a real device: streams, events, copies, modules, prepared launches, large
shared memory, graph capture and the device arena. Every test checks bytes, not just that a
call returned."""

from __future__ import annotations

import time

import numpy as np
import pytest

from strata_rt.errors import BudgetError, PlanHazardError, StrataError

pytestmark = pytest.mark.gpu

MIB = 1 << 20

KERNELS = r"""
extern "C" __global__ void scale_add(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]);
}

extern "C" __global__ void affine(float* x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fadd_rn(__fmul_rn(x[i], a), b);
}

extern "C" __global__ void echo_args(int* oi, unsigned* ou, float* of, long long* oq,
                                     int i, unsigned u, float f, long long q) {
    if (threadIdx.x == 0 && blockIdx.x == 0) { *oi = i; *ou = u; *of = f; *oq = q; }
}

extern "C" __global__ void reverse_smem(const float* in, float* out, int n) {
    extern __shared__ float sm[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) sm[i] = in[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = sm[n - 1 - i];
}

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void spin_then_write(int* p, int v, unsigned long long ns) {
    unsigned long long t0 = now_ns();
    while (now_ns() - t0 < ns) { }
    *(volatile int*)p = v;
}

extern "C" __global__ void copy_int(int* dst, const int* src) {
    *dst = *(volatile const int*)src;
}
"""


@pytest.fixture(scope="module")
def mod(rt, tmp_path_factory):
    src = tmp_path_factory.mktemp("kernels") / "runtime_test.cu"
    src.write_text(KERNELS)
    return rt.module(src)


@pytest.fixture
def s(rt):
    return rt.stream("test")


def download(rt, s, ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    host = np.empty(nbytes, dtype=np.uint8)
    rt.memcpy_dtoh(host, ptr, s)
    s.synchronize()
    return host.view(dtype)


def upload(rt, s, host: np.ndarray):
    host = np.ascontiguousarray(host)
    buf = rt.alloc(host.nbytes)
    rt.memcpy_htod(buf.ptr, host, s)
    s.synchronize()
    return buf


def test_device_facts(rt):
    assert rt.arch.startswith("sm_") and int(rt.arch[3:]) >= 80
    assert rt.name
    assert 0 < rt.free_bytes() <= rt.total_bytes()
    assert rt.max_shared_optin > 48 * 1024


def test_streams_are_distinct(rt):
    a, b = rt.stream("a"), rt.stream("b")
    assert a.handle != b.handle and a.handle != 0
    a.synchronize()
    assert a.done()


def test_wait_on_unrecorded_event_is_refused(rt, s):
    ev = rt.event("copied[3]")
    assert not ev.recorded
    with pytest.raises(PlanHazardError, match=r"'copied\[3\]'.*never recorded"):
        s.wait(ev)
    with pytest.raises(PlanHazardError):
        ev.synchronize()
    ev.record(s)
    assert ev.recorded and ev.stream == "test"
    s.wait(ev)
    ev.synchronize()
    assert ev.done()


def test_event_wait_orders_streams(rt, mod):
    """A slow write on one stream is visible to a read on another stream that waited on it."""
    writer, reader = rt.stream("writer"), rt.stream("reader")
    cell, out = rt.alloc(4), rt.alloc(4)
    rt.memset_d8(cell.ptr, 0, 4, writer)
    rt.memset_d8(out.ptr, 0xFF, 4, writer)
    writer.synchronize()
    ev = rt.event("written")
    mod.kernel("spin_then_write", "Piq").launch(
        (1, 1, 1), (1, 1, 1), writer, (cell.ptr, 1234, 50_000_000))
    ev.record(writer)
    reader.wait(ev)
    mod.kernel("copy_int", "PP").launch((1, 1, 1), (1, 1, 1), reader, (out.ptr, cell.ptr))
    got = download(rt, reader, out.ptr, 4, np.int32)
    assert got[0] == 1234, "the reader ran before the writer's event"


def test_event_timing(rt, s, mod):
    start, end = rt.event("start", timing=True), rt.event("end", timing=True)
    cell = rt.alloc(4)
    start.record(s)
    mod.kernel("spin_then_write", "Piq").launch((1, 1, 1), (1, 1, 1), s,
                                               (cell.ptr, 1, 20_000_000))
    end.record(s)
    ms = start.elapsed_ms(end)
    assert 18.0 <= ms < 2000.0, f"a 20 ms spin measured {ms:.3f} ms"
    plain = rt.event("plain")
    plain.record(s)
    with pytest.raises(StrataError, match="without timing"):
        start.elapsed_ms(plain)


def test_pinned_copies_both_ways(rt, s, rng):
    n = 3 * MIB + 77
    pa = rt.pinned({"src": n, "dst": n, "small": 64})
    assert pa.host_ptr("src") % 256 == 0 and pa.host_ptr("dst") % 256 == 0
    src, dst = pa.view("src"), pa.view("dst")
    src[:] = rng.integers(0, 256, n, dtype=np.uint8)
    dst[:] = 0xAB
    buf = rt.alloc(n)
    rt.memcpy_htod(buf.ptr, src, s)
    rt.memcpy_dtoh(dst, buf.ptr, s)
    s.synchronize()
    assert np.array_equal(dst, src)
    assert "src" in pa.report() and "small" in pa.report()
    floats = pa.view("small", np.float32, (4, 4))
    assert floats.shape == (4, 4) and floats.base is not None
    buf.free()
    pa.free()


def test_device_to_device_copy_and_memset(rt, s, rng):
    n = 1 * MIB
    data = rng.integers(0, 256, n, dtype=np.uint8)
    a = upload(rt, s, data)
    b = rt.alloc(n)
    rt.memset_d8(b.ptr, 0x5A, n, s)
    rt.memcpy_dtod(b.ptr + 1000, a.ptr + 17, 4096, s)
    got = download(rt, s, b.ptr, n)
    want = np.full(n, 0x5A, dtype=np.uint8)
    want[1000:1000 + 4096] = data[17:17 + 4096]
    assert np.array_equal(got, want)


def test_module_compile_and_launch(rt, s, mod, rng):
    n = 10_000
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    dx, dy = upload(rt, s, x), upload(rt, s, y)
    k = mod.kernel("scale_add", "PPfi")
    k.launch(((n + 255) // 256, 1, 1), (256, 1, 1), s, (dy.ptr, dx.ptr, np.float32(0.75), n))
    rt.check()
    got = download(rt, s, dy.ptr, 4 * n, np.float32)
    want = np.float32(0.75) * x + y
    assert np.array_equal(got, want), "separately rounded mul/add must match numpy float32"
    assert mod.kernel("scale_add", "PPfi") is k, "prepared kernels are reused"
    assert rt.module(mod.source) is mod, "a module loads once per runtime"


def test_prepared_launch_packs_every_argument_type(rt, s, mod):
    out = rt.alloc(32)
    rt.memset_d8(out.ptr, 0xFF, 32, s)
    k = mod.kernel("echo_args", "PPPPiIfq")
    k.launch((1, 1, 1), (32, 1, 1), s,
             (out.ptr, out.ptr + 4, out.ptr + 8, out.ptr + 16, -7, 0xFFFFFFF0, 2.5, -(1 << 40)))
    raw = download(rt, s, out.ptr, 32)
    assert raw[0:4].view(np.int32)[0] == -7
    assert raw[4:8].view(np.uint32)[0] == 0xFFFFFFF0
    assert raw[8:12].view(np.float32)[0] == 2.5
    assert raw[16:24].view(np.int64)[0] == -(1 << 40)


def test_unknown_kernel_and_bad_arg_codes(mod):
    with pytest.raises(StrataError, match="no kernel 'nope'"):
        mod.kernel("nope", "P")
    with pytest.raises(StrataError, match="argument codes"):
        mod.kernel("copy_int", "PX")


def test_large_dynamic_shared_memory(rt, s, mod, rng):
    shared = min(rt.max_shared_optin, 160 * 1024)
    assert shared > 48 * 1024
    n = shared // 4
    x = rng.standard_normal(n, dtype=np.float32)
    dx, dy = upload(rt, s, x), rt.alloc(4 * n)
    k = mod.kernel("reverse_smem", "PPi")
    k.launch((1, 1, 1), (256, 1, 1), s, (dx.ptr, dy.ptr, n), shared=shared)
    rt.check()
    assert np.array_equal(download(rt, s, dy.ptr, 4 * n, np.float32), x[::-1])
    with pytest.raises(StrataError, match="dynamic shared memory"):
        k.launch((1, 1, 1), (256, 1, 1), s, (dx.ptr, dy.ptr, n), shared=rt.max_shared_optin + 4)


def test_graph_capture_and_replay(rt, s, mod, rng):
    n = 4096
    x = rng.integers(-50, 50, n).astype(np.float32)
    dx = upload(rt, s, x)
    k = mod.kernel("affine", "Pffi")
    grid = ((n + 255) // 256, 1, 1)
    with rt.capture(s) as graph:
        k.launch(grid, (256, 1, 1), s, (dx.ptr, 1.0, 1.0, n))
        k.launch(grid, (256, 1, 1), s, (dx.ptr, 2.0, 0.0, n))
        k.launch(grid, (256, 1, 1), s, (dx.ptr, 1.0, -3.0, n))
    assert np.array_equal(download(rt, s, dx.ptr, 4 * n, np.float32), x), \
        "captured work must not run during capture"
    graph.upload(s)
    assert np.array_equal(download(rt, s, dx.ptr, 4 * n, np.float32), x), \
        "an upload must not run the work"
    graph.launch(s)
    graph.launch(s)
    want = x
    for _ in range(2):
        want = (want + 1) * 2 - 3
    assert np.array_equal(download(rt, s, dx.ptr, 4 * n, np.float32), want)


def test_graph_capture_with_event_fork(rt, s, mod, rng):
    """The engine's shape: a second stream forked and joined with events inside a capture."""
    side = rt.stream("side")
    n = 1024
    x = rng.integers(-50, 50, n).astype(np.float32)
    y = rng.integers(-50, 50, n).astype(np.float32)
    dx, dy = upload(rt, s, x), upload(rt, s, y)
    k = mod.kernel("affine", "Pffi")
    fork, join = rt.event("fork"), rt.event("join")
    with rt.capture(s) as graph:
        fork.record(s)
        side.wait(fork)
        k.launch((n // 256, 1, 1), (256, 1, 1), side, (dy.ptr, 3.0, 0.0, n))
        k.launch((n // 256, 1, 1), (256, 1, 1), s, (dx.ptr, 1.0, 5.0, n))
        join.record(side)
        s.wait(join)
    graph.launch(s)
    s.synchronize()
    assert np.array_equal(download(rt, s, dx.ptr, 4 * n, np.float32), x + 5)
    assert np.array_equal(download(rt, s, dy.ptr, 4 * n, np.float32), y * 3)


def test_failed_capture_leaves_stream_usable(rt, s, mod):
    with pytest.raises(RuntimeError, match="inside capture"), rt.capture(s):
        raise RuntimeError("inside capture")
    cell = rt.alloc(4)
    mod.kernel("spin_then_write", "Piq").launch((1, 1, 1), (1, 1, 1), s, (cell.ptr, 77, 0))
    assert download(rt, s, cell.ptr, 4, np.int32)[0] == 77


def test_device_arena_regions_aligned_and_disjoint(rt, s):
    sizes = {"ring": 5 * MIB + 3, "gu_buf": 1000, "empty": 0, "down_buf": 77_777, "bounds": 4}
    da = rt.device_arena(sizes, budget=64 * MIB)
    for name, size in sizes.items():
        assert da.ptr(name) % 256 == 0, name
        assert da.nbytes(name) == size
    for i, name in enumerate(sizes):
        rt.memset_d8(da.ptr(name), i + 1, sizes[name], s)
    whole = download(rt, s, da.base_ptr, da.total)
    for i, name in enumerate(sizes):
        off = da.offset(name)
        assert np.all(whole[off: off + sizes[name]] == i + 1), f"region {name} was overwritten"
    report = da.report()
    assert all(name in report for name in sizes) and "total" in report
    da.free()


def test_device_arena_budget_and_allocation_errors(rt):
    with pytest.raises(BudgetError, match=r"needs 2\.0 MiB, budget 1\.0 MiB"):
        rt.device_arena({"x": 2 * MIB}, budget=1 * MIB)
    with pytest.raises(BudgetError, match=r"needs .* MiB, free .* MiB"):
        rt.alloc(4 * rt.total_bytes())


@pytest.mark.parametrize("captured", [False, True], ids=["plain", "graph"])
def test_host_gate_holds_a_stream_until_opened(rt, s, mod, rng, captured):
    """The input gate's protocol: work behind the gate waits (plain or replayed from a graph)
    until the host opens it, reads what the host wrote before opening, and the stream closes
    the gate behind it, so the next pass waits again."""
    pinned = rt.pinned({"data": 4096 * 4, "gate": 4})
    data, gate = pinned.view("data", np.float32), rt.gate(pinned.view("gate", np.uint32))
    dev = rt.alloc(data.nbytes)
    k = mod.kernel("affine", "Pffi")

    def enqueue():
        gate.enqueue(s)
        rt.memcpy_htod(dev.ptr, data, s)
        k.launch((16, 1, 1), (256, 1, 1), s, (dev.ptr, 2.0, 1.0, 4096))

    graph = None
    if captured:
        with rt.capture(s) as graph:
            enqueue()
    for _ in range(2):
        data[:] = np.nan  # poisoned until the host pass
        graph.launch(s) if graph is not None else enqueue()
        time.sleep(0.05)
        assert not s.done() and not gate.is_open
        x = rng.integers(-50, 50, 4096).astype(np.float32)
        data[:] = x
        gate.open()
        s.synchronize()
        assert not gate.is_open, "the stream closes the gate behind it"
        assert np.array_equal(download(rt, s, dev.ptr, data.nbytes, np.float32), x * 2 + 1)


def test_host_gate_refuses_a_word_of_another_shape(rt):
    pinned = rt.pinned({"two": 8})
    with pytest.raises(StrataError, match="one uint32 word"):
        rt.gate(pinned.view("two", np.uint32))
