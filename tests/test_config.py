"""Run-config validation: every error class names its key path, the value and what is allowed;
all problems come at once; the CLI turns them into exit code 2 without a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from strata_rt.cli import main
from strata_rt.config.run.run_config import Config, device_memory_plan, load_config
from strata_rt.errors import ConfigError, GGUFError
from strata_rt.formats.registry import registry
from strata_rt.runtime.memory import MIB
from strata_rt.schedule.planners.planner import STAGING_RING_SLOTS, walk_ring_slots
from strata_rt.schedule.vram.memory_plan import MemoryPlan, plan_memory

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))

GOOD = {
    "model": {"synthetic": {"n_layers": 4, "hidden": 512, "ffn": 256, "n_experts": 32,
                            "top_k": 4, "seed": 1}},
    "format": "iq3_xxs",
    "backend": "reference",
    "expert_cache": 32,
    "prompts": [200, 1100],
}


def write(tmp_path: Path, doc: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def with_(**changes) -> dict:
    doc = yaml.safe_load(yaml.safe_dump(GOOD))  # deep copy
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = doc
        for p in parents:
            node = node[p]
        if value is DROP:
            node.pop(key)
        else:
            node[key] = value
    return doc


DROP = object()


def problems(tmp_path: Path, doc: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, doc))
    return info.value.problems


def only(tmp_path: Path, doc: dict) -> str:
    found = problems(tmp_path, doc)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def any_host(monkeypatch) -> None:
    """Validation without the host memory check: the large configs' shapes on any machine
    (tests/test_bad_inputs.py checks the memory check itself)."""
    monkeypatch.setenv("STRATA_HOST_MEMORY_CHECK", "0")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_bundled_configs_validate(path: Path, any_host) -> None:
    cfg = load_config(path)
    assert cfg.prompts and cfg.spec.format in registry()
    if path.name.startswith("qwen3-30b"):
        assert (cfg.spec.n_layers, cfg.spec.n_experts, cfg.spec.top_k, cfg.spec.hidden,
                cfg.spec.ffn) == (48, 128, 8, 2048, 768)
        assert [p.tokens for p in cfg.prompts] == [254, 1030, 3866, 8179, 30118]
        want = cfg.spec.total_experts // (1 if "resident" in path.name else 4)
        assert cfg.resident_experts(registry()[cfg.spec.format]) == want


def test_good_config_fields(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, with_(prefill=512, ring_mib=8, seed=3,
                                            output={"dir": "out", "json": "r.json"})))
    assert cfg.prefill == 512 and cfg.ring_bytes == 8 * MIB and cfg.seed == 3
    assert cfg.output.json == (tmp_path / "out" / "r.json").resolve()
    assert cfg.spec.hidden == 512 and cfg.expert_cache == 32 and cfg.backend == "reference"


def test_unknown_keys_suggest_the_closest(tmp_path: Path) -> None:
    doc = with_(promts=[1])
    doc["model"]["synthetic"]["hiden"] = 512
    found = problems(tmp_path, doc)
    top = next(p for p in found if p.startswith("promts:"))
    assert "unknown key" in top and "did you mean `prompts`" in top
    nested = next(p for p in found if p.startswith("model.synthetic.hiden:"))
    assert "did you mean `hidden`" in nested


@pytest.mark.parametrize("change, path, words", [
    ({"model__synthetic__hidden": "512"}, "model.synthetic.hidden", "integer"),
    ({"model__synthetic__top_k": 4.0}, "model.synthetic.top_k", "integer"),
    ({"repeats": "two"}, "repeats", "integer"),
    ({"backend": "gpu"}, "backend", "auto, cuda, reference"),
    ({"prefill": "fast"}, "prefill", "`auto` or a chunk size"),
    ({"prompts": "200"}, "prompts", "a list of prompt lengths"),
    ({"prompts": [200, [1]]}, "prompts[1]", "expected one of"),
    ({"output": "out/"}, "output", "mapping"),
    ({"model__synthetic": [4, 512]}, "model.synthetic", "mapping"),
])
def test_wrong_types(tmp_path: Path, change: dict, path: str, words: str) -> None:
    msg = only(tmp_path, with_(**change))
    assert msg.startswith(f"{path}: got ") and words in msg, msg


@pytest.mark.parametrize("change, path", [
    ({"model__synthetic__n_layers": 0}, "model.synthetic.n_layers"),
    ({"model__synthetic__n_experts": -32}, "model.synthetic.n_experts"),
    ({"ring_mib": -1}, "ring_mib"),
    ({"ring_mib": 0}, "ring_mib"),
    ({"prompts": [200, 0]}, "prompts[1]"),
    ({"repeats": 0}, "repeats"),
    ({"prefill": 0}, "prefill"),
    ({"expert_cache": -1}, "expert_cache"),
])
def test_non_positive_sizes(tmp_path: Path, change: dict, path: str) -> None:
    value = next(iter(change.values()))
    msg = only(tmp_path, with_(**change))
    assert msg.startswith(f"{path}: got {value[-1] if isinstance(value, list) else value!r}")


def test_unknown_format_lists_the_loaded_ones(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(format="q7_z"))
    assert msg.startswith("format: got 'q7_z'")
    for name in registry().names():
        assert name in msg


def test_format_dims(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(model__synthetic__hidden=320))
    assert msg.startswith("model.synthetic:") and "320" in msg and "multiple" in msg


def test_top_k_above_n_experts(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(model__synthetic__top_k=40))
    assert msg.startswith("model.synthetic.top_k: got 40") and "n_experts (32)" in msg


def test_budget_keys_at_most_one(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(vram_reserve_mib=1024))
    assert msg.startswith("expert_cache / vram_reserve_mib / vram_budget_mib: got "
                          "{'expert_cache': 32, 'vram_reserve_mib': 1024}")
    assert "at most one" in msg and "none: `vram_reserve_mib: 512` on the CUDA" in msg


def test_no_budget_key_is_the_backends_default(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(with_(expert_cache=DROP)))
    cfg = load_config(path)
    assert (cfg.expert_cache, cfg.vram_reserve_mib, cfg.vram_budget_mib) == (None, None, None)


def test_expert_cache_bounds_and_all(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(expert_cache=129))
    assert msg.startswith("expert_cache: got 129") and "0..128" in msg
    assert load_config(write(tmp_path, with_(expert_cache="all"))).expert_cache == 128


def cuda_arena(cfg: Config) -> MemoryPlan:
    """The device arena CudaBackend._open allocates for cfg's engine config, on a device
    whose free memory is exactly the budget: BudgetError when it does not fit."""
    ecfg = cfg.engine_config(backend="cuda")
    fmt = registry()[cfg.spec.format].for_variant(None)  # the default variant, as Engine.open
    lay = fmt.layout(cfg.spec.hidden, cfg.spec.ffn)
    walk = walk_ring_slots(ecfg.ring_bytes, lay.slot_bytes,
                           max(1, cfg.spec.total_experts - ecfg.expert_cache))
    return plan_memory(cfg.spec, lay, fmt.activation, int(cfg.vram_budget_mib * MIB),
                       max(walk, STAGING_RING_SLOTS), ecfg.prefill, ecfg.expert_cache)


def test_budget_counts_the_variants_group_buffers(any_host, monkeypatch) -> None:
    """The budget is split with the group buffers of the variant the engine will run: the
    fp16 images of IQ3_XXS f16_gemm are ~5x the q8_1 kernels' byte-copy images."""
    cfg = load_config(next(p for p in CONFIGS if p.name == "qwen3-235b-a22b-stream.yaml"))
    fmt = registry()[cfg.spec.format]
    gemm = cfg.memory_plan(fmt)
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "f16_pipe")
    exact = cfg.memory_plan(fmt)
    assert gemm is not None and exact is not None
    f16 = fmt.for_variant("f16_gemm").layout(cfg.spec.hidden, cfg.spec.ffn)
    assert gemm.regions["gate_up_buf"] == 16 * f16.gate_up_image_bytes
    assert gemm.regions["gate_up_buf"] > 4 * exact.regions["gate_up_buf"]
    assert gemm.n_resident < exact.n_resident


