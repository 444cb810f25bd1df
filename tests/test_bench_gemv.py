"""bench/bench_gemv.py on the CPU: its arguments, the layers a byte cap leaves, the table, and a
whole run through the real launchers against a recording runtime (no CUDA), so a GPU run meets
no argument, size or bookkeeping error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _fake_runtime  # noqa: E402
import bench_gemv  # noqa: E402

from strata_rt.weights.model import MoESpec  # noqa: E402


def test_parse_puts_the_baseline_first_and_refuses_bad_values(capsys):
    a = bench_gemv.parse([])
    assert a.formats == ["iq3_xxs"] and a.shapes == ["30b"] and a.layers == 48
    a = bench_gemv.parse(["--formats", "q4_k", "--shapes", "30b,235b", "--host"])
    assert a.formats == ["iq3_xxs", "q4_k"] and a.shapes == ["30b", "235b"] and a.host
    for bad in (["--formats", "q2_blob"], ["--shapes", "70b"], ["--layers", "0"],
                ["--max-gib", "0"]):
        with pytest.raises(SystemExit):
            bench_gemv.parse(bad)
    assert "valid:" in capsys.readouterr().err


def test_layers_follow_the_byte_cap():
    blob = 1 << 20  # 8 experts of 1 MiB a layer
    assert bench_gemv.layers_within(blob, 48, 1.0) == 48
    assert bench_gemv.layers_within(blob, 48, 0.25) == 32
    assert bench_gemv.layers_within(64 * blob, 48, 0.25) == 1  # at least one layer


def test_table_renders_rates_and_errors():
    res = {"device": "GPU", "copy": {"d2d_read_gbps": 2000.0, "h2d_gbps": 50.0}, "runs": [
        {"format": "iq3_xxs", "shape": "30b", "where": "device", "layers": 48,
         "blob_bytes": 1, "us_per_layer": 12.5, "gbps": 1000.0, "of_ceiling": 0.5},
        {"format": "q4_k", "shape": "30b", "where": "host", "error": "FormatError: no"}]}
    text = bench_gemv.table(res)
    assert "reads 2000 GB/s, pinned host-to-device 50.0 GB/s" in text
    assert "| iq3_xxs | 30b | device | 48 | 12.5 | 1000 | 50% |" in text
    assert "| q4_k | 30b | host | - | FormatError: no | | |" in text


def test_a_whole_run_through_the_real_launchers(monkeypatch, tmp_path, capsys):
    import strata_rt.runtime.hostmap as hostmap

    spec = MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=128, top_k=8)
    holder = _fake_runtime.install(monkeypatch, np.random.default_rng(0), spec,
                                   _fake_runtime.BenchRuntime)
    monkeypatch.setattr(hostmap, "host_device_pointer", lambda host: 1 << 40)
    monkeypatch.setitem(bench_gemv.MODELS, "tiny", ("tiny", 256, 512))
    out = tmp_path / "r.json"
    assert bench_gemv.main(["--formats", "q4_k,fp16", "--shapes", "tiny", "--layers", "3",
                            "--reps", "1", "--host", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["format"], r["where"]) for r in res["runs"]] == [
        ("iq3_xxs", "device"), ("iq3_xxs", "host"), ("q4_k", "device"), ("q4_k", "host"),
        ("fp16", "device"), ("fp16", "host")]
    assert all("error" not in r and r["layers"] == 3 for r in res["runs"])
    rt = holder["rt"]
    gemv = [(k, a) for k, _, a in rt.launched_on if k.startswith("ggml_gemv")]
    # warm-ups and one timed pass: 3 layers x 2 launches each, per format and place
    assert len(gemv) == 6 * (bench_gemv.WARMUPS + 1) * 3 * 2
    tables = {a[0] for _, a in gemv}
    assert len(tables) == 3 * 2 * 3  # each layer of each pass reads its own table
    assert "| q4_k | tiny | host | 3 |" in capsys.readouterr().out
