"""strata_rt as a user installs it, not as the checkout runs it.

The sdist and the wheels are built from a copy of the working tree (so the checkout gains no
build/ or egg-info); the sdist must hold the kernels, the built-in formats and plugins.yaml as
files, a wheel built from the sdist must hold what the checkout's wheel holds, and the wheel,
installed into a fresh virtual environment, must list the three built-in formats, compile every
kernel and run the demo config from a directory outside the checkout.

Dependencies come from the package index through pip's cache; the environment is created
without --system-site-packages, so nothing of the development environment leaks in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import strata_rt
from strata_rt.formats.registry import QuantRegistry
from strata_rt.resources import BUILTIN_PLUGINS_YAML
from strata_rt.runtime.compile import nvcc_available

pytestmark = [pytest.mark.wheel, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
#: the built-in formats and the plugin module of each, from the package's own plugin list (no
#: entry points: the test plugin is not in the wheel)
_OWN = QuantRegistry(BUILTIN_PLUGINS_YAML, entry_points=False)
BUILTINS = {name: loaded.plugin for name, loaded in _OWN.formats.items()}
ARCHS = ("sm_80", "sm_90")
#: what a build never reads: environments, caches, earlier builds, version control
SKIP = shutil.ignore_patterns(".git", ".venv", ".whl", "build", "dist", "out", "*.egg-info",
                              "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
                              ".mypy_cache")


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} exited {done.returncode}:\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def package_files(folder: str) -> set[str]:
    """Files under the top-level kernels/ or quants/, as paths inside the strata_rt package."""
    return {f"strata_rt/{folder}/{p.relative_to(ROOT / folder).as_posix()}"
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


EXPECTED = package_files("kernels") | package_files("quants") | {"strata_rt/plugins.yaml"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """sdist, wheel from the sdist (python -m build) and wheel from the tree (pip wheel)."""
    tmp = tmp_path_factory.mktemp("dists")
    src = tmp / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=SKIP)
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the `build` package is missing: install the test extras "
                    "(pip install -e '.[test]')")
    run([sys.executable, "-m", "build", "--outdir", tmp / "build", src], cwd=tmp)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp / "pip", src], cwd=tmp)
    (sdist,) = (tmp / "build").glob("strata_rt-*.tar.gz")
    (from_sdist,) = (tmp / "build").glob("strata_rt-*.whl")
    (wheel,) = (tmp / "pip").glob("strata_rt-*.whl")
    return {"sdist": sdist, "from_sdist": from_sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory) -> dict:
    """The wheel in a fresh virtual environment; commands run from a folder outside the
    checkout with no STRATA_* switch or PYTHONPATH inherited."""
    tmp = tmp_path_factory.mktemp("installed")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", dists["wheel"]], cwd=tmp)
    outside = tmp / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STRATA_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["STRATA_KERNEL_CACHE"] = str(tmp / "kernel-cache")  # compile everything afresh
    env["PATH"] = os.pathsep.join([str(env_dir / "bin"), env.get("PATH", "")])
    return {"python": python, "strata": env_dir / "bin" / "strata", "cwd": outside, "env": env}


def test_sdist_holds_the_package_data_as_files(dists):
    with tarfile.open(dists["sdist"]) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    links = sorted(n for n, m in members.items() if m.issym() or m.islnk())
    assert not links, f"the sdist holds links, which a build from it may not follow: {links}"
    missing = sorted(EXPECTED - {n for n, m in members.items() if m.isfile()})
    assert not missing, f"the sdist lacks {missing}"
    assert "configs/demo.yaml" in members and "tests/conftest.py" in members


def test_wheels_from_tree_and_from_sdist_hold_the_same_package(dists):
    def names(path: Path) -> set[str]:
        with zipfile.ZipFile(path) as z:
            return {n for n in z.namelist() if ".dist-info/" not in n}

    tree, from_sdist = names(dists["wheel"]), names(dists["from_sdist"])
    assert tree == from_sdist, (sorted(tree - from_sdist), sorted(from_sdist - tree))
    missing = sorted(EXPECTED - tree)
    assert not missing, f"the wheel lacks {missing}"
    assert {n.split("/", 1)[0] for n in tree} == {"strata_rt"}  # no top-level quants or kernels


def test_installed_wheel_lists_the_builtin_formats(installed):
    done = run([installed["strata"], "plugins", "--json"], cwd=installed["cwd"],
               env=installed["env"])
    formats = {f["format"]: f for f in json.loads(done.stdout)["formats"]}
    assert set(formats) == set(BUILTINS) and {"iq3_xxs", "q4_k", "mxfp4"} <= set(BUILTINS)
    site = installed["python"].parent.parent
    for f in formats.values():
        assert (f["distribution"], f["version"]) == ("strata_rt", strata_rt.__version__)
        assert f["plugin"] == BUILTINS[f["format"]]
        assert f["kernel_sources"] and all(Path(p).is_relative_to(site)
                                           for p in f["kernel_sources"])
    table = run([installed["strata"], "plugins"], cwd=installed["cwd"], env=installed["env"])
    assert all(f"| {name} " in table.stdout for name in BUILTINS)
    probe = run([installed["python"], "-c", "import importlib.util, strata_rt; "
                 "print(strata_rt.__file__); print(importlib.util.find_spec('quants'))"],
                cwd=installed["cwd"], env=installed["env"])
    where, quants = probe.stdout.split()
    assert Path(where).is_relative_to(site) and quants == "None"


def test_installed_wheel_compiles_every_kernel(installed):
    if not nvcc_available():
        pytest.skip("nvcc not on PATH: the kernel compile check needs the CUDA toolkit")
    done = run([installed["strata"], "check-kernels"], cwd=installed["cwd"],
               env=installed["env"])
    sources = sorted(p.relative_to(ROOT / "kernels").as_posix()
                     for p in (ROOT / "kernels").rglob("*.cu"))
    # the CUTLASS library builds for sm_90a alone, from headers this fresh venv lacks: its line
    # says it was skipped and why (the library's own build is tested in test_cutlass_gemm.py)
    library = "cutlass/grouped_gemm_sm90.cu"
    assert library in sources
    sources.remove(library)
    # a source guarded for sm_90a is also built for it (check_kernels: ARCH_SPECIFIC_MARK)
    from strata_rt.runtime.compile import ARCH_SPECIFIC_MARK

    marked = sum(ARCH_SPECIFIC_MARK in (ROOT / "kernels" / rel).read_text() for rel in sources)
    want = len(sources) * len(ARCHS) + (marked if "sm_90" in ARCHS else 0)
    assert want > 0 and marked >= 1
    ok = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == want, done.stdout
    assert f"{want} of {want} compiled ({', '.join(ARCHS)})" in done.stdout
    for rel in sources:
        assert sum(f"  {Path(rel).name}  " in line for line in ok) >= len(ARCHS), rel
    skipped = [line for line in done.stdout.splitlines() if line.startswith("skip ")]
    assert skipped == ["skip cutlass    sm_90a  grouped_gemm_sm90.cu (the nvidia-cutlass "
                       "package is not installed)"], done.stdout
    probe = run([installed["python"], "-c", "from strata_rt.gemm.cutlass_gemm import CUTLASS_SOURCE;"
                 " print(CUTLASS_SOURCE.is_file())"], cwd=installed["cwd"], env=installed["env"])
    assert probe.stdout.strip() == "True", "the wheel lacks the CUTLASS library's source"


def test_installed_wheel_runs_the_demo(installed):
    done = run([installed["strata"], "run", ROOT / "configs" / "demo.yaml", "--backend",
                "reference", "--prompts", "8", "--json", installed["cwd"] / "demo.json"],
               cwd=installed["cwd"], env=installed["env"])
    assert "backend reference" in done.stdout and "Traceback" not in done.stderr
    doc = json.loads((installed["cwd"] / "demo.json").read_text())
    (row,) = doc["runs"]
    assert row["tokens"] == 8 and row["stats"]["tokens"] == 8
