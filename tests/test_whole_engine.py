"""A whole Qwen3-MoE model through the Engine (reference backend): logits against Hugging Face
transformers' golden logits, the KV cache across calls, chunking byte for byte, and the plans
(each layer opens with its Attention op; STRATA_CHECK_PLAN accepts them)."""

from __future__ import annotations

import numpy as np
import pytest
from test_qwen3_reference import FIXTURES, GOLDEN, PARITY_NMSE, build_case

from strata_rt.engine import Engine
from strata_rt.errors import ConfigError
from strata_rt.formats.numerics import nmse
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Reference, Qwen3Spec, write_qwen3_gguf
from strata_rt.schedule.plan import Attention, LayerBegin

#: small enough for 1,100-token prompts on the reference backend in seconds
SMALL = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                  ffn=256, n_experts=8, top_k=2, context=2048)


def _open(model, prefill=64, **kw) -> Engine:
    return Engine.open({"model": model, "backend": "reference", "prefill": prefill, **kw})


@pytest.fixture(scope="module")
def small() -> Qwen3Model:
    return Qwen3Model.synthetic(SMALL, 5, "iq3_xxs")


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_engine_logits_match_transformers(name, tmp_path):
    """Through a GGUF written by our writer and opened by path, every position's logits match
    transformers' within the parity bound, and the argmax everywhere."""
    case = GOLDEN["cases"][name]
    path = write_qwen3_gguf(tmp_path / f"{name}.gguf", build_case(case))
    ids = np.load(FIXTURES / f"{name}.ids.npy")
    want = np.load(FIXTURES / f"{name}.logits.npy")
    with _open({"gguf": str(path), "format": case["format"]}, prefill=16) as eng:
        assert eng.whole is not None and eng.qwen3_spec == eng.whole.spec
        got, stats = eng.prefill(ids, all_logits=True)
        assert got.shape == want.shape and got.dtype == np.float32
        worst = max(nmse(got[t], want[t]) for t in range(len(ids)))
        assert worst <= PARITY_NMSE, (name, worst)
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        assert stats.tokens == len(ids) and stats.chunks == -(-len(ids) // 16)
        assert eng.kv_length == len(ids)
        eng.reset()
        last, _ = eng.prefill(ids)
        assert np.array_equal(last, got[-1])


def test_chunking_gives_identical_bytes_below_and_above_1024(small):
    """A 1,100-token prompt in one chunk, in chunks of 333, and in calls split at odd places
    (the KV cache carried between calls): the same logits byte for byte."""
    ids = np.random.default_rng(1).integers(0, SMALL.vocab, 1100)
    with _open(small, prefill=1100) as eng:
        whole, _ = eng.prefill(ids, all_logits=True)
    with _open(small, prefill=333) as eng:
        chunked, _ = eng.prefill(ids, all_logits=True)
        eng.reset()
        parts = [eng.prefill(ids[a:b], all_logits=True)[0]
                 for a, b in [(0, 1), (1, 7), (7, 1030), (1030, 1100)]]
    assert np.array_equal(whole, chunked)
    assert np.array_equal(whole, np.concatenate(parts))


def test_engine_equals_the_numpy_model_with_fp16_experts():
    """With FP16 experts the engine's MoE products differ from Qwen3Reference's float32 experts
    only by the fp16 activations: the logits agree closely and pick the same tokens."""
    model = Qwen3Model.synthetic(SMALL, 3, "fp16")
    ids = np.random.default_rng(2).integers(0, SMALL.vocab, 70)
    want = Qwen3Reference(model).prefill(ids, all_logits=True)
    with _open(model) as eng:
        got, _ = eng.prefill(ids, all_logits=True)
    assert nmse(got, want) < 1e-6
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.99


def test_plans_open_each_layer_with_attention(small, monkeypatch):
    """Staging (a few tokens), walk (many) and decode (one token) plans all carry an Attention
    op before each layer's routing, at the chunk's position (decode: None, the position is
    read on the device), and the hazard checker accepts them."""
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    ids = np.random.default_rng(3).integers(0, SMALL.vocab, 302)
    with _open(small, prefill=200) as eng:
        eng.prefill(ids[:2])  # two tokens route at most 4 of 8 experts: the staging ring
        staged = eng.driver.last_plan
        eng.prefill(ids[2:301])  # chunks of 200 and 99 at positions 2 and 202
        walked = eng.driver.last_plan
        eng.prefill(ids[301:])  # one token: the decode plan
        decoded = eng.driver.last_plan
    for plan, start in ((staged, 0), (walked, 202), (decoded, None)):
        assert plan is not None
        for lp in plan.layers:
            kinds = [type(op) for op in lp.ops]
            assert Attention in kinds and kinds.index(Attention) < kinds.index(LayerBegin)
            att = next(op for op in lp.ops if isinstance(op, Attention))
            assert att.layer == lp.layer and att.start == start
    assert staged.mode == "staging" and walked.mode == "walk" and decoded.mode == "decode"


def test_context_limits_and_bad_token_ids(small):
    with _open(small) as eng:
        eng.prefill(np.arange(2000) % SMALL.vocab)
        with pytest.raises(ConfigError, match="exceed the context of 2048"):
            eng.prefill(np.zeros(49, np.int64))
        assert eng.kv_length == 2000  # a refused call changes nothing
        eng.reset()
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            eng.prefill(np.array([1, SMALL.vocab]))
        with pytest.raises(ConfigError, match="non-empty 1-D integer"):
            eng.prefill(np.zeros((2, 3), np.int64))
        with pytest.raises(ConfigError, match="non-empty 1-D integer"):
            eng.prefill(np.zeros(0, np.int64))
        assert eng.kv_length == 0


def test_moe_only_engine_refuses_all_logits():
    from strata_rt.weights.model import MoESpec

    spec = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=4, top_k=2, format="fp16")
    with _open({"spec": spec, "seed": 0}) as eng:
        assert eng.whole is None and eng.qwen3_spec is None
        with pytest.raises(ConfigError, match="all_logits needs a whole model"):
            eng.prefill(np.zeros((3, 256), np.float32), all_logits=True)


