"""The acceptance test of the batched gather on whole models: one gather launch per expert
(STRATA_PREFILL_GATHER_ONE=1) and one per group (=0) must give the same bytes.

For prompts of 128 to 9,200 tokens, each with its own seeded ids (no two share a first line of
tokens, so no prompt reuses another's cache), both arms run in one open engine, each prompt from
an empty KV cache: the residual dump (STRATA_PREFILL_DUMP_R, every 64th position of every
chunk's output) must be byte-identical between the arms, and so must the 24 greedy tokens after
each prompt. On the GPU: the tiny whole-model config and the Qwen3-30B-A3B shape with a quarter
of its experts resident (`-k 30b` selects that one alone, `-k "not 30b"` leaves it out). The
same procedure runs on the reference backend with shorter prompts, and a check that it notices
a difference, so the logic is tested where there is no GPU.

The engine's dump file is emptied when it opens and every prefill (decode steps included)
appends to it, so each prompt's part is the bytes its own prefill appended.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from strata_rt.cli.run import set_switch
from strata_rt.config.run.run_config import load_config
from strata_rt.engine import Engine, read_dump
from strata_rt.text.generate import EngineSession, greedy_after

ROOT = Path(__file__).resolve().parent.parent
SWITCH = "STRATA_PREFILL_GATHER_ONE"
#: one launch per expert first, then per group, for every prompt
ARMS = ("1", "0")
LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 9200)
GREEDY_TOKENS = 24
#: the first tokens no two prompts may share (a prompt's own first line)
FIRST_LINE = 16
#: positions of a dump record (engine.DUMP_STRIDE): every 64th of each prompt
DUMP_STRIDE = 64


def acceptance_prompts(lengths: tuple[int, ...], vocab: int, seed: int = 0
                       ) -> list[np.ndarray]:
    """Seeded token ids per length, none starting with another's first FIRST_LINE tokens."""
    prompts = [np.random.default_rng([seed, n, 0xACC]).integers(0, vocab, n, dtype=np.int64)
               for n in lengths]
    firsts = {tuple(p[:FIRST_LINE]) for p in prompts}
    assert len(firsts) == len(prompts), "two prompts share their first line"
    return prompts


@dataclass
class ArmRun:
    """One prompt in one arm: what its prefill appended to the dump, the greedy ids after
    it, its gather launches and its prefill time."""

    dump: bytes
    greedy: list[int]
    gathers: int
    prefill_s: float


