"""Overlapped launches (strata_rt/runtime/overlap.py): the driver structures as cuda.h lays them
out, the arguments packed in order, every kernel asked for with overlap=True waiting for the
grid before it first, and on the GPU the same bytes overlapped or not, direct and replayed."""

from __future__ import annotations

import ast
import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.gemm.ggml_gemv import kernel_name as gemv_kernel_name
from strata_rt.runtime import overlap

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.gpu


def test_launch_structures_have_the_driver_layout():
    # CUlaunchAttribute: id, pad to 8, a 64-byte value union; CUlaunchConfig: six dims, the
    # shared bytes, then the stream, the attribute list and its length, 8-byte aligned
    assert ctypes.sizeof(overlap._Attribute) == 72
    assert overlap._Attribute.value.offset == 8
    assert ctypes.sizeof(overlap._Config) == 56
    assert overlap._Config.shared.offset == 24
    assert overlap._Config.stream.offset == 32
    assert overlap._Config.attrs.offset == 40
    assert overlap._Config.n_attrs.offset == 48


class _FakeLib:
    """Stands for libcuda: records what cuLaunchKernelEx was given."""

    def __init__(self):
        self.calls = []

    def cuFuncSetAttribute(self, f, attr, value):
        self.calls.append(("attr", attr, value))
        return 0

    def cuLaunchKernelEx(self, cfg, f, params, extra):
        # the argument values are read now, as the driver copies them at the launch: their
        # storage is the launcher's own and gone once it returns
        c = cfg._obj
        a = c.attrs.contents
        read = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float,
                ctypes.c_double, ctypes.c_int64]
        values = [t.from_address(params[i]).value for i, t in enumerate(read)]
        self.calls.append(("launch", tuple(c.grid), tuple(c.block), c.shared, c.stream,
                           a.id, a.value, c.n_attrs, values, extra))
        return 0


def test_arguments_are_packed_in_order_with_their_types():
    lib = _FakeLib()
    fn = overlap.OverlapFunction(lib, ctypes.c_void_p(1), "k")  # type: ignore[arg-type]
    fn.allow_shared(99_000)
    fn.launch((3, 2, 1), (128, 1, 1), 0xABC0, "PiIfdq",
              (0xDEAD_BEEF_0000, -7, 4_000_000_000, 1.5, 0.1, -(2**40)), 4096)
    assert lib.calls[0] == ("attr", 8, 99_000)
    _, grid, block, shared, stream, aid, aval, n, got, extra = lib.calls[1]
    assert (grid, block, shared, stream, aid, aval, n, extra) == (
        (3, 2, 1), (128, 1, 1), 4096, 0xABC0, 6, 1, 1, None)
    assert got == [0xDEAD_BEEF_0000, -7, 4_000_000_000, 1.5, 0.1, -(2**40)]