def test_named_synthetic_model_and_its_tokenizer():
    pytest.importorskip("tokenizers")
    with _open({"qwen3": "tiny", "seed": 1, "format": "fp16"}) as eng:
        tok = eng.tokenizer()
        assert len(tok) == eng.qwen3_spec.vocab
        ids = tok.encode("hello world")
        logits, _ = eng.prefill(ids)
        assert logits.shape == (eng.qwen3_spec.vocab,) and np.isfinite(logits).all()


def test_strata_run_on_the_tiny_whole_model(tmp_path, capsys):
    """`strata run` prefills a whole model's prompts from an empty cache each time (seeded
    token ids) and reports them; the JSON carries every run."""
    import json
    from pathlib import Path

    from strata_rt.cli import main

    config = Path(__file__).resolve().parent.parent / "configs" / "tiny-qwen3moe.yaml"
    out = tmp_path / "run.json"
    assert main(["-q", "run", str(config), "--backend", "reference", "--prompts", "5,40",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "whole model: 4 query / 2 KV heads of 64, vocab 512" in text
    runs = json.loads(out.read_text())["runs"]
    assert [r["tokens"] for r in runs] == [5, 40]
    assert all(r["stats"]["chunks"] == 1 for r in runs)


def test_streamed_dense_weights_give_the_same_bytes_and_check_clean(small, monkeypatch):
    """dense: stream plans a DenseCopy per layer through a 2-slot ring ahead of its Attention;
    the hazard checker accepts the plans and the logits are the resident run's bytes."""
    from strata_rt.schedule.plan import DenseCopy

    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    ids = np.random.default_rng(4).integers(0, SMALL.vocab, 260)
    with _open(small, prefill=200) as eng:
        want, _ = eng.prefill(ids, all_logits=True)
    with _open(small, prefill=200, dense="stream") as eng:
        first, _ = eng.prefill(ids[:1], all_logits=True)  # staging
        rest, _ = eng.prefill(ids[1:], all_logits=True)   # walks
        plan = eng.driver.last_plan
    assert np.array_equal(np.concatenate([first, rest]), want)
    assert plan is not None
    copies = [op for lp in plan.layers for op in lp.ops if isinstance(op, DenseCopy)]
    assert [(c.layer, c.slot) for c in copies] == [(i, i % 2) for i in range(SMALL.n_layers)]
    atts = [op for lp in plan.layers for op in lp.ops if isinstance(op, Attention)]
    assert [a.dense_slot for a in atts] == [i % 2 for i in range(SMALL.n_layers)]


def test_checker_rejects_a_dense_slot_overwritten_too_early():
    """Dropping the copy stream's wait for an Attention's dense_used record is a hazard, and
    so is an Attention that does not wait for its copy."""
    from strata_rt.errors import PlanHazardError
    from strata_rt.schedule import hazards
    from strata_rt.schedule.plan import LayerPlan, Wait
    from strata_rt.schedule.planners.dense_schedule import DenseSchedule

    sched = DenseSchedule(n_layers=4, start=0, ring=2)
    ops = sched.chunk_ops() + [op for layer in range(4) for op in sched.layer_ops(layer)]
    hazards.check(LayerPlan(0, tuple(ops)), ring_slots=1)  # as planned: clean
    bad = [op for op in ops if not (isinstance(op, Wait) and op.stream == "copy")]
    with pytest.raises(PlanHazardError, match="may overwrite it while"):
        hazards.check(LayerPlan(0, tuple(bad)), ring_slots=1)
    no_wait = [op for op in ops if not (isinstance(op, Wait) and op.stream == "compute")]
    with pytest.raises(PlanHazardError, match="may run before"):
        hazards.check(LayerPlan(0, tuple(no_wait)), ring_slots=1)
