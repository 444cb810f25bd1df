"""The plugin registry: plugins.yaml, entry points, and the errors that name the plugin."""

from __future__ import annotations

import sys
import textwrap
import uuid
from importlib import metadata

import pytest

import strata_rt
from strata_rt.errors import PluginError
from strata_rt.formats import ggml_types
from strata_rt.formats.registry import QuantRegistry
from strata_rt.resources import common_include_dir
from strata_rt.runtime.compile import compile_cubin, nvcc_available

FORMAT_MODULE = """
from strata_rt import hookimpl
from strata_rt.formats.contract import FormatKernels, QuantFormat


class BatchingKernels(FormatKernels):
    def gather_batch(self, stream, srcs, first_pos, gu_buf, down_buf):
        pass


class Fmt(QuantFormat):
    name = {name!r}
    block_values = 32
    block_bytes = 34
    kernel_dir = "none"
    native = {native}

    def kernels_class(self):
        return BatchingKernels if {batches} else FormatKernels


@hookimpl
def strata_rt_formats():
    return [Fmt()]
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """make(body or format name) -> an importable module name; yaml(entries) -> a plugins.yaml."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(name: str | None = None, *, native: bool = True, batches: bool = False,
             body: str | None = None) -> str:
        module = f"strata_test_plugin_{uuid.uuid4().hex[:10]}"
        text = body if body is not None else FORMAT_MODULE.format(
            name=name, native=native, batches=batches)
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(text))
        return module

    def yaml(text: str):
        path = tmp_path / f"plugins_{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(textwrap.dedent(text))
        return path

    make.yaml = yaml
    return make


def listing(*modules: str, disabled: tuple[str, ...] = ()) -> str:
    lines = ["plugins:"]
    lines += [f"  - module: {m}\n    enabled: true" for m in modules]
    lines += [f"  - module: {m}\n    enabled: false" for m in disabled]
    return "\n".join(lines) + "\n"


def test_loads_listed_modules_in_order(plugins):
    a, b = plugins("fmt_a"), plugins("fmt_b")
    path = plugins.yaml(listing(b, a))
    reg = QuantRegistry(path, entry_points=False)
    assert reg.names() == ["fmt_b", "fmt_a"]
    assert reg["fmt_a"].name == "fmt_a"
    assert reg.formats["fmt_a"].plugin == a
    assert reg.formats["fmt_a"].origin == path.name != "plugins.yaml"  # the file it came from
    assert "fmt_b" in reg and "fmt_c" not in reg


def test_disabled_entry_is_not_imported(plugins):
    a = plugins("fmt_a")
    reg = QuantRegistry(plugins.yaml(listing(a, disabled=("no_such_module_xyz",))),
                        entry_points=False)
    assert reg.names() == ["fmt_a"]


def test_unknown_module_is_named(plugins):
    with pytest.raises(PluginError, match=r"plugin no_such_module_xyz \(plugins_\w+.yaml\): "
                                          r"cannot import it"):
        QuantRegistry(plugins.yaml(listing("no_such_module_xyz")), entry_points=False)


