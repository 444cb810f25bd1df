"""bench/bench_ggml.py on the CPU: its format list is the registry's GGML formats, its sizes
are the layouts', the table renders the ratios of the numbers it is given, and a whole run
goes through the real launchers against a recording runtime (no CUDA), so the lead's one GPU
run meets no argument, size or bookkeeping error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _fake_runtime  # noqa: E402
import bench_ggml  # noqa: E402

from strata_rt.formats.ggml_format import GGMLFormat  # noqa: E402
from strata_rt.formats.registry import registry  # noqa: E402
from strata_rt.weights.model import MoESpec  # noqa: E402


def test_every_registered_ggml_format_is_listed_baseline_first():
    reg = registry()
    want = {n for n in reg.names() if isinstance(reg[n], GGMLFormat)}
    got = bench_ggml.ggml_formats()
    assert set(got) == want and next(iter(got)) == "iq3_xxs"
    assert "q2_blob" not in got  # not a GGML format
    a, _ = bench_ggml.parse([])
    assert a.formats == list(got) and a.shapes == ["30b", "235b"]
    assert a.tokens == [512, 2048, 8192] and a.reps == 5


def test_parse_adds_the_baseline_and_refuses_unknown_names(capsys):
    a, _ = bench_ggml.parse(["--formats", "q4_k,q6_k", "--shapes", "235b", "--tokens", "64"])
    assert a.formats == ["iq3_xxs", "q4_k", "q6_k"] and a.shapes == ["235b"] and a.tokens == [64]
    for bad in (["--formats", "q2_blob"], ["--shapes", "70b"], ["--tokens", "x"],
                ["--reps", "0"]):
        with pytest.raises(SystemExit):
            bench_ggml.parse(bad)
    assert "valid:" in capsys.readouterr().err


def test_gather_bytes_are_the_blob_read_and_the_fp16_images_written():
    fmt = bench_ggml.ggml_formats()["q8_0"]
    read, written = bench_ggml.gather_bytes(fmt, 2048, 768)
    assert read == 128 * 3 * 768 * 2048 // 32 * 34  # Q8_0: 34 bytes per 32 weights
    assert written == 128 * 3 * 768 * 2048 * 2


def test_rotated_blobs_are_valid_blocks_of_the_same_rows():
    fmt = bench_ggml.ggml_formats()["q4_k"]
    blobs = bench_ggml.expert_blobs(fmt, np.random.default_rng(0), 256, 512, 3)
    assert len(blobs) == 3 and not np.array_equal(blobs[0], blobs[1])
    mats = [fmt.unpack_expert(b, 256, 512) for b in blobs]
    for m in mats[1:]:  # every part holds the first blob's rows, in another order
        gu0, gu = np.vstack(mats[0][:2]), np.vstack(m[:2])
        assert sorted(map(bytes, gu0)) == sorted(map(bytes, gu))
        assert sorted(map(bytes, mats[0][2])) == sorted(map(bytes, m[2]))


def _row(tflops: float) -> dict:
    return {"rows": 4096, "rows_min": 1, "rows_max": 9, "f16_gemm": {"tflops": 2 * tflops},
            "f16_fused": {"tflops": 3 * tflops}, "layer_tflops": tflops}


def test_table_renders_ratios_and_the_gathers_below_the_goal():
    gather = {"ms": 1.0, "gbps": 3000.0, "of_copy": 0.75}
    res = {"device": "GPU", "arch": "sm_90", "reps": 5, "copy": {"gbps": 4000.0},
           "runs": {"30b": {
               "iq3_xxs": {"gather": gather, "tokens": {512: _row(100.0)}},
               "q4_k": {"gather": dict(gather, gbps=2000.0, of_copy=0.5),
                        "tokens": {512: _row(250.0)}},
               "q6_k": {"error": "FormatError: no"}}}}
    text = bench_ggml.table(res)
    assert "| iq3_xxs | 30b | 512 | 1.000 | 3000 (75%) | 200 | 300 | 100 | 1.00 |" in text
    assert "| q4_k | 30b | 512 | 1.000 | 2000 (50%) | 500 | 750 | 250 | 2.50 |" in text
    assert "| q6_k | 30b | - | FormatError: no |" in text
    assert "under 70% of the copy rate: q4_k 30b (50%)" in text
    bench_ggml.add_ratios(res)
    assert res["runs"]["30b"]["q4_k"]["tokens"][512]["vs_baseline"] == 2.5
    # the JSON's string keys render the same
    assert bench_ggml.table(json.loads(json.dumps(res))) == text


#: the recording runtime with what the benchmark calls (allocations, device copies)
_Runtime = _fake_runtime.BenchRuntime


def test_a_whole_run_through_the_real_launchers(monkeypatch, tmp_path, capsys):
    spec = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=128, top_k=8)
    holder = _fake_runtime.install(monkeypatch, np.random.default_rng(0), spec, _Runtime)
    monkeypatch.setitem(bench_ggml.MODELS, "tiny", ("tiny", 256, 512))
    out = tmp_path / "r.json"
    names = ["q4_k", "fp16", "f32", "mxfp4", "iq1_m"]
    assert bench_ggml.main(["--formats", ",".join(names), "--shapes", "tiny", "--tokens",
                            "16,64", "--reps", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]["tiny"]
    assert list(runs) == ["iq3_xxs", *names]
    for name, r in runs.items():
        assert "error" not in r and "fused_error" not in r, (name, r)
        assert set(r["tokens"]) == {"16", "64"}
        assert all("f16_fused" in row for row in r["tokens"].values())
    # the fake's events say 0.25 ms for everything: the layer's TFLOPS over the baseline's is 1
    assert runs["q4_k"]["tokens"]["64"]["vs_baseline"] == pytest.approx(1.0)
    launched = set(holder["rt"].launches)
    assert any("gather" in k for k in launched) and any("fused" in k for k in launched)
    assert "| q4_k | tiny | 64 |" in capsys.readouterr().out


def test_a_failing_format_prints_one_line_and_the_run_goes_on(monkeypatch, capsys):
    import strata_rt.runtime as runtime_pkg

    spec = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=128, top_k=8)
    monkeypatch.setattr(runtime_pkg.Runtime, "open", staticmethod(
        lambda device=0: _Runtime(np.random.default_rng(0), spec)))
    monkeypatch.setenv("STRATA_F16_GEMM", "own")
    monkeypatch.setitem(bench_ggml.MODELS, "tiny", ("tiny", 256, 512))
    real = bench_ggml.expert_blobs

    def broken(fmt, *args):
        if fmt.name == "q4_k":
            raise RuntimeError("no blocks\ntoday")
        return real(fmt, *args)

    monkeypatch.setattr(bench_ggml, "expert_blobs", broken)
    assert bench_ggml.main(["--formats", "q4_k,q6_k", "--shapes", "tiny", "--tokens", "16",
                            "--reps", "1", "--no-fused"]) == 0
    out = capsys.readouterr().out
    assert "[2/3] q4_k tiny: FAILED RuntimeError: no blocks today\n" in out
    assert "| q4_k | tiny | - | RuntimeError: no blocks today |" in out
    row = next(line for line in out.splitlines() if line.startswith("| q6_k | tiny | 16 |"))
    assert row.split(" | ")[6] == "-"  # --no-fused: no f16_fused figure


def test_a_broken_context_is_reopened_and_the_next_format_runs(monkeypatch, capsys):
    import strata_rt.runtime as runtime_pkg

    spec = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=128, top_k=8)
    opened: list[_Runtime] = []

    class Sticky(_Runtime):
        broken = False

        def synchronize(self):
            if self.broken:
                raise RuntimeError("an illegal address was encountered")

    def open_fake(device=0):
        opened.append(Sticky(np.random.default_rng(0), spec))
        return opened[-1]

    monkeypatch.setattr(runtime_pkg.Runtime, "open", staticmethod(open_fake))
    monkeypatch.setenv("STRATA_F16_GEMM", "own")
    monkeypatch.setitem(bench_ggml.MODELS, "tiny", ("tiny", 256, 512))
    real = bench_ggml.expert_blobs

    def breaks(fmt, *args):
        if fmt.name == "q4_k":
            opened[-1].broken = True
            raise RuntimeError("launch failed")
        return real(fmt, *args)

    monkeypatch.setattr(bench_ggml, "expert_blobs", breaks)
    assert bench_ggml.main(["--formats", "q4_k,q6_k", "--shapes", "tiny", "--tokens", "16",
                            "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert len(opened) == 2 and "(CUDA context reopened)" in out
    assert "| q4_k | tiny | - | RuntimeError: launch failed |" in out
    assert "| q6_k | tiny | 16 | 0.250 |" in out
