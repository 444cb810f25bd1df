"""Config keys of a whole model: which keys make a synthetic model whole, what is refused, the
KV context, and the budget that counts the dense part first."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_config import DROP, GOOD, only, problems, with_, write

from strata_rt.config.run.run_config import load_config
from strata_rt.formats.registry import registry
from strata_rt.models.qwen3 import TINY_SPEC, Qwen3Model, write_qwen3_gguf
from strata_rt.models.qwen3.whole_memory import (
    DenseLayout,
    DenseTypes,
    WholeSizing,
    kv_bytes,
)
from strata_rt.runtime.memory import MIB
from strata_rt.schedule.vram.memory_plan import plan_memory

WHOLE = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "vocab": 500}


def whole(**changes) -> dict:
    doc = with_(**changes)
    doc["model"]["synthetic"].update({k: v for k, v in WHOLE.items()
                                      if k not in doc["model"]["synthetic"]})
    return doc


def test_whole_keys_make_a_whole_model(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, whole(context=1500)))
    assert cfg.whole is not None and cfg.whole.vocab == 500 and cfg.whole.n_heads == 4
    assert cfg.whole.hidden == GOOD["model"]["synthetic"]["hidden"]
    assert cfg.context == 1500 and cfg.whole_sizes is not None
    assert (cfg.whole_sizes.spec, cfg.whole_sizes.context) == (cfg.whole, 1500)
    ecfg = cfg.engine_config()
    assert ecfg.model["qwen3"] == cfg.whole and ecfg.context == 1500
    moe_only = load_config(write(tmp_path, GOOD))
    assert moe_only.whole is None and moe_only.engine_config().model.keys() == {"spec", "seed"}


def test_partial_whole_keys_are_refused(tmp_path: Path) -> None:
    doc = with_()
    doc["model"]["synthetic"].update(n_heads=4, vocab=500)
    msg = only(tmp_path, doc)
    assert "needs all of n_heads, n_kv_heads, head_dim, vocab" in msg
    assert "missing n_kv_heads, head_dim" in msg
    doc = with_()
    doc["model"]["synthetic"]["rope_theta"] = 1e6
    assert "only for a whole model" in only(tmp_path, doc)


def test_bad_whole_values(tmp_path: Path) -> None:
    found = problems(tmp_path, whole(model__synthetic__n_kv_heads=3,
                                     model__synthetic__dense_type="Q4_X",
                                     model__synthetic__pool_layers=0))
    text = "\n".join(found)
    assert "n_heads=4 is not a multiple of n_kv_heads=3" in text
    assert "dense_type: got 'Q4_X'; allowed: F32, F16, BF16, Q8_0" in text
    assert "pool_layers: got 0" in text


def test_context_key(tmp_path: Path) -> None:
    assert "only for a whole model" in only(tmp_path, with_(context=100))
    assert "expected KV-cache positions" in only(tmp_path, whole(context=0))


def test_whole_keys_on_a_moe_only_gguf_name_the_file(tmp_path: Path) -> None:
    """A whole model's keys on a GGUF of MoE layers alone (a whole model's file whose
    embedding name was damaged, or the wrong file): one line names the file and what it
    lacks, beside each key's own line."""
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model, MoESpec

    write_moe_gguf(tmp_path / "m.gguf", Model.synthetic(MoESpec(2, 256, 256, 8, 2), 3,
                                                        "iq3_xxs"))
    doc = with_(model={"gguf": "m.gguf"}, expert_cache=4, context=64,
                generate={"tokens": 2})
    found = problems(tmp_path, doc)
    assert found[0] == (f"model.gguf: got 'm.gguf'; the file holds MoE layers alone (no "
                        f"token_embd.weight tensor), so context and generate cannot apply: a "
                        f"whole model's file has one ({tmp_path / 'm.gguf'})"), found
    assert any(f.startswith("context: got 64; only for a whole model") for f in found)
    assert len(found) == 3, found
    doc.pop("context"), doc.pop("generate")
    load_config(write(tmp_path, doc))  # the same file without those keys is a config


