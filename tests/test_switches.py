"""Where environment switches are read: engine switches once, in EngineConfig (a field the caller
sets beats its switch), process switches where config/settings/env.py's docstring says; an AST scan
of strata_rt/ and quants/ holds every module to it. Then the fields themselves: how each engine
switch resolves, and that the CUDA backend takes them from the config, not the environment."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _settings import check_engine_setting

from strata_rt.config.settings import env
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError
from strata_rt.weights.model import SMALL_SPEC, Model

ROOT = Path(__file__).resolve().parent.parent

#: the process switches and the one module that reads each (config/settings/env.py's docstring
#: says the same)
PROCESS_SWITCHES = {
    "STRATA_KERNEL_CACHE": "strata_rt/runtime/compile.py",
    "STRATA_NVCC": "strata_rt/runtime/compile.py",
    "STRATA_CONVERT_CACHE": "strata_rt/weights/convert_cache.py",
    "STRATA_PLUGINS": "strata_rt/formats/registry.py",
    "STRATA_DISABLE_PLUGINS": "strata_rt/formats/registry.py",
    "STRATA_HOST_MEMORY_CHECK": "strata_rt/config/hostmem.py",
    "STRATA_CUTLASS_DIR": "strata_rt/gemm/cutlass_gemm.py",
    "STRATA_OVERLAP_LAUNCH": "strata_rt/runtime/device.py",
}
ENGINE_SWITCHES = frozenset(env.SWITCHES) - frozenset(PROCESS_SWITCHES)
#: what may be read outside config/settings/engine_config.py and the process switches' modules,
#: and why
OTHER_READS = {
    # the CLI checks every switch at startup and sets STRATA_PLUGINS from --plugins
    "strata_rt/cli/__init__.py": {"every switch", "STRATA_PLUGINS"},
    # a run config's memory check sizes the router's buffers before an engine exists
    "strata_rt/config/run/schema.py": {"STRATA_ROUTING"},
    # where the CUDA toolkit's libcublas lies (CUDA_HOME, CUDA_PATH; no strata_rt switch)
    "strata_rt/gemm/cublas.py": {"os.environ[?]"},
}
#: env's functions that read the environment (the others, such as env.problem, check a
#: value they are given)
ENV_READERS = {"flag", "text", "choice", "integer", "_raw", "_checked", "unknown",
               "validate_all"}
OS_READERS = {"environ", "getenv", "putenv", "unsetenv"}


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments (a switch named through a constant)."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.update({t.id: node.value.value for t in node.targets
                        if isinstance(t, ast.Name)})
    return out


def _name_of(arg: ast.expr | None, constants: dict[str, str]) -> str | None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name):
        return constants.get(arg.id)
    return None


def environment_reads(source: str) -> set[str]:
    """Every environment access of a module's source: the switch (or variable) named where
    the name is a string or a module constant, "os.environ[?]" where it is not, "every
    switch" for env.validate_all / env.unknown."""
    tree = ast.parse(source)
    constants = _constants(tree)
    env_names: set[str] = set()  # names the env module is bound to
    readers: set[str] = set()  # env reader functions imported by name
    os_names: set[str] = set()  # os.environ / os.getenv imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                bound = alias.asname or alias.name
                if alias.name == "env" and module in ("", "settings", "config.settings",
                                                      "strata_rt.config.settings"):
                    env_names.add(bound)
                elif module.endswith("env") and alias.name in ENV_READERS:
                    readers.add(bound)
                elif module == "os" and alias.name in OS_READERS:
                    os_names.add(bound)
        elif isinstance(node, ast.Import):
            env_names.update(a.asname for a in node.names
                             if a.name == "strata_rt.config.settings.env" and a.asname)
    found: set[str] = set()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        called = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in env_names and node.attr in ENV_READERS:
                called = node.attr
            elif node.value.id == "os" and node.attr in OS_READERS:
                found.add(_os_key(node, parents, constants))
        elif isinstance(node, ast.Name) and node.id in os_names:
            found.add(_os_key(node, parents, constants))
        elif isinstance(node, ast.Name) and node.id in readers:
            called = node.id
        if called is not None:
            call = parents.get(node)
            if called in ("unknown", "validate_all"):
                found.add("every switch")
            elif isinstance(call, ast.Call) and call.func is node:
                found.add(_name_of(call.args[0] if call.args else None, constants) or "?")
            else:
                found.add("?")
    return found


