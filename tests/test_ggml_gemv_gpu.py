"""The decode step's matrix-vector kernels on the GPU (strata_rt/gemm/ggml_gemv.py; kernels/ggml/
gemv.cuh via gemv.cu, and the example plugin's tq2_0.cu): for several GGML types, a layer whose
down type differs from its gate/up type, and row lengths that end in a partial stage or rows
that start off 16 bytes, on fresh random blocks, outputs poisoned with NaN first, experts read
both from device memory (resident slots) and from pinned host memory through its device
address, every routed pair's SwiGLU row is within one fp16 ulp + 1e-5 * rms of a numpy
reference built from the gguf package's dequantization (fp16 weights, fp16 activations, float64
sums), and its down row within NMSE 1e-6 of the float64 product of the kernel's own SwiGLU row;
nothing outside the outputs is written; an expert without an address gives NaN rows.

Run: python -m pytest -q -m gpu tests/test_ggml_gemv_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from _device_buffers import download, poisoned, upload
from _ggml_blocks import moderate_blocks

from strata_rt.formats.numerics import nmse
from strata_rt.gemm.ggml_decoders import DecoderSpec
from strata_rt.gemm.ggml_gather import images_reference
from strata_rt.gemm.ggml_gemv import GgmlGemv
from strata_rt.runtime.hostmap import host_device_pointer

pytestmark = pytest.mark.gpu
PLUGIN_SOURCE = (Path(__file__).resolve().parent / "plugins" / "strata_testfmt"
                 / "strata_testfmt" / "kernels" / "tq2_0.cu")
TQ2 = DecoderSpec("TQ2_0", 256, 66)
#: the SwiGLU rows' bound: one fp16 ulp of the reference plus this share of the rows' rms
SWIGLU_RMS = 1e-5
#: the down rows' bound against float64 products of the kernel's SwiGLU rows
DOWN_NMSE = 1e-6
#: blobs sit this far apart (the engine's slot alignment), so parts start where they would
SLOT_ALIGN = 256
N_EXPERTS, TOP_K, TOKENS = 12, 4, 2

#: name: (gate/up type, down type, hidden, ffn)
CASES = {
    "F16": ("F16", "F16", 512, 256),
    "Q8_0": ("Q8_0", "Q8_0", 512, 256),
    "Q8_0 partial stage": ("Q8_0", "Q8_0", 288, 160),
    "Q4_K": ("Q4_K", "Q4_K", 1024, 512),
    "Q6_K": ("Q6_K", "Q6_K", 512, 256),
    "IQ3_XXS": ("IQ3_XXS", "IQ3_XXS", 512, 256),
    "Q3_K rows off 16 bytes": ("Q3_K", "Q3_K", 256, 256),
    "F32 several loads per lane": ("F32", "F32", 384, 136),
    "MXFP4": ("MXFP4", "MXFP4", 512, 256),
    "Q4_K gate/up, Q6_K down": ("Q4_K", "Q6_K", 512, 256),
    "IQ3_XXS gate/up, Q8_0 down": ("IQ3_XXS", "Q8_0", 512, 256),
    "TQ2_0 (plugin)": ("TQ2_0", "TQ2_0", 512, 256),
}


@pytest.fixture(scope="module")
def launchers(rt) -> dict[str, GgmlGemv]:
    return {"builtin": GgmlGemv(rt), "plugin": GgmlGemv(rt, source=PLUGIN_SOURCE,
                                                         decoders=[TQ2])}


def _spec(name: str) -> DecoderSpec:
    if name == TQ2.name:
        return TQ2
    from strata_rt.formats.ggml_types import ggml_type

    return DecoderSpec.of(ggml_type(name))


def _values(d: DecoderSpec, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The weights the kernels multiply: fp16 of the gguf package's values, as float64."""
    if d.name == TQ2.name:
        vals = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.TQ2_0)
        f16 = np.asarray(vals, np.float32).reshape(rows, cols).astype(np.float16)
    else:
        f16 = images_reference(d.name, raw, rows, cols)
    return f16.astype(np.float64)


