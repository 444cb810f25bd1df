"""bench/bench_peer_llama.py on the CPU: the Q4_K_M rule, the files (written on a tiny shape by
the same path as the 30B ones, opened by the engine on the reference backend), llama-bench's
JSON and the best micro-batch, the tables, and whole runs against a stand-in llama-bench (a
script printing llama-bench's JSON), so the one GPU run meets no argument or format error."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _fake_llama import FIELDS, fake_llama  # noqa: E402
from peer_llama import files, llama, mixes, report  # noqa: E402
from peer_llama.files import TINY, Shape, ensure_file, vocab_for  # noqa: E402

from strata_rt.config.run.run_config import load_config  # noqa: E402
from strata_rt.models.qwen3 import write_qwen3_gguf  # noqa: E402
from strata_rt.weights.model import Model  # noqa: E402
from strata_rt.weights.whole_model import load_model  # noqa: E402

SCRIPT = ROOT / "bench" / "bench_peer_llama.py"
CONFIG = ROOT / "configs" / "qwen3-30b-a3b-whole.yaml"
TINY_SHAPE = Shape("tiny", TINY, {"tied": False, "dense_type": "F16"}, 1)
#: layers whose attn_v and ffn_down_exps Q4_K_M stores in Q6_K, of 48
MORE_BITS_48 = {0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41,
                42, 43, 44, 45, 46, 47}
def record(n_prompt: int, n_gen: int, n_ubatch: int, ts: float) -> dict[str, Any]:
    n = n_prompt + n_gen
    ns = int(n / ts * 1e9)
    return {**FIELDS, "n_prompt": n_prompt, "n_gen": n_gen, "n_ubatch": n_ubatch,
            "avg_ns": ns, "stddev_ns": 1000, "avg_ts": ts, "stddev_ts": 1.5,
            "samples_ns": [ns, ns], "samples_ts": [ts, ts]}


def as_llama_json(recs: list[dict[str, Any]]) -> str:
    """llama-bench's json printer: '[', objects of one field a line, ']'."""
    body = ",\n".join("  {\n" + ",\n".join(f'    "{k}": {json.dumps(v)}' for k, v in r.items())
                      + "\n  }" for r in recs)
    return "[\n" + body + "\n]\n"


# ---------------------------------------------------------------------- the Q4_K_M rule
def test_q4_k_m_rule_on_48_layers():
    down = {i for i in range(48) if mixes.q4km_type("ffn_down_exps", i, 48) == "Q6_K"}
    v = {i for i in range(48) if mixes.q4km_type("attn_v", i, 48) == "Q6_K"}
    assert down == v == MORE_BITS_48
    for i in range(48):
        for role in ("ffn_gate_exps", "ffn_up_exps", "attn_q", "attn_k", "attn_output"):
            assert mixes.q4km_type(role, i, 48) == "Q4_K"
        assert mixes.q4km_type("ffn_down_exps", i, 48) == ("Q6_K" if i in MORE_BITS_48
                                                           else "Q4_K")
    assert mixes.q4km_type("output", None, 48) == "Q6_K"
    assert mixes.q4km_type("token_embd", None, 48) == "Q4_K"
    for role in ("attn_norm", "attn_q_norm", "output_norm", "ffn_gate_inp"):
        assert mixes.q4km_type(role, 3, 48) == "F32"


