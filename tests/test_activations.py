"""q8_1 and f16 activation encodings: the numpy twins' properties (CPU) and the kernels
against the twins byte for byte (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.errors import FormatError
from strata_rt.formats.activations import (
    ACTIVATIONS,
    F16,
    Q8_1,
    Activation,
    ActivationKernels,
    Q8_1Acts,
    activation_named,
    convert_f16,
    quantize_q8_1,
    round_half_away,
)
from strata_rt.formats.contract import QuantFormat


def awkward_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Gaussian rows plus the edge cases: all-zero groups, a zero row, outliers, ties."""
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x[0, :32] = 0.0
    x[min(1, rows - 1)] = 0.0
    x[rows // 2] *= 1000.0
    x[-1, 32] = 127.0  # d = 1 exactly, so the rest of the group are exact .5 ties
    x[-1, 33:64] = np.arange(31, dtype=np.float32) - np.float32(15.5)
    return x


def test_q8_1_properties(rng):
    x = awkward_rows(rng, 9, 512)
    a = quantize_q8_1(x)
    assert a.q.dtype == np.int8 and a.q.shape == x.shape
    assert a.d.dtype == np.float32 and a.d.shape == (9, 512 // 32)
    g = x.reshape(9, 16, 32)
    amax = np.abs(g).max(axis=2)
    assert np.array_equal(a.d, amax / np.float32(127))
    zero = amax == 0
    assert zero[0, 0] and zero[1].all()
    assert not a.q.reshape(9, 16, 32)[zero].any()
    qg = a.q.reshape(9, 16, 32).astype(np.float64)
    assert (np.abs(qg).max(axis=2)[~zero] == 127).all()
    err = np.abs(qg * a.d[:, :, None] - g)
    assert (err <= a.d[:, :, None] * 0.5 * (1 + 1e-5) + 1e-30).all()


def test_round_half_away_is_c_roundf():
    v = np.array([0.49999997, 0.5, -0.5, 1.5, -2.5, 2.4999998, 126.5, -0.0], np.float32)
    assert round_half_away(v).tolist() == [0.0, 1.0, -1.0, 2.0, -3.0, 2.0, 127.0, 0.0]


def test_device_bytes_round_trip(rng):
    a = quantize_q8_1(awkward_rows(rng, 5, 384))
    raw = a.to_device_bytes()
    assert raw.size == Q8_1.nbytes(5, 384) == 5 * 3 * 144
    assert np.array_equal(Q8_1.device_bytes(a), raw)
    first = raw[:144]
    assert np.array_equal(first[:16].view("<f4"), a.d[0, :4])
    assert np.array_equal(first[16:].view(np.int8), a.q[0, :128])
    b = Q8_1Acts.from_device_bytes(raw, 5, 384)
    assert np.array_equal(b.q, a.q) and np.array_equal(b.d, a.d)


def test_prepare_and_sizes(rng):
    x = awkward_rows(rng, 3, 256)
    assert isinstance(Q8_1.prepare(x), Q8_1Acts)
    h = F16.prepare(x)
    assert h.dtype == np.float16 and np.array_equal(h, x.astype(np.float16))
    assert np.array_equal(F16.device_bytes(h), h.view(np.uint8).reshape(-1))
    assert F16.nbytes(3, 256) == 3 * 256 * 2
    assert quantize_q8_1(np.zeros((0, 128), np.float32)).q.shape == (0, 128)
    with pytest.raises(FormatError, match="multiple of 128"):
        quantize_q8_1(np.zeros((2, 100), np.float32))
    with pytest.raises(FormatError, match="multiple of 128"):
        F16.nbytes(2, 100)


def test_encodings_are_objects_naming_their_kernels():
    assert list(ACTIVATIONS) == ["q8_1", "f16"] and ACTIVATIONS["f16"] is F16
    assert (Q8_1.kernel, Q8_1.swiglu_kernel) == ("quantize_q8_1_rows", "swiglu_q8_1")
    assert (F16.kernel, F16.swiglu_kernel) == ("convert_f16_rows", "swiglu_f16")
    assert str(Q8_1) == "q8_1" and Q8_1 is not F16 and Q8_1 != F16
    assert activation_named("f16") is F16 and activation_named(Q8_1) is Q8_1
    with pytest.raises(FormatError, match="'q4' is unknown; valid: q8_1, f16"):
        activation_named("q4")


def test_format_classes_take_the_name_or_the_object():
    class Named(QuantFormat):
        name, block_values, block_bytes, activation = "named", 32, 34, "f16"

    class Given(QuantFormat):
        name, block_values, block_bytes, activation = "given", 32, 34, F16

    class Unknown(QuantFormat):
        name, block_values, block_bytes, activation = "unknown", 32, 34, "q4"

    assert Named.activation is F16 and Given.activation is F16
    # the base's defaults are properties a subclass may replace by a class attribute
    plain = type("Plain", (QuantFormat,), {"name": "plain", "block_values": 32,
                                           "block_bytes": 34})()
    assert plain.activation is Q8_1 and not plain.exact
    assert Unknown.activation == "q4" and not isinstance(Unknown.activation, Activation)
    assert Named().prepare_activations(np.ones((1, 128), np.float32)).dtype == np.float16


# ------------------------------------------------------------------------------------ GPU
def run_kernel(rt, act: Activation, x: np.ndarray, index: np.ndarray | None,
               k: int) -> np.ndarray:
    stream = rt.stream("test")
    rows = x.shape[0] if index is None else index.size
    nbytes = act.nbytes(rows, k)
    out = np.full(nbytes + 64, 0xFF, dtype=np.uint8)  # poison, plus a guard tail
    bufs = [rt.alloc(x.nbytes), rt.alloc(out.nbytes), rt.alloc(max(4, 4 * rows))]
    try:
        rt.memcpy_htod(bufs[0].ptr, x, stream)
        rt.memcpy_htod(bufs[1].ptr, out, stream)
        if index is not None:
            rt.memcpy_htod(bufs[2].ptr, index.astype(np.int32), stream)
        ActivationKernels(rt).launch(act, stream, bufs[0].ptr, x.shape[1],
                                     0 if index is None else bufs[2].ptr, bufs[1].ptr, rows, k)
        rt.memcpy_dtoh(out, bufs[1].ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    assert (out[nbytes:] == 0xFF).all(), "kernel wrote past the output"
    return out[:nbytes]


@pytest.mark.gpu
@pytest.mark.parametrize("k", [128, 768, 2048])
def test_q8_1_kernel_matches_twin(rt, rng, k):
    x = awkward_rows(rng, 37, k)
    got = run_kernel(rt, Q8_1, x, None, k)
    assert np.array_equal(got, quantize_q8_1(x).to_device_bytes())


@pytest.mark.gpu
def test_q8_1_kernel_index_list_and_stride(rt, rng):
    k, stride = 512, 640
    wide = awkward_rows(rng, 50, stride)
    index = rng.permutation(50)[:41]
    index[3] = index[7]  # a repeated row is legal
    got = run_kernel(rt, Q8_1, wide, index, k)
    assert np.array_equal(got, quantize_q8_1(wide[index, :k]).to_device_bytes())


@pytest.mark.gpu
def test_f16_kernel_matches_twin(rt, rng):
    x = awkward_rows(rng, 23, 640)
    x[2, :8] = [65504.0, 65520.0, 1e-8, -6e-8, 3.0e-5, 1.0009766, 1.0004883, -1.0014648]
    index = rng.permutation(23)
    got = run_kernel(rt, F16, x, index, 640)
    assert np.array_equal(got.view(np.float16).reshape(23, 640).view(np.uint16),
                          convert_f16(x[index]).view(np.uint16))
