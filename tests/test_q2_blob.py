"""Q2 blob plugin: codec, blob layout, quantizer, the MMQ reference's order. The checks every
format gets (reference against float64 on the shared row cases, launch ABI, gathers and MMQ on
the GPU bit for bit) run in test_conformance.py."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from _format_harness import make_case

from strata_rt.errors import FormatError, PluginError
from strata_rt.formats.activations import Q8_1
from strata_rt.formats.contract import FormatKernels, first_misaligned
from strata_rt.formats.launchers import check_aligned
from strata_rt.formats.numerics import nmse
from strata_rt.formats.registry import QuantRegistry
from strata_rt.quants import q2_blob
from strata_rt.quants.q2_blob import Planes, Q2Blob, Q2Kernels

FMT = Q2Blob("int8")  # the exact MMQ: planar images, q8_1 activations


def exact_weights(rng, rows, cols):
    """Weights every group of which is exactly levels * an fp16 scale, with both extreme
    levels present, so the quantizer must reproduce them bit for bit."""
    levels = rng.integers(-1, 3, (rows, cols // 64, 64)).astype(np.float32)
    levels[:, :, 0], levels[:, :, 1] = -1, 2
    scales = (rng.uniform(0.01, 2.0, (rows, cols // 64, 1))
              * rng.choice([-1, 1], (rows, cols // 64, 1))).astype(np.float16)
    return (levels * scales.astype(np.float32)).reshape(rows, cols)


# ------------------------------------------------------------------------------ codec
def test_roundtrip_gaussian_nmse(rng):
    w = rng.standard_normal((256, 1024), dtype=np.float32)
    got = FMT.dequantize(FMT.quantize(w), w.shape)
    err = nmse(got, w)
    print(f"q2_blob round trip NMSE on Gaussian weights: {err:.5f}")
    # a uniform 4-level quantizer of a Gaussian cannot beat ~0.117; ours sits near 0.123
    assert 0.10 < err <= FMT.roundtrip_nmse
    assert err < 0.13


def test_representable_groups_roundtrip_exactly(rng):
    w = exact_weights(rng, 32, 256)
    raw = FMT.quantize(w)
    assert raw.shape == (32, FMT.row_bytes(256))
    assert np.array_equal(FMT.dequantize(raw, w.shape), w)


def test_scale_rule_beats_a_dense_search(rng):
    """Per group, the stored (scale, codes) err no more than the best of 4,001 scales of either
    sign with nearest codes by more than fp16 rounding of the scale can cost (0.5%)."""
    x = rng.standard_normal((200, 64)).astype(np.float32) * rng.uniform(0.1, 3, (200, 1))
    x[0] = 0.0
    x[1] = np.abs(x[1])           # one-sided groups: the sign of the scale matters
    x[2] = -np.abs(x[2])
    got = FMT.dequantize(FMT.quantize(x.reshape(1, -1)), (1, x.size)).reshape(x.shape)
    err = ((got - x) ** 2).sum(1)
    amax = np.abs(x).max(1, keepdims=True)
    s = amax * np.linspace(-1.5, 1.5, 4001)[None, :]
    c = np.clip(np.rint(x[:, None, :] / np.where(s == 0, 1, s)[:, :, None]), -1, 2)
    best = ((x[:, None, :] - c * s[:, :, None]) ** 2).sum(2).min(1)
    assert err[0] == 0.0
    assert (err <= best * 1.005 + 1e-12).all(), np.max(err / np.maximum(best, 1e-30))


def test_bad_weights_are_refused():
    with pytest.raises(FormatError, match="NaN/Inf"):
        FMT.quantize(np.full((1, 128), np.nan, np.float32))
    with pytest.raises(FormatError, match="multiple of the block size"):
        FMT.quantize(np.zeros((1, 96), np.float32))
    with pytest.raises(FormatError, match="beyond fp16"):
        FMT.quantize(np.full((1, 64), 1e6, np.float32))
    with pytest.raises(FormatError, match="multiple of 128"):
        FMT.layout(192, 128)


# ------------------------------------------------------------------------------ blob layout
def test_blob_planes_follow_the_spec(rng):
    h, f = 256, 128
    gate, up, down = (exact_weights(rng, *s) for s in ((f, h), (f, h), (h, f)))
    blob = FMT.pack_expert(gate, up, down)
    p = Planes.of(h, f)
    lay = FMT.layout(h, f)
    assert blob.size == lay.blob_bytes == p.total == h * f * 27 // 32
    assert lay.slot_bytes % 256 == 0 and lay.slot_bytes >= lay.blob_bytes
    assert lay.gate_up_image_bytes + lay.down_image_bytes == lay.blob_bytes

    def row(mat_raw, r, cols):  # plain encoding of one row -> (codes, scales)
        return mat_raw[r, : cols // 4], mat_raw[r, cols // 4:]

    graw, uraw, draw = FMT.quantize(gate), FMT.quantize(up), FMT.quantize(down)
    gc = blob[: p.gu_codes_bytes].reshape(2 * f, h // 4)
    gs = blob[p.gu_scales: p.gu_scales + p.gu_scales_bytes].reshape(2 * f, h // 32)
    for k in (0, 1, f - 1):
        assert np.array_equal(gc[2 * k], row(graw, k, h)[0])
        assert np.array_equal(gc[2 * k + 1], row(uraw, k, h)[0])
        assert np.array_equal(gs[2 * k], row(graw, k, h)[1])
        assert np.array_equal(gs[2 * k + 1], row(uraw, k, h)[1])
    dc = blob[p.down_codes: p.down_codes + p.down_codes_bytes].reshape(h, f // 4)
    ds = blob[p.down_scales:].reshape(h, f // 32)
    assert np.array_equal(dc, draw[:, : f // 4]) and np.array_equal(ds, draw[:, f // 4:])
    # gate row 0 decoded by hand: four codes per byte, low bits first, weight = (code-1)*scale
    scale = gs[0].view(np.float16).astype(np.float32)
    by_hand = [((int(gc[0, v // 4]) >> (2 * (v % 4))) & 3) - 1 for v in range(h)]
    assert np.array_equal(np.array(by_hand, np.float32) * np.repeat(scale, 64), gate[0])


def test_unpack_and_images_agree(rng):
    h, f = 256, 128
    gate, up, down = (exact_weights(rng, *s) for s in ((f, h), (f, h), (h, f)))
    blob = FMT.pack_expert(gate, up, down)
    g2, u2, d2 = FMT.unpack_expert(blob, h, f)
    assert np.array_equal(g2, gate) and np.array_equal(u2, up) and np.array_equal(d2, down)
    gu_img, dn_img = FMT.images(blob, h, f)
    lay = FMT.layout(h, f)
    assert gu_img.size == lay.gate_up_image_bytes and dn_img.size == lay.down_image_bytes
    assert np.array_equal(FMT.image_matrix(gu_img, 2 * f, h), np.vstack([gate, up]))
    assert np.array_equal(FMT.image_matrix(dn_img, h, f), down)


def test_gguf_packs_from_float_weights(tmp_path, rng):
    gguf = pytest.importorskip("gguf")
    n, h, f = 3, 128, 128
    mats = {"gate": rng.standard_normal((n, f, h), dtype=np.float32),
            "up": rng.standard_normal((n, f, h), dtype=np.float32),
            "down": rng.standard_normal((n, h, f), dtype=np.float32)}
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tensor("blk.0.ffn_gate_exps.weight", mats["gate"])
    w.add_tensor("blk.0.ffn_up_exps.weight", mats["up"].astype(np.float16))
    w.add_tensor("blk.0.ffn_down_exps.weight", mats["down"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = {x.name.split(".")[2][4:-5]: x for x in gguf.GGUFReader(str(path)).tensors}
    got = FMT.pack_gguf_experts(t["gate"], t["up"], t["down"])
    up16 = mats["up"].astype(np.float16).astype(np.float32)
    want = np.stack([FMT.pack_expert(mats["gate"][e], up16[e], mats["down"][e])
                     for e in range(n)])
    assert np.array_equal(got, want)


# ------------------------------------------------------------------------------ MMQ reference
def slow_reference(case):
    """The kernel's arithmetic one scalar at a time (numpy float32 scalars round each op)."""
    acts = case.acts
    out = np.zeros((case.x.shape[0], case.m), np.float32)
    for p, e in enumerate(case.expert_ids):
        codes, scales = q2_blob._split_image(case.image[p], case.m, case.k)
        lv = q2_blob.code_levels(codes).astype(np.int64)
        for r in range(case.bounds[e], case.bounds[e + 1]):
            for mm in range(case.m):
                acc = np.float32(0)
                for j in range(case.k // 32):
                    idot = int((lv[mm, 32 * j: 32 * j + 32]
                                * acts.q[r, 32 * j: 32 * j + 32].astype(np.int64)).sum())
                    ws = np.float32(scales[mm, j // 2])
                    acc = np.float32(acc + np.float32(ws * acts.d[r, j]) * np.float32(idot))
                out[r, mm] = acc
    return out


def test_reference_is_the_kernel_order(rng):
    case = make_case(FMT, rng, 128, 128, "down", [2, 0, 3], (0, 1, 2))
    got = FMT.mmq_reference(case.image, case.expert_ids, case.acts, case.bounds, case.m, case.k)
    assert np.array_equal(got.view(np.uint32), slow_reference(case).view(np.uint32))


# ------------------------------------------------------------------------------ contract
def test_identity_not_native_and_gather_batch_refused():
    assert not FMT.native and FMT.activation is Q8_1 and FMT.exact
    assert not FMT.offers_batched_gather()
    launchers = FormatKernels(FMT, None, FMT.layout(256, 256))
    with pytest.raises(PluginError, match="not native"):
        launchers.gather_batch(None, [0, 0], 0, 0, 0)
    assert Q2Kernels.gather_batch is FormatKernels.gather_batch


def test_registry_refuses_a_batching_non_native_format(tmp_path, monkeypatch):
    (tmp_path / "q2_batching_plugin.py").write_text(textwrap.dedent("""
        from strata_rt.quants.q2_blob import Q2Blob, Q2Kernels
        from strata_rt.formats.hookspecs import hookimpl

        class Batching(Q2Kernels):
            def gather_batch(self, stream, srcs, first_pos, gu_buf, down_buf):
                pass

        class Q2Batching(Q2Blob):
            name = "q2_batching"

            def kernels_class(self):
                return Batching

        @hookimpl
        def strata_rt_formats():
            return [Q2Batching()]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yaml_path = tmp_path / "plugins.yaml"
    yaml_path.write_text("plugins:\n  - module: q2_batching_plugin\n")
    with pytest.raises(PluginError, match="not native but offers a batched gather"):
        QuantRegistry(yaml_path, entry_points=False)


def test_registry_loads_both_plugins(tmp_path):
    yaml_path = tmp_path / "plugins.yaml"
    yaml_path.write_text("plugins:\n  - module: strata_rt.quants.q2_blob\n  - module: strata_rt.quants.fp16\n")
    reg = QuantRegistry(yaml_path, entry_points=False)
    assert sorted(reg.names()) == ["fp16", "q2_blob"]
    assert not reg["q2_blob"].native and reg["fp16"].native


# ------------------------------------------------------------------------------ launchers
def test_alignment_is_refused_on_the_host_naming_the_value():
    """Vectorized kernels move 16 bytes at a time: a misaligned address is named before any
    launch (one helper serves the per-expert launchers and the batched gather's fallback)."""
    assert first_misaligned({"src": 0x100, "gate/up image": 0x2000}) is None
    why = first_misaligned({"src": 0x100, "down image": 0x2008, "out": 3})
    assert why == "down image = 8200 (0x2008) is not a multiple of 16"
    with pytest.raises(FormatError, match="weights = 4097"):
        check_aligned({"weights": 4097, "acts": 4096})


def test_f16_variant_images_are_the_weights_in_fp16(rng):
    """variant f16_gemm: the dequantizing gather's twin gives fp16 of the exact weights, gate
    rows then up rows, bit for bit (signed zeros of negative scales included), and the same
    blob bytes as the exact int8 variant. f16_gemm is the default."""
    base = FMT
    fmt = base.for_variant("f16_gemm")
    assert fmt is not base and fmt.for_variant("f16_gemm") is fmt and fmt.variant == "f16_gemm"
    assert type(fmt) is Q2Blob and base.for_variant("int8") is base and base.variant == "int8"
    assert Q2Blob().variant == "f16_gemm" and fmt.for_variant(None) is fmt
    assert base.mmq_variants() == ("f16_gemm", "int8")
    with pytest.raises(FormatError, match="'default'.*valid: f16_gemm, int8"):
        base.for_variant("default")
    h, f = 256, 128
    blob = base.random_expert(rng, h, f)
    gu, dn = fmt.images(blob, h, f)
    gate, up, down = base.unpack_expert(blob, h, f)
    want_gu = np.vstack([gate, up]).astype(np.float16).view(np.uint16).reshape(-1)
    assert np.array_equal(gu.view(np.uint16), want_gu)
    assert np.array_equal(dn.view(np.uint16), down.astype(np.float16).view(np.uint16).reshape(-1))
    assert (gu.view(np.uint16) == 0x8000).any(), "a negative scale's zero level is -0"
    lay, lay16 = base.layout(h, f), fmt.layout(h, f)
    assert lay16.blob_bytes == lay.blob_bytes
    assert (lay16.gate_up_image_bytes, lay16.down_image_bytes) == (4 * f * h, 2 * h * f)
    assert fmt.kernels_class().gather_kernel == ("q2_dequant_f16", "ii")
