"""Plugin failures as a user meets them on the command line: a hook that raises, a plugin whose
import fails, and the README's plugin skeleton. Each gives exit 1 (PluginError) and one message
that names the plugin, without a traceback, both through `strata_rt.cli.main` and in a fresh
`strata` process; the skeleton, laid out as the README says, loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from strata_rt.cli import main
from strata_rt.errors import PluginError
from strata_rt.formats.registry import registry

ROOT = Path(__file__).resolve().parent.parent

RAISING_HOOK = """
from strata_rt import hookimpl


@hookimpl
def strata_rt_formats():
    raise RuntimeError("device table missing")
"""

BROKEN_IMPORT = """
import numpy as np
import strata_missing_dependency_xyz  # noqa: F401
"""

DEVICE_MODULE = """
from strata_rt.formats.contract import FormatKernels


class MyQ4Kernels(FormatKernels):
    pass
"""


def readme_skeleton() -> str:
    """The Python block of the README's QuantFormat walk-through ("Writing a format plugin"),
    verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Any other format: a QuantFormat"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def strata(*args: str, cwd: Path, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    """`strata` in a fresh interpreter, run from `cwd`, with no plugin switches inherited."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("STRATA_PLUGINS", "STRATA_DISABLE_PLUGINS")}
    return subprocess.run([sys.executable, "-m", "strata_rt.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})})


def plugin_dir(tmp_path: Path, files: dict[str, str], modules: list[str]) -> Path:
    """Writes files (relative path -> text) and a plugins.yaml listing `modules` beside them;
    returns the plugins.yaml."""
    for rel, body in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body))
    listing = tmp_path / "plugins.yaml"
    listing.write_text("plugins:\n" + "".join(f"  - module: {m}\n" for m in modules))
    return listing


def assert_one_message(stderr: str, *parts: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("strata plugins: plugin "), stderr
    for part in parts:
        assert part in lines[0], (part, stderr)


@pytest.fixture
def in_process():
    """Runs `main` with --plugins, then restores the process-wide registry it replaced."""
    before = os.environ.get("STRATA_PLUGINS")
    yield main
    if before is None:
        os.environ.pop("STRATA_PLUGINS", None)
    else:
        os.environ["STRATA_PLUGINS"] = before
    registry(reload=True)


CASES = {
    "hook raises": (RAISING_HOOK, "strata_rt_formats() raised RuntimeError: device table "
                                  "missing (at {module}.py:7)"),
    "broken import": (BROKEN_IMPORT, "cannot import it: ModuleNotFoundError: No module named "
                                     "'strata_missing_dependency_xyz' (at {module}.py:3)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plugin_failure_through_main(case, tmp_path, in_process, capsys):
    body, message = CASES[case]
    module = f"strata_fail_{uuid.uuid4().hex[:10]}"
    listing = plugin_dir(tmp_path, {f"{module}.py": body}, [module])
    assert in_process(["--plugins", str(listing), "plugins"]) == PluginError.exit_code == 1
    err = capsys.readouterr().err
    assert_one_message(err, f"plugin {module} (plugins.yaml): ", message.format(module=module))


@pytest.mark.parametrize("case", sorted(CASES))
def test_plugin_failure_in_a_fresh_process(case, tmp_path):
    body, message = CASES[case]
    module = f"strata_fail_{uuid.uuid4().hex[:10]}"
    listing = plugin_dir(tmp_path, {f"{module}.py": body}, [module])
    done = strata("--plugins", str(listing), "plugins", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert_one_message(done.stderr, f"plugin {module} (plugins.yaml): ",
                       message.format(module=module))
    # switched off, the broken plugin is never imported and the built-ins still load
    done = strata("--plugins", str(listing), "plugins", cwd=tmp_path,
                  env={"STRATA_DISABLE_PLUGINS": module})
    assert done.returncode == 0, done.stderr
    assert f"disabled: {module} (by STRATA_DISABLE_PLUGINS)" in done.stdout


def test_failing_entry_point_plugin_in_a_fresh_process(tmp_path):
    module = f"strata_ep_fail_{uuid.uuid4().hex[:8]}"
    info = tmp_path / "site" / "broken_plugin-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[strata_rt.quants]\nbroken_q4 = {module}\n")
    (tmp_path / "site" / f"{module}.py").write_text(RAISING_HOOK)
    env = {"PYTHONPATH": str(tmp_path / "site")}
    done = strata("plugins", cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert_one_message(done.stderr, "plugin broken_q4 (entry point broken-plugin): ",
                       f"raised RuntimeError: device table missing (at {module}.py:7)")
    done = strata("plugins", "--json", cwd=tmp_path,
                  env={**env, "STRATA_DISABLE_PLUGINS": "broken_q4"})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert {"plugin": "broken_q4", "by": "STRATA_DISABLE_PLUGINS"} in doc["disabled"]


def test_readme_skeleton_loads_as_a_package(tmp_path):
    """The README's skeleton, verbatim, as my_q4_plugin/my_q4.py beside my_q4_device.py, listed
    in a plugins.yaml next to the package: found without installing, from any directory."""
    listing = plugin_dir(tmp_path / "work", {
        "my_q4_plugin/__init__.py": "",
        "my_q4_plugin/my_q4.py": readme_skeleton(),
        "my_q4_plugin/my_q4_device.py": DEVICE_MODULE,
    }, ["my_q4_plugin.my_q4"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = strata("--plugins", str(listing), "plugins", "--json", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    formats = {f["format"]: f for f in json.loads(done.stdout)["formats"]}
    assert "my_q4" in formats and "iq3_xxs" not in formats  # the list replaces the built-in one
    mine = formats["my_q4"]
    assert (mine["plugin"], mine["origin"]) == ("my_q4_plugin.my_q4", "plugins.yaml")
    assert mine["distribution"] is None and mine["block_bytes"] == 18


def test_readme_skeleton_as_a_lone_module_says_to_make_it_a_package(tmp_path):
    listing = plugin_dir(tmp_path, {"my_q4.py": readme_skeleton(),
                                    "my_q4_device.py": DEVICE_MODULE}, ["my_q4"])
    done = strata("--plugins", str(listing), "plugins", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert_one_message(done.stderr, "plugin my_q4 (plugins.yaml): format my_q4: ImportError: "
                       "attempted relative import with no known parent package",
                       "must live in a package (a folder with __init__.py): list it as "
                       "`package.module`")


@pytest.mark.parametrize("written, name", [("''", ""), ("..", ".."), (".rel", ".rel"),
                                           ("a..b", "a..b"), ("/etc/passwd", "/etc/passwd")])
def test_a_module_that_is_no_module_name(written, name, tmp_path, in_process, capsys):
    """An empty or relative name raised the import machinery's own errors, quoted with their
    exception types ("ValueError: Empty module name"); it is refused as the list's problem."""
    listing = plugin_dir(tmp_path, {}, [written])
    assert in_process(["--plugins", str(listing), "plugins"]) == 1
    err = capsys.readouterr().err
    assert err == (f"strata plugins: {listing}: plugins[0].module: got {name!r}; expected a "
                   "Python module name (words of letters, digits and _ joined by dots, e.g. "
                   "my_formats.q4)\n")