def _overlap_kernels() -> set[str]:
    """The kernel names (or their f-string prefixes) asked for with overlap=True."""
    names = set()
    for path in (ROOT / "strata_rt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "kernel"):
                continue
            if not any(k.arg == "overlap" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in node.keywords):
                continue
            first = node.args[0]
            if isinstance(first, ast.Call) and getattr(first.func, "id", "") == "kernel_name":
                # ggml_gemv.kernel_name(d, part): the prefix every type and part share
                first = ast.Constant(gemv_kernel_name(SimpleNamespace(name=""), "")[:-1])
            if isinstance(first, ast.JoinedStr):
                first = first.values[0]
            assert isinstance(first, ast.Constant), f"{path}: a kernel name to check"
            names.add(str(first.value))
    return names


#: overlapped kernels that read one operand before they wait, and the pointer arguments they
#: may not touch before it: gemv_f16_rows issues its first weight loads early (no kernel writes the
#: weights; a streamed dense slot's copy is an ordinary dependency, which overlap never relaxes)
EARLY_READS = {"gemv_f16_rows": ("x", "out")}


def test_every_overlapped_kernel_waits_for_the_grid_before_it_first():
    names = _overlap_kernels()
    assert {"router_logits_split_", "topk_exact_w", "route_rerank_w", "route_tile_scan",
            "route_scatter", "ggml_gemv_", "gemv_f16_rows", "dense_rmsnorm_f16",
            "qk_norm_rope_hd", "decode_split_hd", "decode_merge_hd", "combine_residual",
            "logits_argmax"} <= names
    sources = {p: p.read_text() for pattern in ("*.cu", "*.cuh")
               for p in (ROOT / "kernels").rglob(pattern)}
    for name in names:
        found = 0
        for path, text in sources.items():
            for m in re.finditer(r"__global__[^{;]*?\b" + re.escape(name) + r"(\w*##|\w*\s*\()",
                                 text):
                body = text[text.index("{", m.end()) + 1:]
                statements = [s.replace("\\", " ").strip() for s in body.split(";")]
                if name in EARLY_READS:
                    at = next(i for i, s in enumerate(statements) if s.endswith("wait_prior_grid()"))
                    before = statements[:at]
                    late = re.compile(r"(?<![.\w])(" + "|".join(EARLY_READS[name]) + r")\b")
                    early = [s for s in before if late.search(s)]
                    assert not early, f"{path.name}: {name} touches {early} before the wait"
                    found += 1
                    continue
                first = next(s for s in statements if not s.startswith("static_assert"))
                assert first == "wait_prior_grid()", f"{path.name}: {name} starts {first!r}"
                found += 1
        assert found, f"no kernel source defines {name}"


@gpu
def test_gpu_overlapped_routing_gives_the_ordinary_bytes(rt):
    """The exact routing chain launched overlapped and ordinarily, direct and as a replayed
    graph of back-to-back chains (each replay's first launch overlapping the previous one's
    last): the same bytes every time."""
    from strata_rt.backends.cuda.routing.exact import (
        ExactRoutingKernels,
        exact_bound,
        router_norms,
        router_scale,
        split_router,
    )
    from strata_rt.backends.cuda.routing.kernels import (
        RoutingKernels,
        exact_workspace,
        workspace_bytes,
    )

    if not rt.overlap_launches:
        pytest.skip(f"overlapped launches need sm_90 or later (this device: {rt.arch})")
    rng = np.random.default_rng(3)
    T, H, E, K = 2100, 2048, 128, 8
    xn = rng.standard_normal((T, H), dtype=np.float32)
    router = (rng.standard_normal((E, H)) * 2 / np.sqrt(H)).astype(np.float32)
    s = rt.stream("overlap test")
    dx, dr = upload(rt, s, xn), upload(rt, s, split_router(router[None])[0])
    bound = exact_bound(router_norms(router), H)
    sizes = {"logits": T * E * 4, "ids": T * K * 4, "w": T * K * 4, "bounds": (E + 1) * 4,
             "st": T * K * 4, "ro": T * K * 4}

    def chain(ex, rk, ws, out):
        parts = exact_workspace(ws.ptr, T, E)
        ex.logits(s, dx.ptr, dr.ptr, out["logits"].ptr, parts, T, H, E, router_scale(router),
                  ex.tile(T, H))
        ex.topk(s, logits=out["logits"].ptr, xn=dx.ptr, router32=dr.ptr + E * H * 4,
                ws=parts, tokens=T, hidden=H, n_experts=E, top_k=K, bound=bound,
                ids=out["ids"].ptr, weights=out["w"].ptr, masks=ws.ptr)
        rk.sort(s, out["ids"].ptr, T, E, K, ws.ptr, out["bounds"].ptr, out["st"].ptr,
                out["ro"].ptr)

    def run(overlapped: bool, replays: int):
        rt.overlap_launches = overlapped
        try:
            ex, rk = ExactRoutingKernels(rt), RoutingKernels(rt)
        finally:
            rt.overlap_launches = True
        assert all(k.overlapped is not None for k in ex._topk.values()) == overlapped
        ws = poisoned(rt, s, workspace_bytes(T, E, "exact"))
        out = {k: poisoned(rt, s, n) for k, n in sizes.items()}
        rt.memset_d8(exact_workspace(ws.ptr, T, E).n_rerank, 0, 16, s)
        if replays:
            with rt.capture(s) as graph:
                for _ in range(3):
                    chain(ex, rk, ws, out)
            for _ in range(replays):
                graph.launch(s)
            s.synchronize()
            graph.free()
        else:
            chain(ex, rk, ws, out)
        return {k: download(rt, s, b, np.uint8, (sizes[k],)).tobytes() for k, b in out.items()}

    want = run(False, 0)
    for overlapped, replays in ((True, 0), (True, 4), (False, 4)):
        got = run(overlapped, replays)
        for k in want:
            assert got[k] == want[k], f"{k}: overlapped={overlapped} replays={replays}"
