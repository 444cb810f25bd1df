"""GGUF loading: a round trip through GGUFWriter, and one error per kind of bad file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from strata_rt.errors import GGUFError
from strata_rt.gguf_io import write_moe_gguf
from strata_rt.model import Model, MoESpec
from strata_rt.registry import registry

SPEC = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=4, top_k=2, rms_eps=1e-5)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.synthetic(SPEC, 11)


@pytest.fixture(scope="module")
def good(tmp_path_factory, model):
    return write_moe_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", model)


def test_round_trip_is_exact(good, model):
    back = Model.from_gguf(good, "iq3_xxs")
    assert back.spec == SPEC
    assert np.array_equal(back.blobs, model.blobs)
    assert np.array_equal(back.router, model.router)
    assert np.array_equal(back.norm, model.norm)


def test_round_trip_fp16_raw(tmp_path):
    fmt = registry()["fp16"]
    m = Model.synthetic(MoESpec(1, 128, 128, 2, 1, format="fp16"), 3, fmt)
    back = Model.from_gguf(write_moe_gguf(tmp_path / "f.gguf", m), "fp16")
    assert np.array_equal(back.blobs, m.blobs)


def test_load_into_another_format_converts(good, model, capsys):
    """IQ3_XXS tensors loaded as fp16 are dequantized (exactly representable in fp16), and the
    conversion is said once for the file, not once per layer."""
    back = Model.from_gguf(good, "fp16")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "IQ3_XXS" in err and "converted through float" in err
    Model.from_gguf(good, "iq3_xxs")
    assert capsys.readouterr().err == ""  # raw bytes copied: nothing to say
    for e in (0, 3):
        want = model.dequantized(1, e)
        got = back.dequantized(1, e)
        for w, g in zip(want, got):
            assert np.allclose(g, w, rtol=1e-3, atol=1e-6)


def _expect(path, model, pattern, fmt="iq3_xxs", **kw):
    write_moe_gguf(path, model, **kw)
    with pytest.raises(GGUFError, match=pattern):
        Model.from_gguf(path, fmt)


def test_missing_tensor(tmp_path, model):
    _expect(tmp_path / "a.gguf", model, r"tensor blk\.1\.ffn_up_exps\.weight is missing",
            omit=["blk.1.ffn_up_exps.weight"])


def test_wrong_shape(tmp_path, model):
    bad = np.zeros((4, 256, 128), np.float32)  # down must be [4, 256, 256]
    _expect(tmp_path / "b.gguf", model,
            r"tensor blk\.0\.ffn_down_exps\.weight has shape \[4, 256, 128\]; "
            r"expected \[4, 256, 256\]",
            tensors={"blk.0.ffn_down_exps.weight": (bad, None)})


def test_unsupported_type(tmp_path, model):
    ints = np.zeros((4, 256, 256), np.int32)
    _expect(tmp_path / "c.gguf", model,
            r"tensor blk\.0\.ffn_gate_exps\.weight has type I32",
            tensors={"blk.0.ffn_gate_exps.weight": (ints, None)})


def test_unsupported_router_type(tmp_path, model):
    _expect(tmp_path / "c2.gguf", model, r"tensor blk\.1\.ffn_gate_inp\.weight has type I32",
            tensors={"blk.1.ffn_gate_inp.weight": (np.zeros((4, 256), np.int32), None)})


def test_inconsistent_expert_count(tmp_path, model):
    _expect(tmp_path / "d.gguf", model,
            r"tensor blk\.0\.ffn_gate_inp\.weight holds 4 experts but key "
            r"qwen3moe\.expert_count = 5", keys={"qwen3moe.expert_count": 5})


def test_missing_key(tmp_path, model):
    _expect(tmp_path / "e.gguf", model, r"key qwen3moe\.expert_feed_forward_length is missing",
            keys={"qwen3moe.expert_feed_forward_length": None})


def test_top_k_above_expert_count(tmp_path, model):
    _expect(tmp_path / "f.gguf", model, r"expert_used_count = 9 exceeds",
            keys={"qwen3moe.expert_used_count": 9})


def test_dims_the_format_cannot_take(tmp_path):
    m = Model.synthetic(MoESpec(1, 128, 128, 2, 1, format="fp16"), 3, registry()["fp16"])
    _expect(tmp_path / "g.gguf", m, r"do not fit format iq3_xxs", fmt="iq3_xxs")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        Model.from_gguf(p, "iq3_xxs")
    with pytest.raises(GGUFError, match="no such GGUF file"):
        Model.from_gguf(tmp_path / "nope.gguf", "iq3_xxs")


def test_expert_type_written_raw(good):
    from gguf import GGUFReader

    types = {t.name: int(t.tensor_type) for t in GGUFReader(str(good)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == GGMLQuantizationType.IQ3_XXS
    assert types["blk.0.ffn_gate_inp.weight"] == GGMLQuantizationType.F32