def test_30b_plans_have_the_shapes_and_sizes_of_the_config():
    shape = files.shape_of(load_config(CONFIG), tiny=False)
    assert (shape.spec.n_layers, shape.spec.hidden, shape.spec.ffn, shape.spec.n_experts,
            shape.spec.top_k, shape.spec.vocab) == (48, 2048, 768, 128, 8, 151936)
    q4 = {t.name: t for t in shape.plan("q4km")}  # lazy: nothing is made
    assert q4["blk.8.ffn_down_exps.weight"].type == "Q6_K"
    assert q4["blk.9.ffn_down_exps.weight"].type == "Q4_K"
    assert q4["blk.9.attn_v.weight"].type == "Q4_K" and q4["output.weight"].type == "Q6_K"
    assert q4["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert q4["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert 17 * 2**30 < shape.data_bytes("q4km") < 17.5 * 2**30
    iq3 = {t.name: t for t in shape.plan("iq3")}
    assert iq3["blk.47.ffn_up_exps.weight"].type == "IQ3_XXS"
    assert iq3["blk.0.attn_q.weight"].type == "F16" and "output.weight" in iq3
    assert 13 * 2**30 < shape.data_bytes("iq3") < 13.5 * 2**30


# ---------------------------------------------------------------------- the files
def test_iq3_file_is_the_project_writers_file_byte_for_byte(tmp_path):
    got = ensure_file(tmp_path, TINY_SHAPE, "iq3")
    whole = load_model({"qwen3": TINY, "seed": 1, "format": "iq3_xxs", "tied": False,
                        "dense_type": "F16"})[1]
    ref = write_qwen3_gguf(tmp_path / "ref.gguf", whole, tokenizer=vocab_for(TINY))
    assert filecmp.cmp(ref, got.path, shallow=False)


@pytest.mark.parametrize("mix", ["iq3", "q4km"])
def test_tiny_files_open_as_stored_and_run_on_the_reference_backend(tmp_path, mix):
    from strata_rt.engine import Engine
    from strata_rt.text.tokenizer_vocab import TokenizerVocab

    path = ensure_file(tmp_path, TINY_SHAPE, mix).path
    moe = Model.from_gguf(path, None)
    names = [f.name for f in moe.formats.formats]
    if mix == "iq3":
        assert names == ["iq3_xxs", "iq3_xxs"]
    else:  # layer 0 plain Q4_K; layer 1 (>= 7/8 of 2 layers) keeps its down part in Q6_K
        assert names[0] == "q4_k" and "q6_k" in names[1]
    for layer in range(TINY.n_layers):
        for e in range(TINY.n_experts):
            for m in moe.dequantized(layer, e):
                assert np.isfinite(m).all() and 0 < float(np.std(m)) < 1
    assert 1.5 < float(np.std(moe.router)) * np.sqrt(TINY.hidden) < 2.5  # routing as synthetic
    assert len(TokenizerVocab.from_gguf(path)) == TINY.vocab  # what llama.cpp needs to load it
    with Engine.open({"model": {"gguf": str(path)}, "backend": "reference",
                      "context": 64}) as engine:
        logits, _ = engine.prefill(np.arange(12, dtype=np.int64) * 7 % TINY.vocab)
    assert logits.shape[-1] == TINY.vocab and np.isfinite(logits).all()


def test_a_file_is_reused_when_whole_and_rewritten_when_not(tmp_path):
    first = ensure_file(tmp_path, TINY_SHAPE, "q4km")
    assert not first.reused and first.path.is_file()
    assert not list(tmp_path.glob("*.partial-*"))
    again = ensure_file(tmp_path, TINY_SHAPE, "q4km")
    assert again.reused and again.bytes == first.bytes
    data = first.path.read_bytes()
    first.path.write_bytes(data[: len(data) // 2])  # cut short under its own name
    redone = ensure_file(tmp_path, TINY_SHAPE, "q4km")
    assert not redone.reused and "does not open" in redone.note
    assert first.path.read_bytes() == data  # seeded: the same bytes again


# ---------------------------------------------------------------------- llama-bench
def test_parser_reads_llama_bench_json_whole_cut_short_and_as_lines():
    recs = [record(254, 0, 512, 9000.0), record(254, 0, 2048, 9500.0),
            record(0, 32, 512, 150.0)]
    text = as_llama_json(recs)
    got = llama.parse_records(text)
    assert got == recs and got[0]["samples_ns"] == recs[0]["samples_ns"]
    cut = text[: text.rindex('"n_prompt"')]  # the last test never finished
    assert llama.parse_records(cut) == recs[:2]
    lines = "\n".join(json.dumps(r) for r in recs)  # -o jsonl
    assert llama.parse_records(lines) == recs
    assert llama.parse_records("") == [] and llama.parse_records("error: no model") == []


def test_best_micro_batch_per_prompt_and_the_decode_rate():
    recs = [record(1030, 0, 512, 8000.0), record(1030, 0, 2048, 10300.0),
            record(1030, 0, 8192, 9000.0), record(254, 0, 512, 5080.0),
            record(0, 32, 512, 150.0), {**record(1030, 0, 512, 99999.0), "n_depth": 512}]
    best = llama.best_prefill(recs)
    assert set(best) == {254, 1030}
    assert best[1030].n_ubatch == 2048 and best[1030].ms == pytest.approx(100.0)
    assert best[1030].by_ubatch == {512: pytest.approx(128.75), 2048: pytest.approx(100.0),
                                    8192: pytest.approx(1030 / 9000 * 1e3)}
    assert best[254].ms == pytest.approx(50.0)
    assert llama.decode_rate(recs) == 150.0
    no_ts = {**record(254, 0, 512, 1.0), "avg_ts": None, "avg_ns": 25_400_000}
    assert llama.best_prefill([no_ts])[254].ms == pytest.approx(25.4)  # from avg_ns


def test_commands_split_long_prompts_into_their_own_batch():
    cmds = llama.prefill_commands("llama-bench", Path("m.gguf"), 36,
                                  [254, 1030, 3866, 8179, 30118], 2)
    assert [" ".join(c) for c in cmds] == [
        "llama-bench -m m.gguf -ngl 99 -lm none -fa 1 -ncmoe 36 -p 254,1030,3866,8179 -n 0 "
        "-b 8192 -ub 512,2048,8192 -r 2 -o json",
        "llama-bench -m m.gguf -ngl 99 -lm none -fa 1 -ncmoe 36 -p 30118 -n 0 -b 30720 "
        "-ub 8192 -r 2 -o json"]
    assert " ".join(llama.decode_command("llama-bench", Path("m.gguf"), 0, 32, 2)) == \
        "llama-bench -m m.gguf -ngl 99 -lm none -fa 1 -ncmoe 0 -p 0 -n 32 -r 2 -o json"


def test_a_missing_program_and_a_timeout_are_errors_not_exceptions(tmp_path):
    inv = llama.run([str(tmp_path / "nope")], 5)
    assert inv.error and "cannot run" in inv.error and inv.records == []
    slow = fake_llama(tmp_path)
    inv = llama.run([str(slow), "-p", "254", "-n", "0", "-ub", "512"], 3,)
    assert inv.error is None and len(inv.records) == 1
    env_inv = _run_with_env({"FAKE_LLAMA_MODE": "slow"}, lambda: llama.run(
        [str(slow), "-p", "254,1030", "-n", "0", "-ub", "512"], 2))
    assert env_inv.error == "timed out after 2 s" and [r["n_prompt"] for r in
                                                        env_inv.records] == [254]


def _run_with_env(env: dict[str, str], fn: Any) -> Any:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------------- the tables
def test_tables_give_ratios_and_failures():
    regimes = {
        "quarter": {"prompts": [254, 30118],
                    "strata": {"prompts": [{"tokens": 254, "ms": 50.0},
                                           {"tokens": 30118, "error": "CudaError: oom"}],
                               "decode": {"tokens_per_s": 60.0}},
                    "llama": {"prefill": {254: {"ms": 125.0, "n_ubatch": 512}},
                              "errors": {30118: "timed out after 1800 s"}, "decode": 40.0}},
        "all": {"prompts": [254], "strata": {"prompts": [{"tokens": 254, "ms": 20.0}],
                                             "decode": {"error": "boom"}},
                "llama": {"prefill": {254: {"ms": 10.0, "n_ubatch": 2048}}, "errors": {},
                          "decode": 200.0}}}
    table = report.prefill_table(regimes, 36)
    head, _, r254, r30k = table.splitlines()
    assert "strata, 1/4 experts resident" in head and "llama.cpp --n-cpu-moe 36" in head
    assert "llama.cpp, all on GPU" in head
    cells = [c.strip() for c in r254.strip("|").split("|")]
    assert cells == ["254", "50.0", "125.0 (ub 512)", "2.50x", "20.0", "10.0 (ub 2048)",
                     "0.50x"]
    cells = [c.strip() for c in r30k.strip("|").split("|")]
    assert cells[1].startswith("failed: CudaError") and cells[2] == "failed: timed out after 1800 s"
    assert cells[3:] == ["-", "-", "-", "-"]
    dec = report.decode_table(regimes, 36).splitlines()
    assert [c.strip() for c in dec[2].strip("|").split("|")][1:] == ["60.0", "40.0", "1.50x"]
    assert "failed: boom" in dec[3] and "200.0" in dec[3]
    doc = {"file": {"name": "f.gguf", "bytes": 1 << 30, "mix": "iq3", "description": "d"},
           "hardware": "h", "command": "c", "n_cpu_moe": 36, "regimes": {"all": regimes["all"]},
           "llama_commands": [], "strata_configs": {}, "notes": []}
    assert "Decode (ratio" in report.markdown(doc)
    assert "Decode (ratio" not in report.markdown({**doc, "decode_steps": 0})


# ---------------------------------------------------------------------- the command
def _cli(args: list[str], tmp_path: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=full, timeout=300, check=False)


def test_help_teaches_the_flags(tmp_path):
    done = _cli(["--help"], tmp_path)
    assert done.returncode == 0
    for flag in ("--llama-bench", "--dry-run", "--files", "--prompts", "--regimes",
                 "--skip-llama", "--skip-strata", "--reps", "--dir", "--out", "--timeout",
                 "-ncmoe", "Q4_K_M"):
        assert flag in done.stdout
    assert _cli([], tmp_path).returncode == 2  # no llama-bench named, no --skip-llama


def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path):
    marker = tmp_path / "pycuda-imported"
    fake = tmp_path / "site" / "pycuda"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = _cli(["--dry-run", "--dir", str(tmp_path / "files"), "--out",
                 str(tmp_path / "out"), "--llama-bench", "bin/llama-bench"], tmp_path,
                {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])})
    assert done.returncode == 0, done.stderr
    assert "bin/llama-bench -m " in done.stdout and "-ncmoe 36 -p 254,1030,3866,8179" in done.stdout
    assert "-p 30118 -n 0 -b 30720 -ub 8192" in done.stdout and '"expert_cache": 1536' in done.stdout
    assert '"expert_cache": "all"' in done.stdout
    assert not (tmp_path / "files").exists() and not (tmp_path / "out").exists()
    assert not marker.exists()


