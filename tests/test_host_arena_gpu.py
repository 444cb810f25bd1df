"""The registered expert store on a device: its bytes copy to the device intact, and the
device address hostmap names for it reads the same bytes from the host, by a copy and by a
kernel (what decode gathers do with non-resident experts). Fake-driver twin:
tests/test_host_arena.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.runtime.hostmap import host_device_pointer
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore

pytestmark = pytest.mark.gpu

SPEC = MoESpec(n_layers=3, hidden=512, ffn=256, n_experts=8, top_k=2)

KERNEL = r"""
extern "C" __global__ void copy_bytes(unsigned char* dst, const unsigned char* src,
                                      long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


class _OneContext:
    """CudaContext's two store calls on the session's runtime (the engine's own context
    would open a second one)."""

    def __init__(self, rt):
        from strata_rt.backends.cuda.context import CudaContext

        self.ctx = CudaContext.__new__(CudaContext)
        self.ctx._runtimes, self.ctx.rt, self.ctx._arenas = {0: rt}, rt, []
        self.ctx._pinned, self.ctx.store_memory = [], "register"


def _download(rt, ptr: int, nbytes: int) -> np.ndarray:
    s = rt.stream("host-arena-test")
    out = np.zeros(nbytes, np.uint8)
    rt.memcpy_dtoh(out, ptr, s)
    s.synchronize()
    return out


def test_a_registered_store_reaches_the_device_intact(rt, tmp_path):
    model = Model.synthetic(SPEC, 9, pool_bytes=3 * 100_000)  # a tiled pool
    want = ExpertStore(model).arena
    ctx = _OneContext(rt).ctx
    store = ExpertStore(model, ctx.host_alloc, ctx.host_pin)
    (arena,) = ctx._arenas
    assert arena.registered and store.arena.tobytes() == want.tobytes()
    n = store.nbytes
    s = rt.stream("host-arena-test")
    dev = rt.alloc(n)
    rt.memcpy_htod(dev.ptr, store.arena, s)  # from page-locked memory: asynchronous
    s.synchronize()
    assert _download(rt, dev.ptr, n).tobytes() == want.tobytes()

    # the address the decode kernels read non-resident experts at: first byte, and a blob
    # in the middle of the store
    mapped = host_device_pointer(store.arena)
    o = store.offset(2, 5)
    assert host_device_pointer(store.arena[o:]) == mapped + o
    other = rt.alloc(n)
    rt.memcpy_dtod(other.ptr, mapped, n, s)
    s.synchronize()
    assert _download(rt, other.ptr, n).tobytes() == want.tobytes()
    src = tmp_path / "copy_bytes.cu"
    src.write_text(KERNEL)
    blob = store.view(2, 5)
    k = rt.module(src).kernel("copy_bytes", "PPq")
    k.launch((64, 1, 1), (256, 1, 1), s, (other.ptr, mapped + o, blob.size))
    s.synchronize()
    assert _download(rt, other.ptr, blob.size).tobytes() == blob.tobytes()
    arena.free()  # unregistered, then unmapped
    assert arena.array is None and not arena.registered
    dev.free()
    other.free()