def test_budget_that_cannot_hold_one_chunk(tmp_path: Path) -> None:
    doc = with_(expert_cache=DROP, vram_budget_mib=16, prefill=1100, ring_mib=8)
    msg = only(tmp_path, doc)
    assert msg.startswith("vram_budget_mib: got 16") and "1100-token chunk" in msg
    fmt = registry()["iq3_xxs"]
    need = device_memory_plan(load_config(write(tmp_path, with_(prefill=1100, ring_mib=8)))
                              .spec, fmt, 1100, 8 * MIB).total
    assert f"{need / MIB:.1f} MiB" in msg
    # just enough: the chunk fits and resident experts fill the rest, as the backend places them
    ok = load_config(write(tmp_path, with_(expert_cache=DROP, ring_mib=8,
                                           vram_budget_mib=need / MIB + 1)))
    arena = cuda_arena(ok)
    assert arena.total <= (need / MIB + 1) * MIB and arena.n_resident > 0
    # `prefill: auto` is resolved to the chunk the budget was checked for
    assert arena.tokens == ok.chunk_tokens() == 1100


def test_vram_budget_holds_what_the_cuda_backend_allocates(any_host) -> None:
    cfg = load_config(next(p for p in CONFIGS if p.name == "qwen3-235b-a22b-stream.yaml"))
    budget = int(cfg.vram_budget_mib * MIB)
    arena = cuda_arena(cfg)  # router and norm weights, every chunk buffer, the 1 GiB ring
    # auto: the chunk of the longest prompt (30,118 tokens) when the budget holds it
    assert arena.tokens == max(p.tokens for p in cfg.prompts) and arena.total <= budget
    slot = registry()[cfg.spec.format].layout(cfg.spec.hidden, cfg.spec.ffn).slot_bytes
    assert arena.total + slot > budget  # and the resident experts use the rest


