"""The `strata` command on a machine without CUDA: help, plugins, inspect, check-kernels, error
exits, and one end-to-end run of the demo config on the reference backend."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from strata_rt.cli import build_parser, cuda_version, main
from strata_rt.registry import registry
from strata_rt.runtime.compile import nvcc_available

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("run", "bench", "inspect", "profile", "plugins", "check-kernels")


def strata(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "strata_rt.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


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
    from strata_rt.gguf_io import write_moe_gguf
    from strata_rt.model import Model, MoESpec

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
    from strata_rt import gguf_io
    from strata_rt.model import Model, MoESpec

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


def test_usage_errors_exit_2() -> None:
    done = strata("run")
    assert done.returncode == 2 and "config" in done.stderr
    done = strata("bench", "configs/demo.yaml", "--ab", "STRATA_NOPE")
    assert done.returncode == 2 and "STRATA_PREFILL_GATHER_ONE" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_ab_offers_only_switches_read_per_prompt(capsys) -> None:
    with pytest.raises(SystemExit) as info:  # read once at open: A and B would be the same
        main(["bench", "configs/demo.yaml", "--ab", "STRATA_CUDA_GRAPH"])
    assert info.value.code == 2
    assert "invalid choice: 'STRATA_CUDA_GRAPH'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "STRATA_PREFILL_GATHER_ONE" in help_text and "per prompt" in help_text


def _broken_plugin(tmp_path: Path, source: str) -> dict:
    """A temp plugin whose one kernel is `source`, listed in a temp plugins.yaml."""
    pkg = tmp_path / "brokenfmt_pkg"
    pkg.mkdir()
    (pkg / "broken.cu").write_text(source)
    (pkg / "brokenfmt.py").write_text(textwrap.dedent("""
        from pathlib import Path

        import strata_rt
        from strata_rt.formats import QuantFormat


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
    n = sum(len(f.format.kernel_sources()) for f in registry().formats.values())
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


def test_bad_config_exit_2_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: {synthetic: {n_layers: 0}}\nformat: nope\nprompts: [1]\n")
    done = strata("run", str(path), "--backend", "reference")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for key in ("model.synthetic.n_layers", "model.synthetic.hidden", "format",
                "expert_cache / vram_reserve_mib / vram_budget_mib"):
        assert f"  - {key}: " in done.stderr, done.stderr


