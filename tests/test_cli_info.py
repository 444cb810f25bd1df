"""The `strata` commands that read rather than run, on a machine without CUDA: help, plugins,
inspect (MoE-only and whole-model files) and check-kernels, with their error exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from _cli import ROOT, strata

from strata_rt.cli import cuda_version, main
from strata_rt.formats.registry import registry
from strata_rt.runtime.compile import nvcc_available

COMMANDS = ("run", "bench", "inspect", "profile", "plugins", "check-kernels")


def test_help_without_cuda() -> None:
    top = strata("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in COMMANDS)
    for command in COMMANDS:
        done = strata(command, "--help")
        assert done.returncode == 0, done.stderr
        assert "examples:" in done.stdout and f"strata {command}" in done.stdout
    version = strata("--version")
    assert version.returncode == 0 and version.stdout.startswith("strata_rt ")


def test_help_imports_no_cuda() -> None:
    code = ("import sys; from strata_rt.cli import main\n"
            "try: main(['run', '--help'])\nexcept SystemExit: pass\n"
            "assert 'pycuda' not in sys.modules and 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_plugins_lists_the_loaded_formats(capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    header = [c.strip() for c in out.splitlines()[0].split("|")]
    assert "mmq variants" in header and "description" in header
    for name, loaded in registry().formats.items():
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} "))
        assert str(loaded.format.block_bytes) in row and loaded.plugin in row
        assert f" {', '.join(loaded.format.mmq_variants())} " in row
        assert loaded.format.description in row


def test_plugins_option_has_help(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--plugins PATH" in out and "STRATA_PLUGINS" in out


NVIDIA_SMI_HEADER = """\
Tue Mar  4 10:12:01 2025
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_cuda_version_is_not_the_driver_version() -> None:
    assert cuda_version(NVIDIA_SMI_HEADER) == "12.4"
    assert cuda_version("no GPU header here") is None


