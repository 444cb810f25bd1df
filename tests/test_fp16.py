"""FP16 plugin (GGML's F16 as a GGMLFormat): exact conversion, blob = images, GGUF packing. Its
variants (f16_gemm: byte copies and the grouped fp16 GEMM; f16_fused) against the reference
(within KERNEL_NMSE: fp16 is not `exact`) and against float64 run in test_conformance.py with
every other format; the variant objects in test_variants.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16
from strata_rt.formats.numerics import nmse
from strata_rt.formats.testing_abi import Recorder
from strata_rt.quants.fp16 import FP16

FMT = FP16()


def test_representable_values_roundtrip_exactly(rng):
    w = rng.standard_normal((64, 256)).astype(np.float16).astype(np.float32)
    w[0, :4] = [65504.0, -65504.0, 2.0 ** -24, 0.0]   # extremes and the smallest subnormal
    raw = FMT.quantize(w)
    assert raw.dtype == np.uint8 and raw.shape == (64, 512)
    assert np.array_equal(FMT.dequantize(raw, w.shape), w)


def test_gaussian_roundtrip_within_fp16_rounding(rng):
    w = rng.standard_normal((128, 512), dtype=np.float32)
    err = nmse(FMT.dequantize(FMT.quantize(w), w.shape), w)
    print(f"fp16 round trip NMSE on Gaussian weights: {err:.3g}")
    assert 0 < err <= FMT.roundtrip_nmse


def test_out_of_range_and_bad_values_are_refused():
    with pytest.raises(FormatError, match="do not fit F16: 128 value.*row 0, column 0"):
        FMT.quantize(np.full((1, 128), 70000.0, np.float32))
    with pytest.raises(FormatError, match="NaN/Inf"):
        FMT.quantize(np.full((1, 128), np.inf, np.float32))
    with pytest.raises(FormatError, match="multiple of 128"):
        FMT.layout(256, 64)


def test_blob_is_the_images(rng):
    h, f = 256, 128
    gate, up = (rng.standard_normal((f, h), dtype=np.float32) for _ in range(2))
    down = rng.standard_normal((h, f), dtype=np.float32)
    blob = FMT.pack_expert(gate, up, down)
    lay = FMT.layout(h, f)
    assert blob.size == lay.blob_bytes == 3 * h * f * 2
    want = np.concatenate([m.astype(np.float16).reshape(-1) for m in (gate, up, down)])
    assert np.array_equal(blob.view(np.float16), want)
    gu, dn = FMT.images(blob, h, f)
    assert np.array_equal(FMT.image_matrix(gu, 2 * f, h),
                          np.vstack([gate, up]).astype(np.float16).astype(np.float32))
    assert np.array_equal(FMT.image_matrix(dn, h, f), down.astype(np.float16).astype(np.float32))
    g2, u2, d2 = FMT.unpack_expert(blob, h, f)
    assert np.array_equal(g2, gate.astype(np.float16).astype(np.float32))
    assert np.array_equal(d2, down.astype(np.float16).astype(np.float32))


def test_gguf_f16_and_f32_tensors(tmp_path, rng):
    gguf = pytest.importorskip("gguf")
    n, h, f = 2, 128, 256
    gate = rng.standard_normal((n, f, h)).astype(np.float16)
    up = rng.standard_normal((n, f, h), dtype=np.float32)
    down = rng.standard_normal((n, h, f)).astype(np.float16)
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, arr in (("gate", gate), ("up", up), ("down", down)):
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = {x.name.split(".")[2][4:-5]: x for x in gguf.GGUFReader(str(path)).tensors}
    got = FMT.pack_gguf_experts(t["gate"], t["up"], t["down"])
    assert got.shape == (n, FMT.layout(h, f).blob_bytes)
    for e in range(n):
        want = np.concatenate([gate[e].reshape(-1), up[e].astype(np.float16).reshape(-1),
                               down[e].reshape(-1)])
        assert np.array_equal(got[e].view(np.float16), want)


def test_identity_native_and_batched_byte_copies():
    # tensor cores do not sum in IEEE sequential order: the kernel is not bit-exact
    assert FMT.native and FMT.activation is F16 and not FMT.exact
    assert FMT.ggml_type == 1 and FMT.quantizes
    for variant in FMT.mmq_variants():
        fmt = FMT.for_variant(variant)
        assert fmt.offers_batched_gather() and fmt.images_are_blocks
        kern = fmt.kernels(Recorder(), fmt.layout(256, 256))
        kern.gather_batch(None, [0x1000, 0x2000], 0, 0x10000, 0x20000)
        assert kern.fallbacks == 0
