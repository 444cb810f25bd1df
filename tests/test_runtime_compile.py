"""The runtime without a device: importing it never loads pycuda, opening it without CUDA
raises the one clear error, and kernels compile through nvcc into a cache that recompiles only
when a source, header, define, architecture or flag changes (check-kernels reports each)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from strata_rt.errors import CudaUnavailableError, KernelBuildError
from strata_rt.runtime import Runtime, cuda_available
from strata_rt.runtime.compile import compile_cubin, nvcc_available, nvcc_path

# ---------------------------------------------------------------------------- no CUDA


def _run_without_pycuda(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter where importing pycuda fails."""
    blocker = (
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pycuda' or name.startswith('pycuda.'):\n"
        "            raise ImportError('pycuda blocked for this test')\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent.parent)


def test_importing_runtime_does_not_import_pycuda():
    done = _run_without_pycuda(
        "import strata_rt, strata_rt.runtime, strata_rt.runtime.compile\n"
        "assert 'pycuda' not in sys.modules\nprint('ok')\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_runtime_open_without_pycuda_names_reference_backend():
    done = _run_without_pycuda(
        "from strata_rt.runtime import Runtime, cuda_available\n"
        "from strata_rt.errors import CudaUnavailableError\n"
        "ok, why = cuda_available()\n"
        "assert ok is False and 'pycuda' in why, why\n"
        "try:\n"
        "    Runtime.open()\n"
        "except CudaUnavailableError as e:\n"
        "    print(e)\n")
    assert done.returncode == 0, done.stderr
    assert "CUDA is not available" in done.stdout
    assert "reference" in done.stdout and "pycuda" in done.stdout


def test_cuda_available_never_raises():
    ok, why = cuda_available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(CudaUnavailableError, match="reference"):
            Runtime.open()


# ---------------------------------------------------------------------------- compile cache

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (set STRATA_NVCC)")

TINY = """
#include "common/{header}"
extern "C" __global__ void scale_add(float* y, const float* x, float a, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]) + OFFSET;
}}
"""


@pytest.fixture
def counting_nvcc(tmp_path, monkeypatch):
    """STRATA_NVCC = a wrapper that logs each invocation, then runs the real nvcc; the cache
    goes to a fresh folder. Returns a function giving the number of compiles so far."""
    real = nvcc_path()
    log = tmp_path / "nvcc.log"
    wrapper = tmp_path / "nvcc-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("STRATA_NVCC", str(wrapper))
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))

    def compiles() -> int:
        if not log.exists():
            return 0
        return sum("-cubin" in line for line in log.read_text().splitlines())

    return compiles


@pytest.fixture
def tiny_kernel(tmp_path, monkeypatch):
    """A kernel source that includes a header from kernels/common (a temporary one)."""
    from strata_rt.runtime import compile as compile_mod

    root = tmp_path / "kernels"
    (root / "common").mkdir(parents=True)
    (root / "common" / "tiny.cuh").write_text("#define OFFSET 0.0f\n")
    (root / "tiny").mkdir()
    src = root / "tiny" / "tiny.cu"
    src.write_text(TINY.format(header="tiny.cuh"))
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", root)
    return src


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_real_cubin_for_each_arch(counting_nvcc, tiny_kernel, arch):
    cubin = compile_cubin(tiny_kernel, arch)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF", "a cubin is an ELF file"
    assert b"scale_add" in data
    assert arch in cubin.name
    assert counting_nvcc() == 1


@needs_nvcc
def test_compile_cache_hit_runs_no_nvcc(counting_nvcc, tiny_kernel):
    first = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert counting_nvcc() == 1
    again = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert again == first
    assert counting_nvcc() == 1, "second compile of the same input must come from the cache"
    assert not [p for p in first.parent.iterdir() if p.suffix == ".tmp"], "temp file left"