@pytest.mark.parametrize("body, error", [
    ("raise RuntimeError('no device table')\n", "RuntimeError: no device table"),
    ("def broken(:\n", "SyntaxError: "),
])
def test_module_failing_on_import_is_named(plugins, body, error):
    bad = plugins(body=body)
    with pytest.raises(PluginError, match=rf"plugin {bad} \(plugins_\w+.yaml\): cannot import "
                                          rf"it: {error}"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


def test_two_formats_with_one_name(plugins):
    a, b = plugins("same"), plugins("same")
    with pytest.raises(PluginError) as info:
        QuantRegistry(plugins.yaml(listing(a, b)), entry_points=False)
    msg = str(info.value)
    assert "two formats named 'same'" in msg and a in msg and b in msg


def test_module_without_hook(plugins):
    empty = plugins(body="VALUE = 1\n")
    with pytest.raises(PluginError, match=f"plugin {empty} .*implements no strata_rt hook"):
        QuantRegistry(plugins.yaml(listing(empty)), entry_points=False)


def test_hook_returning_something_else(plugins):
    odd = plugins(body="""
        from strata_rt import hookimpl

        @hookimpl
        def strata_rt_formats():
            return ["not a format"]
    """)
    with pytest.raises(PluginError, match=rf"plugin {odd} \(plugins_\w+.yaml\): .*not a "
                                          r"strata_rt.formats.contract.QuantFormat"):
        QuantRegistry(plugins.yaml(listing(odd)), entry_points=False)


def test_non_native_format_offering_batched_gather_is_refused(plugins):
    bad = plugins("planar", native=False, batches=True)
    with pytest.raises(PluginError, match=rf"plugin {bad} \(plugins_\w+.yaml\): format planar is "
                                          "not native but offers a batched gather"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)
    # native + batching, and non-native without batching, are both fine
    ok = QuantRegistry(plugins.yaml(listing(plugins("nat", native=True, batches=True),
                                            plugins("plain", native=False))),
                       entry_points=False)
    assert ok["nat"].offers_batched_gather() and not ok["plain"].offers_batched_gather()


@pytest.mark.parametrize("text, match", [
    ("plugins: {module: x}\n", "top-level `plugins:` list"),
    ("plugins:\n  - name: x\n", r"plugins\[0\] must be a mapping with a `module:`"),
    ("plugins:\n  - module: x\n    when: always\n", r"unknown key\(s\) when; allowed"),
    ("plugins:\n  - {module: x, null: 1, when: 2}\n", r"unknown key\(s\) null, when; allowed"),
    ("plugins:\n  - module: x\n    enabled: maybe\n", r"enabled must be true or false"),
    ("plugins: [\n", "not valid YAML"),
])
def test_bad_plugins_yaml(plugins, text, match):
    with pytest.raises(PluginError, match=match):
        QuantRegistry(plugins.yaml(text), entry_points=False)


def test_missing_plugins_yaml(tmp_path):
    with pytest.raises(PluginError, match="plugin list not found"):
        QuantRegistry(tmp_path / "absent.yaml", entry_points=False)


def test_unknown_format_lists_loaded(plugins):
    reg = QuantRegistry(plugins.yaml(listing(plugins("fmt_a"))), entry_points=False)
    with pytest.raises(PluginError, match="unknown format 'nope'; loaded: fmt_a"):
        reg["nope"]


def test_entry_point_plugin_appears_without_plugins_yaml(plugins):
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), entry_points=True, disabled=())
    assert "test_i8" in reg, f"entry point plugin missing; loaded: {reg.names()}"
    loaded = reg.formats["test_i8"]
    assert loaded.origin == "entry point strata-testfmt"
    assert (loaded.plugin, loaded.module) == ("test_i8", "strata_testfmt")
    assert (loaded.distribution, loaded.version) == ("strata-testfmt",
                                                     metadata.version("strata-testfmt"))
    assert reg["test_i8"].native is False
    assert reg.pm.get_plugin("test_i8") is sys.modules["strata_testfmt"]  # pluggy holds it


def test_entry_points_off_hides_it(plugins):
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), entry_points=False)
    assert reg.names() == []


def test_listed_and_published_plugin_loads_once(plugins):
    path = plugins.yaml(listing("strata_testfmt"))
    reg = QuantRegistry(path, entry_points=True, disabled=())
    assert reg.formats["test_i8"].origin == path.name
    assert reg.formats["test_i8"].distribution == "strata-testfmt"
    assert reg.names().count("test_i8") == 1


def test_builtins_report_strata_rt_and_its_version():
    reg = QuantRegistry(entry_points=False, disabled=())
    ggml = [n.lower() for n in ggml_types.NAMES if n not in ("IQ3_XXS", "F16")]
    assert reg.names() == ["iq3_xxs", "q2_blob", "fp16", *ggml]
    for loaded in reg.formats.values():
        module = "ggml" if loaded.format.name in ggml else loaded.format.name
        assert loaded.plugin == loaded.module == f"strata_rt.quants.{module}"
        assert (loaded.distribution, loaded.version) == ("strata_rt", strata_rt.__version__)


# ---------------------------------------------------------------- collected through pluggy
def test_formats_come_through_the_plugin_managers_hook(plugins):
    """Unregistering a plugin from the manager takes its formats away from the hook call: the
    registry asks pluggy, not the module."""
    a, b = plugins("fmt_a"), plugins("fmt_b")
    reg = QuantRegistry(plugins.yaml(listing(a, b)), entry_points=False)
    assert [f.name for fs in reg.pm.hook.strata_rt_formats() for f in fs] == ["fmt_b", "fmt_a"]
    reg.pm.unregister(name=a)
    assert [f.name for fs in reg.pm.hook.strata_rt_formats() for f in fs] == ["fmt_b"]


