"""Whole qwen3moe GGUF files: exact round trips, llama.cpp's names, keys and dimension order,
dense tensors in the types downloaded files carry, and one clear error per kind of bad file."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES, GGUFReader
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from strata_rt.errors import ConfigError, FormatError, GGUFError
from strata_rt.models.qwen3 import (
    DenseTensor,
    Qwen3Model,
    Qwen3Reference,
    Qwen3Spec,
    read_qwen3_gguf,
    read_qwen3_spec,
    spec_keys,
    write_qwen3_gguf,
)
from strata_rt.models.qwen3.weights import DenseWeights
from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, vocab=300,
                 ffn=256, n_experts=4, top_k=2, rope_theta=500_000.0, rms_eps=1e-5,
                 context=1024)
IDS = np.array([5, 17, 299, 0, 42, 42, 7, 130])


@pytest.fixture(scope="module")
def fp16_model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 1, "fp16")


@pytest.fixture(scope="module")
def good(tmp_path_factory, fp16_model):
    return write_qwen3_gguf(tmp_path_factory.mktemp("q3") / "good.gguf", fp16_model)


@pytest.mark.parametrize("fmt,tied,types", [
    ("fp16", False, {}),
    ("iq3_xxs", True, {"token_embd": "Q8_0", "attn_q": "BF16", "attn_k": "F16",
                       "attn_v": "Q8_0", "attn_output": "Q4_0"}),
])
def test_round_trip_is_exact(tmp_path, fmt, tied, types):
    model = Qwen3Model.synthetic(SPEC, 2, fmt, tied=tied).with_dense_types(types)
    back = read_qwen3_gguf(write_qwen3_gguf(tmp_path / "m.gguf", model), fmt)
    assert back.spec == SPEC and back.tied == tied
    assert back.digest() == model.digest()
    assert np.array_equal(Qwen3Reference(back).prefill(IDS), Qwen3Reference(model).prefill(IDS))
    assert read_qwen3_spec(tmp_path / "m.gguf") == (SPEC, tied)


def test_names_keys_and_dimension_order_are_llama_cpps(good):
    """Every tensor is one of llama.cpp's qwen3moe tensors; GGUF lists dimensions innermost
    first, so an [out, in] matrix has ne = [in, out] (attn_q: [hidden, heads * head_dim])."""
    r = GGUFReader(str(good))
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    allowed = {TENSOR_NAMES[t].format(bid=b) + ".weight" for t in MODEL_TENSORS[MODEL_ARCH.QWEN3MOE]
               for b in range(SPEC.n_layers)}
    names = {t.name for t in r.tensors}
    assert names == allowed
    ne = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    H, S = SPEC.hidden, SPEC
    assert ne["token_embd.weight"] == [H, S.vocab] and ne["output.weight"] == [H, S.vocab]
    assert ne["blk.1.attn_q.weight"] == [H, S.q_dim]
    assert ne["blk.1.attn_k.weight"] == ne["blk.1.attn_v.weight"] == [H, S.kv_dim]
    assert ne["blk.1.attn_output.weight"] == [S.q_dim, H]
    assert ne["blk.1.attn_q_norm.weight"] == [S.head_dim]
    assert ne["blk.0.ffn_gate_inp.weight"] == [H, S.n_experts]
    assert ne["blk.0.ffn_gate_exps.weight"] == [H, S.ffn, S.n_experts]
    assert ne["blk.0.ffn_down_exps.weight"] == [S.ffn, H, S.n_experts]
    for key, want in spec_keys(SPEC).items():
        got = r.fields[key].contents()
        assert got == pytest.approx(want, rel=1e-7), key


def _random_blocks(qt, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random bytes of a block type: random payload, small finite fp16 scales."""
    block, nbytes = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    scale_at = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,), Q.Q8_0: (0,),
                Q.Q8_K: ()}[qt]
    for off in scale_at:
        d = (0.002 + 0.01 * rng.random(raw.shape[:2])).astype(np.float16)
        raw[:, :, off: off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qt", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.Q8_0])
def test_dense_tensors_of_downloaded_mixes(tmp_path, fp16_model, qt):
    """Attention and output in the block types of downloaded IQ3_XXS mixes are read as stored
    and dequantized exactly as the gguf package does."""
    rng = np.random.default_rng(int(qt))
    lw = fp16_model.dense.layers[1]
    q = DenseTensor(lw.attn_q.name, lw.attn_q.shape, qt,
                    _random_blocks(qt, SPEC.q_dim, SPEC.hidden, rng))
    o = DenseTensor(lw.attn_output.name, lw.attn_output.shape, qt,
                    _random_blocks(qt, SPEC.hidden, SPEC.q_dim, rng))
    head = DenseTensor("output.weight", (SPEC.vocab, SPEC.hidden), qt,
                       _random_blocks(qt, SPEC.vocab, SPEC.hidden, rng))
    d = fp16_model.dense
    layers = (d.layers[0], replace(lw, attn_q=q, attn_output=o))
    model = Qwen3Model(SPEC, DenseWeights(d.token_embd, d.output_norm, head, layers),
                       fp16_model.moe)
    back = read_qwen3_gguf(write_qwen3_gguf(tmp_path / "mix.gguf", model), "fp16")
    for got, raw in ((back.dense.layers[1].attn_q, q), (back.dense.layers[1].attn_output, o),
                     (back.dense.output, head)):
        assert got.type == qt
        want = dequantize(raw.data, qt).reshape(raw.shape)
        assert np.isfinite(want).all()
        assert np.array_equal(got.f32(), want)
    logits = Qwen3Reference(back).prefill(IDS, all_logits=True)
    assert np.isfinite(logits).all()
    assert np.array_equal(logits, Qwen3Reference(model).prefill(IDS, all_logits=True))


def test_quantized_embedding_rows_dequantize_alone(fp16_model):
    m = fp16_model.with_dense_types({"token_embd": "Q8_0"})
    t = m.dense.token_embd
    assert np.array_equal(t.rows(IDS), t.f32()[IDS])


def test_synthetic_pool_layers_share_arrays_under_their_own_names():
    spec = replace(SPEC, n_layers=5)
    m = Qwen3Model.synthetic(spec, 3, "fp16", pool_layers=2, dense_type="F16")
    a, b = m.dense.layers[0].attn_q, m.dense.layers[4].attn_q
    assert a.data is b.data and b.name == "blk.4.attn_q.weight" and b.type_name == "F16"
    assert m.dense.layers[1].attn_q.data is not a.data


# ------------------------------------------------------------------------- bad files
def _expect(tmp_path, model, pattern, **kw):
    path = write_qwen3_gguf(tmp_path / "bad.gguf", model, **kw)
    with pytest.raises(GGUFError, match=pattern):
        read_qwen3_gguf(path, "fp16")


def test_missing_tensor(tmp_path, fp16_model):
    _expect(tmp_path, fp16_model, r"tensor blk\.1\.attn_k_norm\.weight is missing "
            r"\(qwen3moe\.block_count = 2 says layer 1 exists\)",
            omit=["blk.1.attn_k_norm.weight"])
    _expect(tmp_path, fp16_model, r"tensor output_norm\.weight is missing",
            omit=["output_norm.weight"])


def test_wrong_shape_names_the_keys(tmp_path, fp16_model):
    bad = np.zeros((SPEC.hidden, SPEC.hidden), np.float32)
    _expect(tmp_path, fp16_model, r"blk\.0\.attn_k\.weight has shape \[256, 256\]; expected "
            r"\[128, 256\] \(qwen3moe\.attention\.head_count_kv=2 x key_length=64",
            tensors={"blk.0.attn_k.weight": (bad, None)})
    head = np.zeros((SPEC.vocab + 1, SPEC.hidden), np.float32)
    _expect(tmp_path, fp16_model, r"output\.weight has shape \[301, 256\]; expected "
            r"\[300, 256\]", tensors={"output.weight": (head, None)})


def test_bad_keys(tmp_path, fp16_model):
    _expect(tmp_path, fp16_model, r"key qwen3moe\.attention\.head_count is missing",
            keys={"qwen3moe.attention.head_count": None})
    _expect(tmp_path, fp16_model, r"value_length = 32 differs from .*key_length = 64",
            keys={"qwen3moe.attention.value_length": 32})
    _expect(tmp_path, fp16_model, r"vocab_size = 301 but tensor token_embd\.weight holds 300",
            keys={"qwen3moe.vocab_size": 301})
    _expect(tmp_path, fp16_model, r"n_heads=8 is not a multiple of n_kv_heads=3",
            keys={"qwen3moe.attention.head_count_kv": 3})


def test_missing_optional_keys_take_llama_cpps_defaults(tmp_path, fp16_model):
    path = write_qwen3_gguf(tmp_path / "m.gguf", fp16_model,
                            keys={"qwen3moe.rope.freq_base": None,
                                  "qwen3moe.attention.key_length": None,
                                  "qwen3moe.attention.value_length": None})
    with pytest.raises(GGUFError, match=r"attn_q\.weight has shape \[512, 256\]; expected "
                       r"\[256, 256\]"):  # head_dim defaults to hidden / heads = 32
        read_qwen3_gguf(path, "fp16")
    spec = replace(SPEC, head_dim=SPEC.hidden // SPEC.n_heads)
    m = Qwen3Model.synthetic(spec, 1, "fp16")
    path = write_qwen3_gguf(tmp_path / "d.gguf", m, keys={"qwen3moe.rope.freq_base": None,
                                                         "qwen3moe.attention.key_length": None})
    assert read_qwen3_spec(path)[0] == replace(spec, rope_theta=10_000.0)


def test_other_architecture(tmp_path, fp16_model):
    path = tmp_path / "q.gguf"
    dense = {t.name: (t.data, None) for _, t in fp16_model.named_roles()}
    kv = {k.replace("qwen3moe.", "qwen3."): v for k, v in spec_keys(SPEC).items()}
    write_moe_gguf(path, fp16_model.moe, arch="qwen3", keys=kv, tensors=dense)
    with pytest.raises(GGUFError, match=r"general\.architecture = 'qwen3'; .* 'qwen3moe'"):
        read_qwen3_gguf(path, "fp16")


def test_type_the_gguf_package_cannot_dequantize(tmp_path, fp16_model):
    raw = _random_blocks(Q.Q8_K, SPEC.q_dim, SPEC.hidden, np.random.default_rng(0))
    _expect(tmp_path, fp16_model, r"blk\.0\.attn_q\.weight has type Q8_K, which the gguf "
            "package cannot dequantize", tensors={"blk.0.attn_q.weight": (raw, Q.Q8_K)})


def test_conversions_that_cannot_be_done(fp16_model):
    with pytest.raises(FormatError, match="cannot quantize to Q4_K"):
        fp16_model.with_dense_types({"attn_q": "Q4_K"})
    with pytest.raises(ConfigError, match="dense role 'attn_x' is unknown"):
        fp16_model.with_dense_types({"attn_x": "F16"})
    with pytest.raises(FormatError, match="unknown GGUF tensor type 'Q9'"):
        fp16_model.with_dense_types({"attn_q": "Q9"})