@needs_nvcc
def test_compile_cache_misses_on_define_arch_flag_and_header_change(counting_nvcc, tiny_kernel):
    base = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    seen = {base}
    for path in (compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 256}),
                 compile_cubin(tiny_kernel, "sm_80", {"BLOCK": 128}),
                 compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128}, ("-lineinfo",))):
        assert path not in seen
        seen.add(path)
    assert counting_nvcc() == 4
    header = tiny_kernel.parent.parent / "common" / "tiny.cuh"
    header.write_text("#define OFFSET 1.0f\n")
    changed = compile_cubin(tiny_kernel, "sm_90", {"BLOCK": 128})
    assert changed != base and counting_nvcc() == 5, "an include change must recompile"


@needs_nvcc
def test_plugin_source_recompiles_when_the_ggml_templates_change(counting_nvcc, tiny_kernel,
                                                                 tmp_path):
    """A plugin's source outside the kernels tree may include the shared GGML templates
    (kernels/ggml): a change there is a cache miss too."""
    ggml = tiny_kernel.parent.parent / "ggml"
    ggml.mkdir()
    (ggml / "templates.cuh").write_text("#define OFFSET 0.0f\n")
    plugin = tmp_path / "plugin" / "mine.cu"
    plugin.parent.mkdir()
    plugin.write_text(TINY.replace("common/{header}", "ggml/templates.cuh").format())
    first = compile_cubin(plugin, "sm_90")
    assert compile_cubin(plugin, "sm_90") == first and counting_nvcc() == 1
    (ggml / "templates.cuh").write_text("#define OFFSET 2.0f\n")
    assert compile_cubin(plugin, "sm_90") != first and counting_nvcc() == 2


