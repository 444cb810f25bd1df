"""The engine on GGUFs written by llama.cpp's own converter and quantizer, read as they are.

Every mix of tests/fixtures/ggml_mixes (F16 ... Q2_K, the i-quants, MXFP4 and a per-tensor
mix) opens with no `format`: each layer runs the format of its tensors' types, nothing is
converted, and logits, argmax, 24 greedy tokens and perplexity are judged against transformers'
fp32 model loaded from the same file (tests/tools/ggml_fixture_checks.py states the bounds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from ggml_fixture_checks import FIXTURES, compare_with_golden, manifest  # noqa: E402

from strata_rt.engine import Engine  # noqa: E402
from strata_rt.text.generate import EngineSession, greedy  # noqa: E402

FILES = sorted(manifest()["files"])
#: where the CUDA backend misses a criterion, as measured on an H200 (logits NMSE 1.1e-6 to
#: 1.4e-6 everywhere, far inside 1e-4). A numpy replay of the CUDA path's fp16 roundings (one
#: switch per rounding) reproduces the misses and splits them into three causes: a routing
#: near-tie in the text that the roundings flip (Q4_K-down_exps_Q6_K: one layer-0 token whose
#: router gap is 7.5e-5 of the logits' RMS carries the whole 7.1e-4; probably Q8_0's too), the
#: smooth fp16 noise (IQ4_XS: the roundings spread perplexity by 3-6e-5 at one standard
#: deviation, the largest share from the dense weights decoded to fp16), and ten small shifts
#: that add up against Q4_K_M's 1.49e-3 argmax margin. No one or two roundings kept in float32
#: close all four; keeping both dense GEMMs' operands and outputs exact would (at about 3x the
#: projections' FLOPs) only lower the chance of a flip. Strict: a file that starts passing must
#: leave this list.
GPU_GAPS = {
    "IQ4_XS.gguf": "perplexity 1.1e-4 relative (bound 1e-4)",
    "Q4_K-down_exps_Q6_K.gguf": "perplexity 7.1e-4 relative (a routing near-tie in the text)",
    "Q4_K_M.gguf": "argmax differs at position 50 of the 64-token prompt",
    "Q8_0.gguf": "perplexity 2.3e-4 relative",
}


def _expected_layer_formats(fname: str) -> list[str]:
    """The format names the file's expert tensor types imply, per layer (from the manifest)."""
    types = manifest()["files"][fname]["tensor_types"]
    names = []
    for layer in range(2):
        g, d = (types[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "down"))
        names.append(g.lower() if g == d else f"{g.lower()}+{d.lower()}")
    return [("fp16" if n == "f16" else n) for n in names]


def _judge(fname: str, backend: str) -> None:
    with Engine.open({"model": {"gguf": str(FIXTURES / fname)}, "backend": backend}) as eng:
        got = [f.name for f in eng.model.formats.formats]
        assert got == _expected_layer_formats(fname), got

        def logits_fn(ids: np.ndarray) -> np.ndarray:
            eng.reset()
            return eng.prefill(np.asarray(ids, np.int64), all_logits=True)[0]

        def greedy_fn(ids: np.ndarray, n: int) -> list[int]:
            return greedy(EngineSession(eng), ids, n, eos_id=None).ids

        result = compare_with_golden(fname, logits_fn, greedy_fn,
                                     backend="gpu" if backend == "cuda" else backend)
    print(fname, backend, "; ".join(result.notes))
    result.check()


@pytest.mark.parametrize("fname", FILES)
def test_reference_backend_matches_transformers_on_the_file_as_stored(fname: str) -> None:
    _judge(fname, "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("fname", [
    pytest.param(f, marks=pytest.mark.xfail(reason=GPU_GAPS[f], strict=True)) if f in GPU_GAPS
    else f for f in FILES])
def test_cuda_backend_matches_transformers_on_the_file_as_stored(fname: str) -> None:
    _judge(fname, "cuda")


def test_inspect_shows_each_files_mix_and_what_a_budget_holds(capsys) -> None:
    from strata_rt.cli import main

    for fname in FILES:
        assert main(["inspect", str(FIXTURES / fname), "--budget-gib", "0.0005"]) == 0
        out = capsys.readouterr().out
        want = _expected_layer_formats(fname)
        line = next(x for x in out.splitlines() if x.startswith("as stored (no `format`): "))
        for layer, name in enumerate(want):
            assert f"layer {layer}: {name}," in line or f"layers 0-1: {name}," in line, line
        assert "0.0005 GiB budget holds" in out