def test_a_whole_tiny_run_against_a_stand_in_llama_bench(tmp_path):
    exe = fake_llama(tmp_path)
    common = ["--shape", "tiny", "--backend", "reference", "--prompts", "8,40", "--reps", "1",
              "--warmups", "0", "--decode-steps", "2", "--files", "q4km", "--dir",
              str(tmp_path / "files"), "--llama-bench", str(exe)]
    done = _cli(common + ["--out", str(tmp_path / "ok")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (js,) = (tmp_path / "ok").glob("peer-llama-tiny-q4km-*.json")
    doc = json.loads(js.read_text())
    quarter = doc["regimes"]["quarter"]
    assert quarter["llama"]["prefill"]["40"]["n_ubatch"] == 8192  # the fastest micro-batch
    assert [p["tokens"] for p in quarter["strata"]["prompts"]] == [8, 40]
    assert doc["regimes"]["all"]["strata"]["resident"] == TINY.n_layers * TINY.n_experts
    assert quarter["strata"]["resident"] == TINY.n_layers * TINY.n_experts // 4
    md = js.with_suffix(".md").read_text()
    assert "x |" in md and "llama-bench -m tiny-qwen3moe-q4km.gguf" in md
    recorded = [line for line in md.splitlines() if not line.startswith("`python ")]
    assert not any(str(tmp_path) in line for line in recorded)  # only the command typed
    failed = _cli(common + ["--out", str(tmp_path / "bad"), "--skip-strata"], tmp_path,
                  {"FAKE_LLAMA_MODE": "fail"})
    assert failed.returncode == 1 and "Traceback" not in failed.stdout + failed.stderr
    (md_bad,) = (tmp_path / "bad").glob("*.md")
    text = md_bad.read_text()
    assert "failed: exit code 3" in text
    row8 = next(line for line in text.splitlines() if line.startswith("|      8 |"))
    assert "(ub 512)" in row8
