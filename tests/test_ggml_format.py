"""GGMLFormat on the CPU beyond the conformance suite: random experts of every type are finite
and spread as asked, GGUF tensors of another type convert where the gguf package quantizes the
format's type and are refused where it cannot, and a plugin type outside the built-in table
takes its geometry from the gguf package."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata_rt.errors import FormatError
from strata_rt.formats.ggml_format import GGMLFormat
from strata_rt.formats.ggml_types import NAMES
from strata_rt.quants import ggml
from strata_rt.quants.fp16 import FP16
from strata_rt.quants.iq3_xxs import IQ3XXS

FORMATS = {f.gtype.name: f for f in [*ggml.strata_rt_formats(), FP16(), IQ3XXS()]}


def test_every_decoded_type_is_a_format():
    assert sorted(FORMATS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_random_experts_are_finite_and_spread_like_weights(rng, name):
    fmt = FORMATS[name]
    hidden, ffn = 2 * fmt.dim_multiple, fmt.dim_multiple
    gate, up, down = fmt.unpack_expert(fmt.random_expert(rng, hidden, ffn), hidden, ffn)
    for w, cols in ((gate, hidden), (up, hidden), (down, ffn)):
        assert np.isfinite(w).all()
        rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2))) * cols ** 0.5
        assert 0.5 < rms < 2.0, f"{name}: rms x sqrt(cols) = {rms:.3g}"


def _tensors(arrays, ggml_type):
    """ReaderTensor stand-ins of [n, rows, cols] arrays (GGUF shape order: innermost first)."""
    return [SimpleNamespace(name=f"blk.0.ffn_{p}_exps.weight", data=a, tensor_type=ggml_type,
                            shape=list(reversed(a.shape)))
            for p, a in zip(("gate", "up", "down"), arrays)]


def test_float_tensors_convert_where_the_gguf_package_quantizes(rng):
    n, h, f = 2, 512, 256
    arrays = [rng.standard_normal(s, dtype=np.float32) for s in ((n, f, h), (n, f, h), (n, h, f))]
    q8 = FORMATS["Q8_0"]
    got = q8.pack_gguf_experts(*_tensors(arrays, 0))  # F32 tensors
    for e in range(n):
        want = np.concatenate([q8.quantize(a[e]).reshape(-1) for a in arrays])
        assert np.array_equal(got[e], want)
    with pytest.raises(FormatError, match="q4_k: .*Q4_K tensors are read from GGUF files"):
        FORMATS["Q4_K"].pack_gguf_experts(*_tensors(arrays, 0))


def test_a_plugin_type_takes_its_geometry_from_gguf():
    class TQ2(GGMLFormat):
        ggml = "TQ2_0"

    fmt = TQ2()
    assert (fmt.name, fmt.ggml_type, fmt.block_values, fmt.block_bytes) == ("tq2_0", 35, 256, 66)
    with pytest.raises(FormatError, match="unknown to the gguf package"):
        type("Nope", (GGMLFormat,), {"ggml": "Q9_X"})