def test_whole_model_refuses_hidden_state_prompts(tmp_path: Path) -> None:
    import numpy as np

    np.save(tmp_path / "h.npy", np.zeros((3, 512), np.float32))
    msg = only(tmp_path, whole(prompts=[{"hidden_file": "h.npy"}]))
    assert "a whole model takes tokens" in msg


def test_token_files_are_checked_against_the_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "ids.txt").write_text("1 2 499 500\n")
    msg = only(tmp_path, whole(prompts=[{"file": "ids.txt"}]))
    assert "500" in msg


def test_whole_gguf_is_detected(tmp_path: Path) -> None:
    path = write_qwen3_gguf(tmp_path / "tiny.gguf", Qwen3Model.synthetic(TINY_SPEC, 1, "fp16"))
    doc = {"model": {"gguf": str(path)}, "format": "fp16", "backend": "reference",
           "expert_cache": 0, "prompts": [3]}
    cfg = load_config(write(tmp_path, doc))
    assert cfg.whole == TINY_SPEC and cfg.engine_config().model["gguf"] == str(path)


def test_budget_counts_dense_weights_kv_and_head_first(tmp_path: Path) -> None:
    """Under vram_budget_mib a whole model's dense slots, head, RoPE tables and KV cache come
    out of the budget before any expert is made resident."""
    fmt = registry()["iq3_xxs"]
    budget = 90
    cfg = load_config(write(tmp_path, whole(expert_cache=DROP, vram_budget_mib=budget,
                                            context=1024, prefill=256, prompts=[200, 1000],
                                            model__synthetic__vocab=4000,
                                            model__synthetic__dense_type="Q8_0")))
    moe = load_config(write(tmp_path, with_(expert_cache=DROP, vram_budget_mib=budget,
                                            prefill=256)))
    plan, moe_plan = cfg.memory_plan(fmt), moe.memory_plan(fmt)
    assert plan is not None and moe_plan is not None
    spec = cfg.whole
    assert cfg.whole_types == DenseTypes.uniform(spec.n_layers, "Q8_0")
    assert not plan.dense_stream
    assert plan.regions["dense"] == DenseLayout.of(spec, cfg.whole_types).resident_bytes
    assert plan.regions["kv"] == kv_bytes(spec, 1024)
    assert plan.regions["head"] == spec.vocab * spec.hidden // 32 * 34  # Q8_0, as stored
    # the fp16 scratch holds the largest decoded matrix: here the head (one slice of 4,000)
    assert plan.regions["dense_scratch"] == spec.vocab * spec.hidden * 2
    slot = fmt.layout(spec.hidden, spec.ffn).slot_bytes
    assert 0 < plan.n_resident < moe_plan.n_resident
    # the experts fill what the dense part left: one more would not fit
    assert plan.total <= budget * MIB < plan.total + 2 * slot


def test_plan_memory_without_whole_is_unchanged() -> None:
    from strata_rt.weights.model import MoESpec

    spec = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=8, top_k=2, format="fp16")
    fmt = registry()["fp16"]
    lay = fmt.layout(256, 256)
    a = plan_memory(spec, lay, fmt.activation, 1 << 40, 8, 64, 0)
    b = plan_memory(spec, lay, fmt.activation, 1 << 40, 8, 64, 0,
                    whole=WholeSizing(TINY_SPEC, DenseTypes.uniform(TINY_SPEC.n_layers, "F16"),
                                      128))
    assert set(b.regions) - set(a.regions) >= {"dense", "kv", "head", "qkv", "attn_out",
                                               "dense_scratch"}
    assert all(b.regions[k] == v for k, v in a.regions.items())


@pytest.mark.parametrize("name", ["tiny-qwen3moe.yaml", "qwen3-30b-a3b-whole.yaml",
                                  "qwen3-235b-a22b-whole.yaml",
                                  "qwen3-235b-a22b-whole-16g.yaml"])