def _routing(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """ids [pairs] (top_k distinct experts per token) and row_of [pairs]: the rows sorted by
    expert, tokens ascending inside (engine.cu's counting sort)."""
    ids = np.concatenate([rng.choice(N_EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)])
    order = np.argsort(ids, kind="stable")
    row_of = np.empty_like(order)
    row_of[order] = np.arange(ids.size)
    return ids.astype(np.int32), row_of.astype(np.int32)


def _swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    g32, u32 = g.astype(np.float32), u.astype(np.float32)
    return (g32 / (np.float32(1) + np.exp(-g32)) * u32).astype(np.float16)


def run_case(rt, rng, launchers, case: str, host_share: float, drop_first: bool = False):
    """One layer's launches over TOKENS * TOP_K routed pairs; returns what the test checks:
    (the SwiGLU rows fp16 [rows, ffn], the down rows float32 [rows, hidden], their
    references, the expert of each row, the first pair's expert). drop_first: that expert
    gets no address in the table."""
    gt, dt, H, F = CASES[case]
    d_gu, d_dn = _spec(gt), _spec(dt)
    g = launchers["plugin" if gt == TQ2.name else "builtin"]
    gu_bytes, dn_bytes = 2 * F * d_gu.row_bytes(H), H * d_dn.row_bytes(F)
    blobs = [np.concatenate([moderate_blocks(rng, d_gu, 2 * F * H // d_gu.block_values)
                             .reshape(-1), moderate_blocks(rng, d_dn, H * F // d_dn.block_values)
                             .reshape(-1)]) for _ in range(N_EXPERTS)]
    slot = -(-(gu_bytes + dn_bytes) // SLOT_ALIGN) * SLOT_ALIGN
    arena = np.zeros((N_EXPERTS, slot), np.uint8)
    for e, b in enumerate(blobs):
        arena[e, : b.size] = b
    on_host = rng.random(N_EXPERTS) < host_share
    ids, row_of = _routing(rng)
    rows = ids.size
    w_gu = {e: _values(d_gu, blobs[e][:gu_bytes], 2 * F, H) for e in set(ids.tolist())}
    w_dn = {e: _values(d_dn, blobs[e][gu_bytes:], H, F) for e in set(ids.tolist())}
    # inputs scaled so that gate and up come out about 1: SwiGLU stays inside fp16's range
    scale = 1.0 / (np.sqrt(H) * max(float(np.sqrt(np.mean(w ** 2))) for w in w_gu.values()))
    x = (rng.standard_normal((rows, H)) * scale).astype(np.float16)

    s = rt.stream("gemv test")
    pinned = rt.pinned({"store": arena.nbytes})
    store = pinned.view("store")
    store[:] = arena.reshape(-1)
    dev = upload(rt, s, arena)
    host_base = host_device_pointer(store)
    table = np.array([(host_base if on_host[e] else dev.ptr) + e * slot
                      for e in range(N_EXPERTS)], np.uint64)
    if drop_first:
        table[ids[0]] = 0
    bufs = [dev, *(upload(rt, s, a) for a in (table, ids, row_of, x))]
    d_table, d_ids, d_rows, d_x = (b.ptr for b in bufs[1:])
    mid = poisoned(rt, s, rows * F * 2)
    out = poisoned(rt, s, rows * H * 4)
    bufs += [mid, out]
    try:
        # as the engine launches them: the _host kernels where any expert lies in host memory
        host_reads = bool(on_host.any())
        g.launch(s, "gate_up", d_gu, d_table, 0, d_ids, d_rows, d_x, mid.ptr, rows, H, F,
                 host_reads)
        g.launch(s, "down", d_dn, d_table, gu_bytes, d_ids, d_rows, mid.ptr, out.ptr, rows, H,
                 F, host_reads)
        got_mid = download(rt, s, mid, np.float16, (rows, F))
        got_out = download(rt, s, out, np.float32, (rows, H))
    finally:
        for b in bufs:
            b.free()
        pinned.free()
    want_mid = np.empty_like(got_mid)
    want_out = np.empty_like(got_out, dtype=np.float64)
    expert_of_row = np.empty(rows, np.int64)
    for p in range(rows):
        e, r = int(ids[p]), int(row_of[p])
        expert_of_row[r] = e
        gu = w_gu[e] @ x[r].astype(np.float64)
        want_mid[r] = _swiglu(gu[:F], gu[F:])
        with np.errstate(invalid="ignore"):  # an expert without an address: NaN rows
            want_out[r] = w_dn[e] @ got_mid[r].astype(np.float64)
    return got_mid, got_out, want_mid, want_out, expert_of_row, int(ids[0])


def check_swiglu(case: str, got: np.ndarray, want: np.ndarray) -> None:
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(g).all(), f"{case}: SwiGLU rows left unwritten (NaN) or not finite"
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    bound = np.spacing(np.abs(want)).astype(np.float32) + SWIGLU_RMS * rms
    err = np.abs(g - w)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"{case}: {len(bad)} SwiGLU value(s) beyond 1 ulp + "
                           f"{SWIGLU_RMS:g} rms, first at (row, col) {tuple(bad[0])}: "
                           f"{g[tuple(bad[0])]} vs {w[tuple(bad[0])]}")


@pytest.mark.parametrize("host_share", [0.0, 0.5, 1.0], ids=["resident", "mixed", "host"])
@pytest.mark.parametrize("case", list(CASES))
def test_gemv_matches_the_gguf_reference(rt, rng, launchers, case, host_share) -> None:
    got_mid, got_out, want_mid, want_out, _, _ = run_case(rt, rng, launchers, case, host_share)
    check_swiglu(case, got_mid, want_mid)
    assert np.isfinite(got_out).all(), f"{case}: down rows left unwritten or not finite"
    err = nmse(got_out, want_out)
    print(f"{case} ({host_share:.0%} on the host): down NMSE {err:.3g}")
    assert err <= DOWN_NMSE


def test_an_expert_without_an_address_gives_nan_rows(rt, rng, launchers) -> None:
    """A table that misses a routed expert shows: its rows are NaN, the others still right."""
    got_mid, got_out, want_mid, want_out, experts, first = run_case(
        rt, rng, launchers, "Q4_K", 0.5, drop_first=True)
    dropped = experts == first
    assert dropped.any() and np.isnan(got_mid[dropped].astype(np.float32)).all()
    assert np.isnan(got_out[dropped]).all()
    check_swiglu("Q4_K kept rows", got_mid[~dropped], want_mid[~dropped])
    assert nmse(got_out[~dropped], want_out[~dropped]) <= DOWN_NMSE