def _os_key(node: ast.expr, parents: dict, constants: dict[str, str]) -> str:
    """The variable an os.environ access names: os.environ[K], os.environ.get(K),
    os.getenv(K)."""
    up = parents.get(node)
    if isinstance(up, ast.Subscript) and up.value is node:
        key = _name_of(up.slice, constants)
    elif isinstance(up, ast.Attribute) and isinstance(parents.get(up), ast.Call):
        call = parents[up]
        key = _name_of(call.args[0] if call.args else None, constants)
    elif isinstance(up, ast.Call) and up.func is node:
        key = _name_of(up.args[0] if up.args else None, constants)
    else:
        key = None
    return key or "os.environ[?]"


def _modules() -> Iterator[tuple[str, str]]:
    """(path from the checkout, source) of every module of strata_rt/ and quants/ (the
    package's quants link is quants/ itself: read once)."""
    for top in ("strata_rt", "quants"):
        for folder, dirs, files in os.walk(ROOT / top):  # does not follow the quants link
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = Path(folder) / name
                    yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_the_scan_finds_every_kind_of_read() -> None:
    """The scanner itself: each way of reading the environment is found and named."""
    source = '''
import os
from os import getenv
from strata_rt.config.settings import env
from strata_rt.config.settings.env import flag as on
from . import env as switches
NAME = "STRATA_DECODE"
a = os.environ.get("HOME")
b = os.environ["STRATA_NVCC"]
c = getenv("PATH")
d = env.flag("STRATA_CUDA_GRAPH")
e = switches.choice(NAME, "routed")
f = on("STRATA_CHECK_PLAN")
g = env.problem("STRATA_IMAGE_CACHE_MIB", "12")
env.validate_all()
for v in ("CUDA_HOME",):
    h = os.environ.get(v)
'''
    assert environment_reads(source) == {
        "HOME", "STRATA_NVCC", "PATH", "STRATA_CUDA_GRAPH", "STRATA_DECODE",
        "STRATA_CHECK_PLAN", "every switch", "os.environ[?]"}
    assert environment_reads("from . import env\nx = env.problem('STRATA_NVCC', 'n')\n") == set()


def test_nothing_below_the_engine_config_reads_the_environment() -> None:
    allowed: dict[str, set[str]] = {
        "strata_rt/config/settings/engine_config.py": set(ENGINE_SWITCHES)}
    for name, module in PROCESS_SWITCHES.items():
        allowed.setdefault(module, set()).add(name)
    for module, names in OTHER_READS.items():
        allowed.setdefault(module, set()).update(names)
    offenders, engine_config_reads = [], set()
    for path, source in _modules():
        if path == "strata_rt/config/settings/env.py":  # the readers themselves
            continue
        reads = environment_reads(source)
        if path == "strata_rt/config/settings/engine_config.py":
            engine_config_reads = reads
        extra = reads - allowed.get(path, set())
        if extra:
            offenders.append(f"{path}: {', '.join(sorted(extra))}")
    assert not offenders, ("modules that read the environment outside EngineConfig and the "
                           "process switches' modules:\n  " + "\n  ".join(offenders))
    # every engine switch is resolved there (a new switch is one or the other, not neither)
    assert engine_config_reads == ENGINE_SWITCHES, ENGINE_SWITCHES ^ engine_config_reads