def test_bundled_whole_configs(name: str, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_HOST_MEMORY_CHECK", "0")
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / name)
    assert cfg.whole is not None
    if "235b" in name:
        plan = cfg.memory_plan(registry()[cfg.spec.format])
        budget = cfg.vram_budget_mib
        assert plan is not None and budget is not None
        assert plan.n_resident > 0 and plan.total <= budget * MIB
        # 16 GiB cannot hold the 13.4 GiB of dense weights beside a chunk: they stream, and
        # the engine is told so (in free VRAM `auto` would keep them resident past the budget)
        assert plan.dense_stream == (budget < 20000)
        ecfg = cfg.engine_config()
        assert ecfg.dense == ("stream" if budget < 20000 else "resident")
        assert ecfg.expert_cache == plan.n_resident and ecfg.prefill == plan.tokens
        assert cfg.whole is not None and (cfg.context or 0) >= 30118


def test_auto_streams_the_dense_weights_only_when_they_do_not_fit() -> None:
    """dense: auto keeps them resident while the budget holds them beside one chunk, and
    streams them through DENSE_RING_SLOTS slots once it does not; resident refuses then."""
    from dataclasses import replace

    from strata_rt.errors import BudgetError
    from strata_rt.schedule.planners.dense_schedule import DENSE_RING_SLOTS
    from strata_rt.weights.model import MoESpec

    six = replace(TINY_SPEC, n_layers=6)
    spec = six.moe_spec("fp16")
    fmt = registry()["fp16"]
    lay = fmt.layout(spec.hidden, spec.ffn)
    types = DenseTypes.uniform(six.n_layers, "Q8_0")
    w = WholeSizing(six, types, 256)
    big = plan_memory(spec, lay, fmt.activation, 1 << 40, 8, 64, 0, whole=w)
    assert not big.dense_stream
    streamed = plan_memory(spec, lay, fmt.activation, 1 << 40, 8, 64, 0, whole=w,
                           dense="stream")
    slot = DenseLayout.of(six, types).slot_bytes
    assert streamed.dense_stream and streamed.regions["dense"] == DENSE_RING_SLOTS * slot
    tight = streamed.total + 1024  # holds the streamed plan, not the resident one
    assert big.total > tight
    auto = plan_memory(spec, lay, fmt.activation, tight, 8, 64, 0, whole=w)
    assert auto.dense_stream and auto.total <= tight
    with pytest.raises(BudgetError):
        plan_memory(spec, lay, fmt.activation, tight, 8, 64, 0, whole=w, dense="resident")
    assert isinstance(spec, MoESpec)


def test_host_memory_counts_a_whole_models_parts(monkeypatch) -> None:
    """The host check adds the dense weights as generated (none for a GGUF's, which stay in the
    file's map) and the pinned dense slots when they stream (in the stored types: no head is
    converted on the host); the 235B configs name them when the host is too small."""
    from strata_rt.config.run.whole import whole_host_parts
    from strata_rt.errors import ConfigError

    spec = TINY_SPEC
    t32, t16 = (DenseTypes.uniform(spec.n_layers, t) for t in ("F32", "F16"))
    f32 = whole_host_parts(spec, {"dense_type": "F32"}, t32, False, False)
    f16 = whole_host_parts(spec, {"dense_type": "F16"}, t16, False, False)
    assert f32["dense weights"] == 2 * f16["dense weights"] > 0
    assert set(f32) == {"dense weights"}
    pooled = whole_host_parts(spec, {"dense_type": "F32", "pool_layers": 1}, t32, False, False)
    assert pooled["dense weights"] < f32["dense weights"]
    assert "dense weights" not in whole_host_parts(spec, {}, t16, True, False)
    streamed = whole_host_parts(spec, {}, t16, True, True)
    assert streamed["pinned dense slots"] == (spec.n_layers
                                              * DenseLayout.of(spec, t16).slot_bytes)
    assert whole_host_parts(None, {}, None, False, True) == {}
    from strata_rt.config import hostmem

    monkeypatch.delenv("STRATA_HOST_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(hostmem, "available",
                        lambda: hostmem.Available(96 << 30, "a 96 GiB test host"))
    path = Path(__file__).resolve().parent.parent / "configs" / "qwen3-235b-a22b-whole-16g.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = "\n".join(info.value.problems)
    assert "pinned dense slots 12.5 GiB" in text and "output head conversion" not in text