@needs_nvcc
def test_compile_error_carries_compiler_message(counting_nvcc, tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void broken(float* x) { x[0] = undeclared_name; }\n')
    with pytest.raises(KernelBuildError) as info:
        compile_cubin(bad, "sm_90", {"N": 3})
    msg = str(info.value)
    assert "broken.cu" in msg and "sm_90" in msg and "-DN=3" in msg
    assert "undeclared_name" in msg, "nvcc's own diagnostic must be in the message"
    assert not list((tmp_path / "cache").glob("*.cubin")), "a failed build must cache nothing"


def test_compile_without_nvcc_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_NVCC", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not nvcc_available()
    src = tmp_path / "k.cu"
    src.write_text("")
    with pytest.raises(KernelBuildError, match="nvcc not found.*STRATA_NVCC"):
        compile_cubin(src, "sm_90")


def test_compile_missing_source_and_bad_arch(tmp_path):
    with pytest.raises(KernelBuildError, match="cannot read"):
        compile_cubin(tmp_path / "absent.cu", "sm_90")
    src = tmp_path / "k.cu"
    src.write_text("")
    with pytest.raises(KernelBuildError, match="expected sm_XY"):
        compile_cubin(src, "compute_90")


def test_cache_dir_follows_switch(monkeypatch, tmp_path):
    from strata_rt.runtime.compile import cache_dir

    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("STRATA_KERNEL_CACHE")
    assert cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "strata_rt" / "kernels"


@needs_nvcc
def test_check_kernels_reports_each_source_and_arch(counting_nvcc, tmp_path, monkeypatch):
    from strata_rt.runtime import check_kernels
    from strata_rt.runtime import compile as compile_mod

    common = tmp_path / "kernels" / "common"
    common.mkdir(parents=True)
    (common / "good.cu").write_text('extern "C" __global__ void good(int* p) { *p = 1; }\n')
    (common / "bad.cu").write_text('extern "C" __global__ void bad(int* p) { *p = nope; }\n')
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", tmp_path / "kernels")
    results = check_kernels([], ("sm_80", "sm_90"))
    got = {(r.source.name, r.arch): r for r in results}
    assert set(got) == {(n, a) for n in ("good.cu", "bad.cu") for a in ("sm_80", "sm_90")}
    assert all(got[("good.cu", a)].ok for a in ("sm_80", "sm_90"))
    bad = got[("bad.cu", "sm_90")]
    assert not bad.ok and "nope" in bad.message and bad.owner == "common"


# ---------------------------------------------------------------------------- damaged cache


def _damage(path: Path, how: str) -> None:
    from strata_rt.runtime.compile import seal_path

    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "flipped":  # one byte past the ELF header: the size and the magic still hold
        path.write_bytes(data[:64] + bytes([data[64] ^ 0xFF]) + data[65:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "unsealed":
        seal_path(path).unlink()
    else:
        raise ValueError(how)


@needs_nvcc
@pytest.mark.parametrize("how", ["empty", "flipped", "truncated", "unsealed"])
def test_damaged_cached_cubin_is_rebuilt(counting_nvcc, tiny_kernel, how, caplog):
    from strata_rt.runtime.compile import cache_problem

    first = compile_cubin(tiny_kernel, "sm_90")
    good = first.read_bytes()
    assert cache_problem(first) is None
    _damage(first, how)
    assert cache_problem(first) is not None
    with caplog.at_level("WARNING", logger="strata_rt.runtime.compile"):
        again = compile_cubin(tiny_kernel, "sm_90")
    assert again == first and counting_nvcc() == 2, "a damaged cubin must be rebuilt"
    assert again.read_bytes() == good, "the rebuild gives the cubin the cache held before"
    assert cache_problem(again) is None
    assert str(first) in caplog.text and "rebuilding" in caplog.text
    compile_cubin(tiny_kernel, "sm_90")
    assert counting_nvcc() == 2, "the rebuilt cubin is trusted again"


@needs_nvcc
def test_check_kernels_rebuilds_an_emptied_cache(counting_nvcc, tmp_path, monkeypatch):
    from strata_rt.runtime import check_kernels
    from strata_rt.runtime import compile as compile_mod

    common = tmp_path / "kernels" / "common"
    common.mkdir(parents=True)
    (common / "good.cu").write_text('extern "C" __global__ void good(int* p) { *p = 1; }\n')
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", tmp_path / "kernels")
    assert all(r.ok for r in check_kernels([], ("sm_90",)))
    assert counting_nvcc() == 1
    cubins = list((tmp_path / "cache").glob("*.cubin"))
    assert len(cubins) == 1
    cubins[0].write_bytes(b"")  # a cache of 0-byte cubins, as a full disk leaves it
    assert all(r.ok for r in check_kernels([], ("sm_90",)))
    assert counting_nvcc() == 2, "check-kernels must rebuild an emptied cubin, not pass it"
    assert cubins[0].stat().st_size > 0


@needs_nvcc
def test_check_kernels_builds_an_arch_specific_source_for_sm_90a_too(counting_nvcc, tmp_path,
                                                                    monkeypatch):
    """A source that guards a body with the sm_90a feature macro is also checked for sm_90a,
    where that body compiles (a broken body there fails the check; elsewhere it is empty)."""
    from strata_rt.runtime import check_kernels
    from strata_rt.runtime import compile as compile_mod

    common = tmp_path / "kernels" / "common"
    common.mkdir(parents=True)
    (common / "plain.cu").write_text('extern "C" __global__ void plain(int* p) { *p = 1; }\n')
    (common / "wg.cu").write_text(
        "#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n"
        'extern "C" __global__ void wg(int* p) { asm volatile("wgmma.fence.sync.aligned;"); '
        "*p = nope; }\n#endif\n")
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", tmp_path / "kernels")
    got = {(r.source.name, r.arch): r for r in check_kernels([], ("sm_80", "sm_90"))}
    assert set(got) == {("plain.cu", "sm_80"), ("plain.cu", "sm_90"), ("wg.cu", "sm_80"),
                        ("wg.cu", "sm_90"), ("wg.cu", "sm_90a")}
    assert got[("wg.cu", "sm_80")].ok and got[("wg.cu", "sm_90")].ok
    assert not got[("wg.cu", "sm_90a")].ok and "nope" in got[("wg.cu", "sm_90a")].message


def test_arch_specific_targets_use_the_explicit_gencode_form():
    from strata_rt.runtime.compile import arch_flag

    assert arch_flag("sm_90") == "-arch=sm_90"
    assert arch_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