def test_env_docstring_says_where_each_switch_is_read() -> None:
    doc = " ".join((env.__doc__ or "").split())
    assert "engine_config.py" in doc
    for name in ENGINE_SWITCHES:
        assert name in doc, name
    for name, module in PROCESS_SWITCHES.items():
        assert name in doc and module.removeprefix("strata_rt/") in doc, (name, module)


@pytest.mark.parametrize("field, switch, default, explicit, from_env, bad", [
    ("decode", "STRATA_DECODE", "auto", "routed", "staging", "graph"),
    ("dense_gemm", "STRATA_DENSE_GEMM", "cublas", "cublas", "own", "cutlass"),
    ("decode_dense", "STRATA_DECODE_DENSE", "gemv", "gemv", "gemm", "own"),
    ("decode_argmax", "STRATA_DECODE_ARGMAX", "device", "device", "host", "gpu"),
    ("embedding", "STRATA_EMBEDDING", "auto", "device", "host", "gpu"),
    ("f16_gemm", "STRATA_F16_GEMM", "auto", "cutlass", "own", "fast"),
    ("prefill_attention", "STRATA_PREFILL_ATTENTION", "mma", "auto", "wgmma", "flash"),
    ("decode_attention", "STRATA_DECODE_ATTENTION", "split", "split", "tiled", "flash"),
    ("prefill_stream", "STRATA_PREFILL_STREAM", "auto", "walk", "routed", "stream"),
])
def test_choice_switches_resolve_into_fields(monkeypatch, field, switch, default, explicit,
                                             from_env, bad) -> None:
    check_engine_setting(monkeypatch, field, switch, default, explicit, from_env, bad, bad)


def test_cuda_graph_and_mmq_kernel_resolve_into_fields(monkeypatch) -> None:
    def resolved(**kw: object) -> EngineConfig:
        return EngineConfig(model=SMALL_SPEC, **kw).resolve()  # type: ignore[arg-type]

    for name in ("STRATA_CUDA_GRAPH", "STRATA_MMQ_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    assert resolved().cuda_graph is True and resolved().mmq_kernel is None
    monkeypatch.setenv("STRATA_CUDA_GRAPH", "0")
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "int8")
    assert resolved().cuda_graph is False and resolved().mmq_kernel == "int8"
    cfg = resolved(cuda_graph=True, mmq_kernel="f16_pipe")
    assert cfg.cuda_graph is True and cfg.mmq_kernel == "f16_pipe"
    monkeypatch.setenv("STRATA_CUDA_GRAPH", "yes")
    with pytest.raises(ConfigError, match="STRATA_CUDA_GRAPH"):
        resolved()


def test_the_cuda_backend_takes_its_switches_from_the_config(fake, monkeypatch,
                                                              fixed_walk_rule) -> None:
    """The environment says graphs on and the CUTLASS fp16 GEMM (which the fake runtime could
    not run); the config says no graphs and the own GEMM: the backend follows the config (no
    graph captured on a repeated walk chunk, the runtime's fp16 GEMM policy is the config's)."""
    monkeypatch.setenv("STRATA_CUDA_GRAPH", "1")
    model = Model.synthetic(SMALL_SPEC, 3)
    cfg = EngineConfig(model=model, backend="cuda", expert_cache=SMALL_SPEC.total_experts // 2,
                       cuda_graph=False, f16_gemm="own")
    monkeypatch.setenv("STRATA_F16_GEMM", "cutlass")  # would refuse the fake runtime
    with Engine.open(cfg) as eng:
        rt, backend = fake["rt"], eng.backend
        assert backend is not None and rt.f16_gemm == "own" and not backend.can_capture
        rt.tokens = 2048
        for _ in range(3):
            rt.launches.clear()
            eng.prefill(np.ones((2048, SMALL_SPEC.hidden), np.float32))
            assert "graph" not in rt.launches
        assert eng.driver.graph_trials and all(t == {} for t in eng.driver.graph_trials.values())