def test_inspect_a_small_gguf(tmp_path: Path, capsys) -> None:
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model, MoESpec

    path = write_moe_gguf(tmp_path / "tiny.gguf",
                          Model.synthetic(MoESpec(2, 256, 256, 4, 2, format="iq3_xxs"), 0))
    assert main(["inspect", str(path), "--budget-gib", "0.0002"]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 4 experts = 8 experts, top-2, hidden 256, ffn 256" in out
    assert "IQ3_XXS x6" in out and "blk.0.ffn_down_exps.weight" in out
    blob = registry()["iq3_xxs"].layout(256, 256).slot_bytes
    held = min(8, int(0.0002 * (1 << 30)) // blob)
    assert f"bytes per expert in the file (layer 0): {blob:,}" in out
    row = next(line for line in out.splitlines() if line.startswith("| iq3_xxs "))
    assert f" {held:,} " in row


def test_inspect_names_types_with_gguf_io(tmp_path: Path, capsys, monkeypatch) -> None:
    from strata_rt.weights.gguf_file import gguf_io
    from strata_rt.weights.model import Model, MoESpec

    path = gguf_io.write_moe_gguf(tmp_path / "tiny.gguf",
                                  Model.synthetic(MoESpec(2, 256, 256, 4, 2), 0))
    monkeypatch.setattr(gguf_io, "_type_name", lambda t: f"GGML{int(t)}")
    assert main(["inspect", str(path)]) == 0
    assert "expert tensor types: GGML" in capsys.readouterr().out


@pytest.mark.parametrize("budget", ["-3", "0", "nan"])
def test_inspect_rejects_a_budget_that_is_not_positive(tmp_path: Path, capsys,
                                                       budget: str) -> None:
    assert main(["inspect", str(tmp_path / "any.gguf"), "--budget-gib", budget]) == 2
    err = capsys.readouterr().err
    assert f"--budget-gib: got {float(budget):g}" in err and "> 0" in err


def test_inspect_errors_exit_1(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "x.gguf" in err and "Traceback" not in err


def _broken_plugin(tmp_path: Path, source: str) -> dict:
    """A temp plugin whose one kernel is `source`, listed in a temp plugins.yaml."""
    pkg = tmp_path / "brokenfmt_pkg"
    pkg.mkdir()
    (pkg / "broken.cu").write_text(source)
    (pkg / "brokenfmt.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import strata_rt
        from strata_rt.formats.contract import QuantFormat


        class Broken(QuantFormat):
            name = "broken_test"
            block_values = 32
            block_bytes = 34
            kernel_dir = "broken_test"

            def kernel_sources(self):
                return [Path(__file__).with_name("broken.cu")]


        @strata_rt.hookimpl
        def strata_rt_formats():
            return [Broken()]
        """))
    plugins = tmp_path / "plugins.yaml"
    plugins.write_text(yaml.safe_dump({"plugins": [{"module": "brokenfmt"}]}))
    return {"PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT)]),
            "STRATA_KERNEL_CACHE": str(tmp_path / "cache"), "_plugins": str(plugins)}


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
def test_check_kernels_of_the_loaded_plugins() -> None:
    done = strata("check-kernels", "--arch", "sm_90")
    assert done.returncode == 0, done.stdout + done.stderr
    n = len({p for f in registry().formats.values() for v in f.format.mmq_variants()
             for p in f.format.for_variant(v).kernel_sources()})
    assert "compiled (sm_90)" in done.stdout and n <= done.stdout.count("ok  ")


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
def test_check_kernels_fails_with_the_compiler_message(tmp_path: Path) -> None:
    env = _broken_plugin(tmp_path, 'extern "C" __global__ void k(float* x) { x[0] = 1.0f }\n')
    plugins = env.pop("_plugins")
    done = strata("--plugins", plugins, "check-kernels", "--arch", "sm_90", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL broken_test" in done.stdout and "broken.cu" in done.stderr
    assert "error" in done.stderr and "Traceback" not in done.stderr
    # the same plugin listed through the environment switch, now with a valid kernel
    (tmp_path / "brokenfmt_pkg" / "broken.cu").write_text(
        'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n')
    done = strata("check-kernels", "--arch", "sm_90", env={**env, "STRATA_PLUGINS": plugins})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   broken_test" in done.stdout


def test_plugins_option_and_missing_file(tmp_path: Path) -> None:
    done = strata("--plugins", str(tmp_path / "none.yaml"), "plugins")
    assert done.returncode == 1 and "none.yaml" in done.stderr
    assert "Traceback" not in done.stderr


def test_inspect_a_whole_model_file_shows_dense_weights_and_kv_cache(tmp_path, capsys,
                                                                    monkeypatch):
    """A GGUF with token_embd.weight: dense weights by type, what they take on the GPU as
    stored (here F32) with the fp16 decode scratch and the token embedding (an F32 one the
    head does not share: its rows stay on the host by default, on the GPU in its type with
    STRATA_EMBEDDING=device), the KV cache per 1K tokens, and a budget's
    split: the dense part first (streamed when the resident weights do not fit), the experts
    counted in what is left."""
    from strata_rt.config.hostmem import format_bytes
    from strata_rt.models.qwen3.gguf_full import write_qwen3_gguf
    from strata_rt.models.qwen3.spec import TINY_SPEC
    from strata_rt.models.qwen3.weights import Qwen3Model
    from strata_rt.models.qwen3.whole_memory import DenseLayout, DenseTypes

    path = write_qwen3_gguf(tmp_path / "tiny.gguf", Qwen3Model.synthetic(TINY_SPEC, 1, "fp16"))
    layout = DenseLayout.of(TINY_SPEC, DenseTypes.uniform(TINY_SPEC.n_layers, "F32"))
    monkeypatch.setenv("STRATA_EMBEDDING", "device")
    assert main(["inspect", str(path), "--budget-gib", "0.001"]) == 0
    out = capsys.readouterr().out
    kv_1k = TINY_SPEC.n_layers * 2 * TINY_SPEC.n_kv_heads * TINY_SPEC.head_dim * 2 * 1024
    assert f"whole model: vocabulary {TINY_SPEC.vocab}" in out
    assert f"KV cache (fp16) per 1K tokens: {format_bytes(kv_1k)}" in out
    head = TINY_SPEC.vocab * TINY_SPEC.hidden
    assert f"on the GPU, as stored: attention weights and norms " \
           f"{format_bytes(layout.resident_bytes)}, output head {format_bytes(4 * head)}, " \
           f"fp16 decode scratch {format_bytes(2 * head)}, " \
           f"token embedding {format_bytes(4 * head)}" in out  # looked up on the GPU
    assert "holds the dense weights streaming per layer (they do not fit)" in out
    assert "| F32 " in out or "| F16 " in out
    assert main(["inspect", str(path), "--budget-gib", "0.0104"]) == 0
    out = capsys.readouterr().out
    assert "holds the dense weights resident" in out
    fp16_row = next(line for line in out.splitlines() if line.startswith("| fp16 "))
    slot = 393_216  # an FP16 expert of the tiny shape; 0.0104 GiB less the dense part
    # (the F32 embedding included): 7
    left = float(out.split(" left for experts")[0].rsplit("; ", 1)[1].split()[0])
    assert fp16_row.split("|")[5].strip() == str(int(left * (1 << 20)) // slot) == "7"
    monkeypatch.delenv("STRATA_EMBEDDING")  # auto: the F32 rows stay on the host, a slot more
    assert main(["inspect", str(path), "--budget-gib", "0.0104"]) == 0
    out = capsys.readouterr().out
    assert "token embedding rows decoded on the host" in out
    fp16_row = next(line for line in out.splitlines() if line.startswith("| fp16 "))
    left = float(out.split(" left for experts")[0].rsplit("; ", 1)[1].split()[0])
    # the printed MiB are rounded to 0.1: the table's count lies within that rounding
    assert fp16_row.split("|")[5].strip() == "8"
    assert int((left - 0.05) * (1 << 20)) // slot <= 8 <= int((left + 0.05) * (1 << 20)) // slot


def test_inspect_of_moe_layers_only_has_no_whole_model_lines(tmp_path, capsys):
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf
    from strata_rt.weights.model import Model, MoESpec

    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, Model.synthetic(MoESpec(2, 256, 256, 4, 2), 0))
    assert main(["inspect", str(path)]) == 0
    assert "whole model" not in capsys.readouterr().out