def test_demo_runs_on_the_reference_backend(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("STRATA_WALK_MIN_TOKENS", raising=False)  # as a user runs it
    out = tmp_path / "demo.json"
    done = strata("run", "configs/demo.yaml", "--backend", "reference", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "backend reference" in done.stdout and "resident experts: 32 of 128" in done.stdout
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [r["tokens"] for r in runs] == [4, 200, 1100]
    assert all(r["stats"]["tokens"] == r["tokens"] and r["stats"]["experts_streamed"] > 0
               for r in runs)
    # 4 tokens ride the staging ring (routed experts only), the others walk (all 96 streamed)
    streamed = [r["stats"]["experts_streamed"] for r in runs]
    assert streamed[0] < streamed[1] == streamed[2] == 96
    assert doc["hardware"] and doc["resident_experts"] == 32


def _tiny_config(tmp_path: Path, **extra) -> Path:
    doc = {"model": {"synthetic": {"n_layers": 2, "hidden": 256, "ffn": 256, "n_experts": 8,
                                   "top_k": 2, "seed": 5}},
           "format": "iq3_xxs", "backend": "reference", "expert_cache": 4,
           "prompts": [16, 24], **extra}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_run_summary_and_json(tmp_path: Path, capsys) -> None:
    cfg = _tiny_config(tmp_path, output={"dir": "out", "json": "run.json"}, repeats=2)
    assert main(["run", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "resident experts: 4 of 16" in out and "tokens/s" in out
    runs = json.loads((tmp_path / "out" / "run.json").read_text())["runs"]
    assert [(r["tokens"], r["repeat"]) for r in runs] == [(16, 0), (24, 0), (16, 1), (24, 1)]
    assert all(r["stats"]["experts_streamed"] > 0 for r in runs)


def test_bench_ab_table_and_json(tmp_path: Path, capsys) -> None:
    target = tmp_path / "ab.json"
    assert main(["bench", str(_tiny_config(tmp_path)), "--pairs", "2", "--prompts", "20",
                 "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "| prompt tokens | A ms (each run) | B ms (each run) | change %" in out
    doc = json.loads(target.read_text())
    assert doc["switch"] == "STRATA_PREFILL_GATHER_ONE" and doc["hardware"]
    row = doc["rows"][0]
    assert row["tokens"] == 20 and len(row["a_s"]) == len(row["b_s"]) == 2
    assert "STRATA_PREFILL_GATHER_ONE" not in os.environ  # restored


def test_output_path_that_is_a_directory(tmp_path: Path, capsys) -> None:
    cfg = str(_tiny_config(tmp_path))
    for args, option in ((["run", cfg, "--json", str(tmp_path)], "--json"),
                         (["profile", cfg, "--out", str(tmp_path)], "--out")):
        assert main(args) == 2  # refused before the engine opens
        err = capsys.readouterr().err
        assert f"  - {option}: got '{tmp_path}'; is a directory; give a file path" in err


def test_bad_mmq_kernel_is_refused_on_any_backend(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "f17")
    assert main(["run", str(_tiny_config(tmp_path))]) == 2  # reference backend, iq3_xxs
    err = capsys.readouterr().err
    variants = ", ".join(registry()["iq3_xxs"].mmq_variants())
    assert f"STRATA_MMQ_KERNEL (environment): got 'f17'; format iq3_xxs offers {variants}" in err


def test_profile_prints_where_it_wrote(tmp_path: Path, capsys, monkeypatch) -> None:
    cfg = _tiny_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["profile", str(cfg), "--out", "profiles/p.json"]) == 0
    where = (tmp_path / "profiles" / "p.json").resolve()
    assert f"`profile: {where}`" in capsys.readouterr().out


def test_profile_round_trip(tmp_path: Path, capsys) -> None:
    from strata_rt.residency import RoutingProfile

    cfg = _tiny_config(tmp_path)
    prof = tmp_path / "p.json"
    assert main(["profile", str(cfg), "--out", str(prof)]) == 0
    counts = RoutingProfile.load(prof).counts
    assert counts.shape == (2, 8) and (counts.sum(axis=1) == (16 + 24) * 2).all()
    capsys.readouterr()
    assert main(["run", str(_tiny_config(tmp_path, profile="p.json"))]) == 0
    RoutingProfile(counts[:1]).save(tmp_path / "one_layer.json")
    assert main(["run", str(_tiny_config(tmp_path, profile="one_layer.json"))]) == 2
    err = capsys.readouterr().err
    assert "profile: got 'one_layer.json'" in err and "1 layers x 8 experts" in err


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_progress_per_chunk_and_layer(tty: bool) -> None:
    from strata_rt.progress import Progress

    stream = _Stream(tty)
    p = Progress(stream, delay_s=0.0, interval_s=0.0)
    p.start("prompt 1/1")
    for chunk in range(2):
        for layer in range(3):
            p(chunk, 2, layer, 3)
    p.end()
    if tty:  # one redrawn line per layer, cleared at the end
        assert stream.text.count("\r\x1b[K") == 7 and "chunk 2/2 layer 3/3" in stream.text
        assert stream.text.endswith("\r\x1b[K")
    else:  # a log gets one line per finished chunk
        assert stream.text.splitlines()[0].startswith("prompt 1/1: chunk 1/2 done")
        assert len(stream.text.splitlines()) == 2 and "\r" not in stream.text
    quiet = _Stream(True)
    q = Progress(quiet, delay_s=60.0)
    q.start("short")
    q(0, 1, 0, 3)
    q.end()
    assert quiet.text == ""  # short prompts print nothing


# ------------------------------------------------------------------------------ logging
def test_verbosity_options(tmp_path: Path, capsys) -> None:
    cfg, target = str(_tiny_config(tmp_path)), str(tmp_path / "r.json")
    assert main(["run", cfg, "--json", target]) == 0
    err = capsys.readouterr().err
    assert f"strata: wrote {target}\n" in err and "updated" not in err
    assert main(["-q", "run", cfg, "--json", target]) == 0
    assert "wrote" not in capsys.readouterr().err
    assert main(["-v", "run", cfg, "--json", target]) == 0
    err = capsys.readouterr().err
    assert f"strata: [strata_rt.cli.common] debug: updated {target}" in err  # after prompt 1
    assert f"strata: [strata_rt.cli.common] wrote {target}" in err
    assert main(["-q", "--verbose", "run", cfg]) == 0  # -v and -q add up: notices again
    logger = logging.getLogger("strata_rt")
    assert logger.level == logging.NOTSET and not logger.handlers  # main() left no trace


def test_quiet_turns_progress_off() -> None:
    from strata_rt.cli.common import progress_for

    parser = build_parser()
    assert progress_for(parser.parse_args(["run", "x.yaml"])).enabled
    assert not progress_for(parser.parse_args(["-q", "run", "x.yaml"])).enabled


def test_a_log_record_clears_the_progress_line(monkeypatch) -> None:
    from strata_rt import log
    from strata_rt.progress import Progress

    stream = _Stream(tty=True)
    monkeypatch.setattr(sys, "stderr", stream)
    with log.configured(0):
        bar = Progress(stream, delay_s=0.0, interval_s=0.0)
        bar.start("prompt 1/1")
        bar(0, 1, 0, 2)
        logging.getLogger("strata_rt.test").warning("slow %s", "disk")
        bar(0, 1, 1, 2)  # the bar comes back on the next layer
    assert stream.text.split("\r\x1b[K")[1:] == [
        "prompt 1/1: chunk 1/1 layer 1/2 [##########          ]    0.0 s",
        "strata: warning: slow disk\n",
        "prompt 1/1: chunk 1/1 layer 2/2 [####################]    0.0 s"]


#: modules that write to stderr themselves: progress displays and the CLI's log handler (the
#: CLI, which owns the terminal, is not scanned)
PRINTS_ALLOWED = {"progress.py", "convert.py", "log.py"}
def _stderr_writes(tree: ast.AST) -> list[int]:
    """Lines of print(...) calls, warnings.warn(...) calls and any use of sys.stderr: code,
    not text that happens to contain those words."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "print":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id, node.attr) in (("sys", "stderr"), ("warnings", "warn"))):
            lines.append(node.lineno)
    return sorted(lines)


def test_library_modules_log_instead_of_printing() -> None:
    """Library modules log through logging.getLogger(__name__); only progress displays and
    the CLI write to stderr, so an embedding program controls every message."""
    offenders = []
    for path in sorted((ROOT / "strata_rt").rglob("*.py")):
        rel = path.relative_to(ROOT / "strata_rt")
        if rel.parts[0] in ("cli", "quants", "kernels") or rel.name in PRINTS_ALLOWED:
            continue
        text = path.read_text()
        lines = text.splitlines()
        offenders += [f"{rel}:{n}: {lines[n - 1].strip()}" for n in _stderr_writes(ast.parse(text))]
    assert offenders == [], "\n".join(offenders)


def test_the_print_finder_sees_code_not_text() -> None:
    code = 'x = "print(1)"\nprint(2)\nimport sys\nsys.stderr.write("")\nwarnings.warn("w")\n'
    assert _stderr_writes(ast.parse(code)) == [2, 4, 5]


def test_inspect_a_whole_model_file_shows_dense_weights_and_kv_cache(tmp_path, capsys):
    """A GGUF with token_embd.weight: dense weights by type, their fp16 size, the KV cache per
    1K tokens, and a budget's split: the dense part first (streamed when the resident weights
    do not fit), the experts counted in what is left."""
    from strata_rt.hostmem import format_bytes
    from strata_rt.qwen3.gguf_full import write_qwen3_gguf
    from strata_rt.qwen3.spec import TINY_SPEC
    from strata_rt.qwen3.weights import Qwen3Model

    path = write_qwen3_gguf(tmp_path / "tiny.gguf", Qwen3Model.synthetic(TINY_SPEC, 1, "fp16"))
    assert main(["inspect", str(path), "--budget-gib", "0.001"]) == 0
    out = capsys.readouterr().out
    kv_1k = TINY_SPEC.n_layers * 2 * TINY_SPEC.n_kv_heads * TINY_SPEC.head_dim * 2 * 1024
    assert f"whole model: vocabulary {TINY_SPEC.vocab}" in out
    assert f"KV cache (fp16) per 1K tokens: {format_bytes(kv_1k)}" in out
    assert f"dense weights as fp16 (what the GPU holds): " \
           f"{format_bytes(2 * TINY_SPEC.dense_params())}" in out
    assert "holds the dense weights streaming per layer (they do not fit)" in out
    assert "| F32 " in out or "| F16 " in out
    assert main(["inspect", str(path), "--budget-gib", "0.0088"]) == 0
    out = capsys.readouterr().out
    assert "holds the fp16 dense weights resident" in out
    fp16_row = next(line for line in out.splitlines() if line.startswith("| fp16 "))
    slot = 393_216  # an FP16 expert of the tiny shape; 0.0088 GiB less the dense part: 8
    left = float(out.split(" left for experts")[0].rsplit("; ", 1)[1].split()[0])
    assert fp16_row.split("|")[5].strip() == str(int(left * (1 << 20)) // slot) == "8"


def test_inspect_of_moe_layers_only_has_no_whole_model_lines(tmp_path, capsys):
    from strata_rt.gguf_io import write_moe_gguf
    from strata_rt.model import Model, MoESpec

    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, Model.synthetic(MoESpec(2, 256, 256, 4, 2), 0))
    assert main(["inspect", str(path)]) == 0
    assert "whole model" not in capsys.readouterr().out