def test_expert_cache_all_with_unknown_dims(tmp_path: Path) -> None:
    """An unreadable GGUF stops validation with the file's own problem, before the keys that
    depend on its dimensions (expert_cache: all) are looked at."""
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(GGUFError, match="junk.gguf"):
        load_config(write(tmp_path, with_(model={"gguf": "junk.gguf"}, expert_cache="all")))


def test_ring_smaller_than_one_slot(tmp_path: Path) -> None:
    msg = only(tmp_path, with_(ring_mib=0.1))
    assert msg.startswith("ring_mib: got 0.1") and "one expert slot" in msg


def test_model_needs_exactly_one_source(tmp_path: Path) -> None:
    both = with_(model__gguf="x.gguf")
    assert "exactly one of `gguf: PATH` or `synthetic:" in only(tmp_path, both)
    assert only(tmp_path, with_(model=DROP)).startswith("model: (missing)")


def test_missing_files_resolve_against_the_config_dir(tmp_path: Path) -> None:
    doc = with_(profile="nope.json", prompts=[{"file": "toks.txt"}, {"hidden_file": "h.npy"}])
    found = problems(tmp_path, doc)
    assert {p.split(":")[0] for p in found} == {"profile", "prompts[0].file",
                                                "prompts[1].hidden_file"}
    assert all(str(tmp_path) in p for p in found)


def test_prompt_files(tmp_path: Path) -> None:
    (tmp_path / "toks.txt").write_text("1, 2, 3\n3 2 1\n")
    np.save(tmp_path / "h.npy", np.ones((5, 512), np.float32))
    np.save(tmp_path / "bad.npy", np.ones((5, 100), np.float32))
    cfg = load_config(write(tmp_path, with_(prompts=[7, {"file": "toks.txt"},
                                                     {"hidden_file": "h.npy"}])))
    assert [p.tokens for p in cfg.prompts] == [7, 6, 5]
    h = cfg.prompts[1].hidden_states(512, cfg.seed)
    assert h.shape == (6, 512) and h.dtype == np.float32
    np.testing.assert_array_equal(h[0], h[5])  # token 1 twice, one embedding
    assert not np.array_equal(h[0], h[1])
    a = cfg.prompts[0].hidden_states(512, 0)
    np.testing.assert_array_equal(a, cfg.prompts[0].hidden_states(512, 0))
    msg = only(tmp_path, with_(prompts=[{"hidden_file": "bad.npy"}]))
    assert msg.startswith("prompts[0].hidden_file: got 'bad.npy'") and "[tokens, 512]" in msg


def test_bad_token_file_is_one_flat_problem(tmp_path: Path) -> None:
    (tmp_path / "toks.txt").write_text("1 2 three\n")
    msg = only(tmp_path, with_(prompts=[{"file": "toks.txt"}]))
    assert msg.startswith("prompts[0].file: got 'toks.txt'; unreadable: ")
    assert "token files hold integers" in msg
    assert "problem(s)" not in msg and "\n" not in msg


def test_every_problem_at_once(tmp_path: Path) -> None:
    doc = with_(format="nope", backend="gpu", repeats=-1, prompts=[0], colour="blue")
    doc["model"]["synthetic"]["ffn"] = "wide"
    found = problems(tmp_path, doc)
    keys = {p.split(":")[0] for p in found}
    assert keys >= {"format", "backend", "repeats", "prompts[0]", "colour",
                    "model.synthetic.ffn"}, found


def test_gguf_model(tmp_path: Path) -> None:
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model, MoESpec

    write_moe_gguf(tmp_path / "tiny.gguf", Model.synthetic(MoESpec(2, 256, 256, 4, 2), 0))
    doc = with_(model={"gguf": "tiny.gguf"}, expert_cache="all", prompts=[3])
    cfg = load_config(write(tmp_path, doc))
    assert cfg.gguf == tmp_path / "tiny.gguf" and cfg.spec.n_experts == 4
    assert cfg.expert_cache == 8
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(GGUFError, match="junk.gguf") as bad:  # exit 1, as `strata inspect`
        load_config(write(tmp_path, with_(model={"gguf": "junk.gguf"})))
    assert bad.value.exit_code == 1 and "GGUF" in str(bad.value)


@pytest.mark.parametrize("text, words", [
    ("model: [unclosed", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("", "the file is empty"),
])
def test_unreadable_files(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        load_config(path)
    assert "NoneType" not in str(info.value)


def test_config_path_that_is_a_directory(tmp_path: Path, capsys) -> None:
    assert main(["run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: 1 problem(s)" in err and "cannot read the config file" in err


def test_cli_prints_every_problem_and_exits_2(tmp_path: Path, capsys) -> None:
    doc = with_(format="nope", model__synthetic__hiden=3)
    code = main(["run", str(write(tmp_path, doc))])
    err = capsys.readouterr().err
    assert code == 2
    assert "format: got 'nope'" in err and "model.synthetic.hiden: unknown key" in err
    assert "2 problem(s)" in err and "Traceback" not in err
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "no such config file" in capsys.readouterr().err
    assert main(["run", str(write(tmp_path, GOOD)), "--prompts", "1,x"]) == 2
    assert "--prompts: got '1,x'" in capsys.readouterr().err