def test_hook_that_raises_is_named_with_its_line(plugins):
    bad = plugins(body="""
        from strata_rt import hookimpl

        @hookimpl
        def strata_rt_formats():
            raise RuntimeError("no device table")
    """)
    with pytest.raises(PluginError, match=rf"^plugin {bad} \(plugins_\w+.yaml\): "
                                          rf"strata_rt_formats\(\) raised RuntimeError: no device "
                                          rf"table \(at {bad}.py:6\)$"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


def test_broken_import_inside_a_plugin_names_the_missing_module(plugins):
    bad = plugins(body="import numpy\nimport strata_missing_dependency_xyz\n")
    with pytest.raises(PluginError, match=rf"^plugin {bad} \(plugins_\w+.yaml\): cannot import "
                                          r"it: ModuleNotFoundError: No module named "
                                          rf"'strata_missing_dependency_xyz' \(at {bad}.py:2\)$"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


def test_missing_plugin_module_says_where_it_was_looked_for(plugins):
    with pytest.raises(PluginError, match=r"no module named 'no_such_module_xyz' on the Python "
                                          r"path or beside plugins_\w+.yaml"):
        QuantRegistry(plugins.yaml(listing("no_such_module_xyz.sub")), entry_points=False)


@pytest.mark.parametrize("body, error", [
    ("        return None\n", "returned no formats"),
    ("        return []\n", "returned no formats"),
    ("        return 'fmt'\n", "returned 'fmt'; expected a list of formats"),
])
def test_hook_returning_no_list_of_formats(plugins, body, error):
    bad = plugins(body="from strata_rt import hookimpl\n\n@hookimpl\ndef strata_rt_formats():\n"
                       + body)
    with pytest.raises(PluginError, match=rf"plugin {bad} \(plugins_\w+.yaml\): .*{error}"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


def test_misspelled_hook_is_named(plugins):
    bad = plugins(body="""
        from strata_rt import hookimpl

        @hookimpl
        def strata_rt_format():
            return []
    """)
    with pytest.raises(PluginError, match=rf"plugin {bad} .*unknown hook 'strata_rt_format'.*"
                                          "the hook is strata_rt_formats"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


def test_format_methods_that_fail_at_load_are_named(plugins):
    flat = plugins(body=FORMAT_MODULE.format(name="rel", native=False, batches=False).replace(
        "    def kernels_class(self):\n", "    def kernels_class(self):\n"
        "        from .rel_device import Kernels  # noqa\n"))
    with pytest.raises(PluginError, match=rf"plugin {flat} \(plugins_\w+.yaml\): format rel: "
                                          r"ImportError: attempted relative import with no known "
                                          r"parent package \(at .*\); a module that imports its "
                                          r"own siblings relatively .* must live in a package"):
        QuantRegistry(plugins.yaml(listing(flat)), entry_points=False)


def test_kernel_sources_that_do_not_exist_are_named(plugins):
    bad = plugins(body=FORMAT_MODULE.format(name="ghost", native=False, batches=False) + """
Fmt.kernel_sources = lambda self: ["/nonexistent/ghost.cu"]
""")
    with pytest.raises(PluginError, match=r"format ghost lists kernel sources that do not exist: "
                                          r"/nonexistent/ghost.cu"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)


# ---------------------------------------------------------------- disabling
def test_disabled_plugin_is_blocked_and_never_imported(plugins):
    boom = plugins(body="raise RuntimeError('must not be imported')\n")
    a = plugins("fmt_a")
    reg = QuantRegistry(plugins.yaml(listing(a, boom)), entry_points=False, disabled=[boom])
    assert reg.names() == ["fmt_a"]
    assert reg.pm.is_blocked(boom) and reg.disabled == {boom: "STRATA_DISABLE_PLUGINS"}
    assert boom not in sys.modules


def test_disabled_through_the_environment(plugins, monkeypatch):
    monkeypatch.setenv("STRATA_DISABLE_PLUGINS", " test_i8 , ")
    reg = QuantRegistry(plugins.yaml("plugins: []\n"))
    assert "test_i8" not in reg and reg.pm.is_blocked("test_i8")
    # the example plugin's other entry point (tq2_0) still loads
    with pytest.raises(PluginError, match=r"unknown format 'test_i8'; loaded: tq2_0; plugin "
                                          r"test_i8 is disabled \(STRATA_DISABLE_PLUGINS\)"):
        reg["test_i8"]
    monkeypatch.setenv("STRATA_DISABLE_PLUGINS", "")
    assert "test_i8" in QuantRegistry(plugins.yaml("plugins: []\n"))


def test_disabling_an_entry_point_by_its_module_in_plugins_yaml(plugins):
    path = plugins.yaml(listing(disabled=("strata_testfmt",)))
    reg = QuantRegistry(path, entry_points=True, disabled=())
    assert "test_i8" not in reg
    assert reg.disabled == {"strata_testfmt": path.name, "test_i8": path.name}


def test_disabling_an_unknown_plugin_lists_the_known_ones(plugins):
    a = plugins("fmt_a")
    with pytest.raises(PluginError, match=rf"STRATA_DISABLE_PLUGINS names 'fp16', which no "
                                          rf"plugin is called; plugins: {a}, strata_testfmt, "
                                          r"strata_testfmt.tq2_0, test_i8, test_tq2_0$"):
        QuantRegistry(plugins.yaml(listing(a)), disabled=["fp16"])


# ---------------------------------------------------------------- entry point failures
@pytest.fixture
def published(tmp_path, monkeypatch):
    """publish(dist, {entry name: module}, {module: body}): an installed distribution's
    metadata and modules on sys.path, seen by importlib.metadata like any install."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def publish(dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
        info = tmp_path / f"{dist}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        lines = "".join(f"{name} = {module}\n" for name, module in entries.items())
        (info / "entry_points.txt").write_text(f"[strata_rt.quants]\n{lines}")
        for module, body in modules.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))

    return publish


def test_entry_point_with_a_broken_import(plugins, published):
    module = f"strata_ep_{uuid.uuid4().hex[:8]}"
    published("broken-dist", {"broken_ep": module}, {module: "import strata_no_such_dep_xyz\n"})
    with pytest.raises(PluginError, match=rf"^plugin broken_ep \(entry point broken-dist\): "
                                          rf"cannot import {module}: ModuleNotFoundError: No "
                                          rf"module named 'strata_no_such_dep_xyz' \(at "
                                          rf"{module}.py:1\)$"):
        QuantRegistry(plugins.yaml("plugins: []\n"), disabled=())
    # disabled, it is never imported and the rest loads
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), disabled=["broken_ep"])
    assert "test_i8" in reg and module not in sys.modules


def test_entry_point_plugin_reports_its_distribution(plugins, published):
    module = f"strata_ep_{uuid.uuid4().hex[:8]}"
    published("good-dist", {"good_ep": module},
              {module: FORMAT_MODULE.format(name="ep_fmt", native=False, batches=False)})
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), disabled=())
    loaded = reg.formats["ep_fmt"]
    assert (loaded.plugin, loaded.module, loaded.origin) == ("good_ep", module,
                                                             "entry point good-dist")
    assert (loaded.distribution, loaded.version) == ("good-dist", "1.2.3")


def test_entry_point_without_hook(plugins, published):
    module = f"strata_ep_{uuid.uuid4().hex[:8]}"
    published("empty-dist", {"empty_ep": module}, {module: "VALUE = 1\n"})
    with pytest.raises(PluginError, match=r"plugin empty_ep \(entry point empty-dist\) "
                                          "implements no strata_rt hook"):
        QuantRegistry(plugins.yaml("plugins: []\n"), disabled=())


def test_two_distributions_publishing_one_plugin_name(plugins, published):
    m1, m2 = (f"strata_ep_{uuid.uuid4().hex[:8]}" for _ in range(2))
    published("dist-one", {"same_ep": m1}, {})
    published("dist-two", {"same_ep": m2}, {})
    with pytest.raises(PluginError, match=r"two plugins named 'same_ep' publish entry points"):
        QuantRegistry(plugins.yaml("plugins: []\n"), disabled=())


# ---------------------------------------------------------------- plugin kernels
@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
def test_plugin_kernel_includes_the_shared_headers_by_name(tmp_path, monkeypatch):
    """A plugin's kernels live outside strata_rt; common_include_dir() is on nvcc's include
    path, so they include the shared headers by name (or as common/<name>)."""
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "cache"))
    assert (common_include_dir() / "mma.cuh").is_file()
    src = tmp_path / "my_plugin" / "kernels" / "probe.cu"
    src.parent.mkdir(parents=True)
    src.write_text('#include <cuda_fp16.h>\n#include "mma.cuh"\n#include "common/q8_1.cuh"\n'
                   'extern "C" __global__ void probe(Ids16 ids, int* out) '
                   '{ out[0] = ids.v[0]; }\n')
    assert compile_cubin(src, "sm_80").stat().st_size > 0


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
def test_check_kernels_without_the_shared_kernels_fails(tmp_path, monkeypatch, capsys):
    """An install that lost its package data must not report "0 of 0 compiled" and succeed."""
    from strata_rt.cli import main
    from strata_rt.runtime import compile as compile_mod

    (tmp_path / "kernels" / "common").mkdir(parents=True)
    monkeypatch.setattr(compile_mod, "KERNELS_ROOT", tmp_path / "kernels")
    assert main(["check-kernels"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("strata check-kernels: no kernel sources in ") and "Traceback" not in err
    assert str(tmp_path / "kernels" / "common") in err