def _appended(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def run_both_arms(engine: Engine, prompts: list[np.ndarray], dump: Path
                  ) -> dict[str, list[ArmRun]]:
    """Every prompt in both arms (ARMS order) in the one open engine, each from an empty
    cache, with GREEDY_TOKENS greedy tokens after it (no EOS stop: always all of them)."""
    session = EngineSession(engine)
    runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
    for ids in prompts:
        for arm in ARMS:
            set_switch(engine, SWITCH, arm)
            engine.reset()
            start = dump.stat().st_size if dump.exists() else 0
            t0 = time.perf_counter()
            logits, stats = engine.prefill(ids)
            took = time.perf_counter() - t0
            appended = _appended(dump, start)
            result = greedy_after(session, logits, GREEDY_TOKENS, None)
            runs[arm].append(ArmRun(appended, list(result.ids), stats.gathers_launched, took))
            print(f"{len(ids):>6} tokens, {SWITCH}={arm}: prefill {took * 1e3:8.1f} ms, "
                  f"{stats.gathers_launched} gather launches, greedy {result.ids[:6]}...")
    return runs


def check_arms(runs: dict[str, list[ArmRun]], prompts: list[np.ndarray], hidden: int,
               scratch: Path) -> None:
    """The acceptance conditions, per prompt: the arms ran different gathers, their dumps hold
    every 64th position, finite and the same bytes, and their greedy tokens are the same."""
    for i, ids in enumerate(prompts):
        one, batch = runs[ARMS[0]][i], runs[ARMS[1]][i]
        n = len(ids)
        assert one.gathers > batch.gathers, (n, "the arms launched the same gathers: the "
                                             "switch did not take", one.gathers, batch.gathers)
        scratch.write_bytes(one.dump)
        pos, h = read_dump(scratch, hidden)
        assert list(pos) == list(range(0, n, DUMP_STRIDE)), (n, pos[:4], len(pos))
        assert np.isfinite(h).all() and np.abs(h).max() > 0, n
        assert one.dump == batch.dump, f"{n} tokens: the residual dumps differ between arms"
        assert len(one.greedy) == GREEDY_TOKENS, (n, one.greedy)
        assert one.greedy == batch.greedy, (n, one.greedy, batch.greedy)


def _acceptance(engine: Engine, lengths: tuple[int, ...], dump: Path, scratch: Path
                ) -> dict[str, list[ArmRun]]:
    spec = engine.qwen3_spec
    assert spec is not None
    assert engine.context_tokens >= max(lengths) + GREEDY_TOKENS
    prompts = acceptance_prompts(lengths, spec.vocab)
    t0 = time.perf_counter()
    runs = run_both_arms(engine, prompts, dump)
    print(f"both arms of {len(lengths)} prompts in {time.perf_counter() - t0:.1f} s")
    check_arms(runs, prompts, spec.hidden, scratch)
    return runs


@pytest.fixture
def dump_env(tmp_path, monkeypatch) -> Path:
    """STRATA_PREFILL_DUMP_R set for the engines of the test; the switch restored after."""
    dump = tmp_path / "r.bin"
    monkeypatch.setenv("STRATA_PREFILL_DUMP_R", str(dump))
    monkeypatch.setenv(SWITCH, ARMS[0])  # set_switch writes os.environ; this restores it
    return dump


def _engine(config: str, backend: str, context: int | None = None, prefill: int | None = None
            ) -> Engine:
    cfg = load_config(ROOT / "configs" / config)
    ecfg = cfg.engine_config(backend=backend)
    assert ecfg.dump_r is None  # taken from the environment, as a user would set it
    if context is not None:
        ecfg.context = context
    if prefill is not None:
        ecfg.prefill = prefill
    return Engine.open(ecfg)


@pytest.mark.gpu
def test_acceptance_tiny_whole_model_gpu(dump_env, tmp_path):
    # the tiny model's own context is 4,096 positions: the KV cache is sized for the longest
    with _engine("tiny-qwen3moe.yaml", "cuda", context=max(LENGTHS) + GREEDY_TOKENS) as eng:
        _acceptance(eng, LENGTHS, dump_env, tmp_path / "one.bin")


@pytest.mark.gpu
def test_acceptance_qwen3_30b_quarter_resident_gpu(dump_env, tmp_path):
    """The whole Qwen3-30B-A3B shape (seeded), 1,536 of 6,144 experts resident, chunks of
    8,192 (the 9,200-token prompt takes two, the second attending over the first's cache)."""
    t0 = time.perf_counter()
    with _engine("qwen3-30b-a3b-whole.yaml", "cuda") as eng:
        print(f"opened in {time.perf_counter() - t0:.1f} s; {eng.residency.count} resident")
        assert eng.residency.count * 4 == eng.model.spec.total_experts
        _acceptance(eng, LENGTHS, dump_env, tmp_path / "one.bin")


# ---------------------------------------------------------------- without a GPU
def test_acceptance_procedure_on_the_reference_backend(dump_env, tmp_path):
    """The same procedure on the tiny config with shorter prompts and chunks of 256, so a dump
    spans chunks and a prompt attends over the cache of its earlier chunks."""
    lengths = (128, 300, 700)
    with _engine("tiny-qwen3moe.yaml", "reference", prefill=256) as eng:
        runs = _acceptance(eng, lengths, dump_env, tmp_path / "one.bin")
    # the file holds every prefill of the engine: the prompts' parts and the decode steps'
    # (position 128 is the first new token after the 128-token prompt)
    prompt_parts = sum(len(r.dump) for arm in ARMS for r in runs[arm])
    assert dump_env.stat().st_size > prompt_parts


def test_check_arms_notices_a_difference(dump_env, tmp_path):
    lengths = (128, 200)
    with _engine("tiny-qwen3moe.yaml", "reference", prefill=128) as eng:
        spec = eng.qwen3_spec
        prompts = acceptance_prompts(lengths, spec.vocab)
        runs = run_both_arms(eng, prompts, dump_env)
    hidden, scratch = spec.hidden, tmp_path / "one.bin"
    check_arms(runs, prompts, hidden, scratch)
    one = runs[ARMS[0]][1]
    flipped = bytearray(one.dump)
    flipped[-1] ^= 1  # the last bit of one float
    runs[ARMS[0]][1] = ArmRun(bytes(flipped), one.greedy, one.gathers, one.prefill_s)
    with pytest.raises(AssertionError, match="the residual dumps differ"):
        check_arms(runs, prompts, hidden, scratch)
    runs[ARMS[0]][1] = ArmRun(one.dump, one.greedy[:-1] + [one.greedy[-1] + 1], one.gathers,
                              one.prefill_s)
    with pytest.raises(AssertionError):
        check_arms(runs, prompts, hidden, scratch)
    runs[ARMS[0]][1] = ArmRun(one.dump, one.greedy, runs[ARMS[1]][1].gathers, one.prefill_s)
    with pytest.raises(AssertionError, match="the switch did not take"):
        check_arms(runs, prompts, hidden, scratch)


def test_prompts_are_seeded_and_start_apart():
    a = acceptance_prompts(LENGTHS, 151936)
    assert [len(p) for p in a] == list(LENGTHS)
    assert all(np.array_equal(x, y) for x, y in zip(a, acceptance_prompts(LENGTHS, 151936)))
    with pytest.raises(AssertionError, match="share their first line"):
        acceptance_prompts((128, 128), 512)


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_acceptance",
                                                  ROOT / "bench" / "bench_acceptance.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_acceptance_on_the_reference_backend(tmp_path, monkeypatch, capsys):
    """bench/bench_acceptance.py: the order one, batch per pair after the warm-ups, a record
    per prompt with every run's time, the greedy ids of every run agreeing, the files."""
    bench = _bench_module()
    monkeypatch.delenv(SWITCH, raising=False)
    flips: list[str] = []
    real = bench.set_switch

    def recording(engine, name, value):
        flips.append(value)
        real(engine, name, value)

    monkeypatch.setattr(bench, "set_switch", recording)
    out = tmp_path / "results"
    assert bench.main(["--config", str(ROOT / "configs" / "tiny-qwen3moe.yaml"), "--backend",
                       "reference", "--prompts", "40,90", "--pairs", "2", "--warmups", "1",
                       "--greedy", "5", "--out", str(out)]) == 0
    assert flips == (["1", "0"] + ["1", "0"] * 2) * 2
    assert SWITCH not in os.environ  # restored
    (json_path,) = out.glob("acceptance-tiny-qwen3moe-*.json")
    doc = json.loads(json_path.read_text())
    assert [r["tokens"] for r in doc["runs"]] == [40, 90]
    for r in doc["runs"]:
        assert len(r["one_s"]) == len(r["batch_s"]) == 2 and r["greedy_agree"] is True
        assert r["gathers_launched"]["one"] > r["gathers_launched"]["batch"]
        assert all(len(ids) == 5 for arm in ("one", "batch") for ids in r["greedy_ids"][arm])
        one = statistics.median(r["one_s"])
        assert r["change_pct"] == pytest.approx((statistics.median(r["batch_s"]) - one)
                                                / one * 100)
    md = json_path.with_suffix(".md").read_text()
    assert "| prompt tokens | one ms (each run) | batch ms (each run) | change %" in md
    assert md.count("| yes ") == 2 and "no GPU" in capsys.readouterr().out


def test_bench_acceptance_refuses_moe_layers_alone(tmp_path):
    with pytest.raises(SystemExit, match="not a whole model"):
        _bench_module().main(["--config", str(ROOT / "configs" / "demo.yaml"), "--out",
                              str(tmp_path)])
