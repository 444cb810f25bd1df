"""Values that leave float32's range during a run are an error naming the step, the layer and
the prompt position, never output (reference backend; the logits check runs for every backend,
on the host)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata_rt.backends.nonfinite import NonFiniteError, check_finite, check_rms_input
from strata_rt.cli import main
from strata_rt.engine import Engine
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.weights.model import SMALL_SPEC, Model

SPEC = replace(SMALL_SPEC, n_layers=2, n_experts=8, top_k=2)
WHOLE = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                  ffn=256, n_experts=8, top_k=2, context=512)


def _moe(model: Model, h: np.ndarray, prefill: int = 64) -> np.ndarray:
    with Engine.open({"model": model, "backend": "reference", "prefill": prefill}) as eng:
        return eng.prefill(h)[0]


@pytest.fixture
def moe() -> Model:
    return Model.synthetic(SPEC, 7)


@pytest.fixture
def whole() -> Qwen3Model:
    return Qwen3Model.synthetic(WHOLE, 5, "iq3_xxs")


def test_finite_rows_of_3e38_overflow_the_rmsnorm_and_are_named(moe):
    """3e38 is finite, but its square is not: the RMSNorm would divide by infinity, route
    zeros and return the input unchanged. The error names layer 0 and the row's position in
    the prompt (row 150 lies in the third 64-token chunk)."""
    h = np.random.default_rng(0).standard_normal((200, SPEC.hidden), dtype=np.float32)
    h[150, 3] = 3e38
    with pytest.raises(NonFiniteError) as info:
        _moe(moe, h)
    e = info.value
    assert (e.layer, e.position, e.exit_code) == (0, 150, 1)
    msg = str(e)
    assert "layer 0, position 150" in msg and "RMSNorm before the MoE overflows" in msg
    assert "column 3" in msg and "3e+38" in msg
    h[150, 3] = 1.0
    out = _moe(moe, h)  # the same prompt without the row is fine
    assert np.isfinite(out).all() and not np.array_equal(out, h)


def test_router_softmax_that_turns_nan_names_its_layer(moe):
    """Layer 0 is sound; layer 1's norm weight scales every row past float32, so its router
    logits are infinite and the softmax NaN: the error names layer 1, not a wrong route."""
    moe.norm[1] = 3e38
    h = np.random.default_rng(1).standard_normal((10, SPEC.hidden), dtype=np.float32)
    with pytest.raises(NonFiniteError, match=r"layer 1, position 0: the router's softmax"):
        _moe(moe, h)


def test_residual_that_overflows_after_the_moe_is_named():
    """check_finite names the first bad row and column (what the combine and attention checks
    call after each residual add)."""
    h = np.ones((6, 4), np.float32)
    h[4, 2] = np.inf
    h[5, 0] = np.nan
    with pytest.raises(NonFiniteError) as info:
        check_finite(h, "the residual after the MoE", 3)
    assert (info.value.layer, info.value.position) == (3, 4)
    assert "holds inf (column 2)" in str(info.value)
    check_finite(np.ones((2, 2), np.float32), "x", 0)  # finite: nothing raised
    with pytest.raises(NonFiniteError, match="the input of the final RMSNorm holds nan"):
        check_rms_input(h[5:], "the final RMSNorm", None, np.array([41]))


def test_whole_model_attention_norm_overflow_named_by_prompt_position(whole):
    """A token whose embedding row is 3e38 overflows the first attention RMSNorm; its
    position counts the cached tokens before the call and the chunks before its own."""
    rng = np.random.default_rng(2)
    bad_token = 17
    whole.dense.token_embd.data[bad_token] = 3e38
    ids = rng.integers(20, WHOLE.vocab, 100)
    ids[70] = bad_token
    with Engine.open({"model": whole, "backend": "reference", "prefill": 32}) as eng:
        eng.prefill(rng.integers(20, WHOLE.vocab, 10))  # 10 cached positions
        with pytest.raises(NonFiniteError) as info:
            eng.prefill(ids)
    assert (info.value.layer, info.value.position) == (0, 80)
    assert "RMSNorm before attention overflows" in str(info.value)


def test_nan_logits_are_an_error_at_the_position_they_belong_to(whole):
    """One NaN in the output head makes every position's logits NaN in that column: the last
    position's (the prompt's answer) and, with all_logits, the first one's."""
    head = whole.output_weight.data
    head[123, 5] = np.nan
    ids = np.random.default_rng(3).integers(0, WHOLE.vocab, 40)
    with Engine.open({"model": whole, "backend": "reference", "prefill": 16}) as eng:
        with pytest.raises(NonFiniteError) as info:
            eng.prefill(ids)
        assert (info.value.layer, info.value.position) == (None, 39)
        assert "output head, position 39: the logits holds nan (column 123)" in str(info.value)
        eng.reset()
        with pytest.raises(NonFiniteError) as info:
            eng.prefill(ids, all_logits=True)
        assert info.value.position == 0


def test_strata_run_names_the_prompt_file_and_writes_no_result(tmp_path, capsys):
    """End to end: exit 1, one line naming the prompt's file, the layer and the position; the
    JSON that would have held a wrong result is not written."""
    h = np.ones((3, 256), np.float32)
    h[1] = 3e38
    np.save(tmp_path / "h.npy", h)
    config = tmp_path / "run.yaml"
    config.write_text(
        "model:\n  synthetic: {n_layers: 2, hidden: 256, ffn: 256, n_experts: 4, top_k: 2, "
        "seed: 1}\nformat: iq3_xxs\nbackend: reference\nexpert_cache: 0\n"
        f"prompts: [{{hidden_file: {tmp_path / 'h.npy'}}}]\n"
        f"output: {{json: {tmp_path / 'out.json'}}}\n")
    assert main(["-q", "run", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("strata run: prompt 1/1 (3 tokens (h.npy)): prefill: layer 0, "
                             "position 1:")
    assert "Traceback" not in err[0]
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("argmax", [False, True])
def test_nan_logits_of_a_gguf_model_name_the_file(whole, tmp_path, argmax):
    """The logits' check named no file (`strata generate` said "prefill: output head, ..."),
    while a non-finite value inside a layer named the GGUF the weights came from."""
    from strata_rt.models.qwen3 import write_qwen3_gguf

    whole.dense.output_norm.data[212] = 3e38  # finite, as the loader checks; the logits not
    path = write_qwen3_gguf(tmp_path / "w.gguf", whole)
    ids = np.random.default_rng(3).integers(0, WHOLE.vocab, 40)
    with Engine.open({"model": {"gguf": str(path)}, "backend": "reference",
                      "prefill": 16}) as eng:
        with pytest.raises(NonFiniteError) as info:
            eng.prefill_argmax(ids) if argmax else eng.prefill(ids)
    assert str(info.value).startswith("prefill of w.gguf: output head, position 39: the "
                                      "logits holds "), str(info.value)
