"""The plugin registry: plugins.yaml, entry points, and the errors that name the plugin."""

from __future__ import annotations

import textwrap
import uuid

import pytest

from strata_rt.errors import PluginError
from strata_rt.registry import QuantRegistry

FORMAT_MODULE = """
from strata_rt import hookimpl
from strata_rt.formats import FormatKernels, QuantFormat


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
    with pytest.raises(PluginError, match=f"plugin {odd}: .*not a strata_rt.formats.QuantFormat"):
        QuantRegistry(plugins.yaml(listing(odd)), entry_points=False)


def test_non_native_format_offering_batched_gather_is_refused(plugins):
    bad = plugins("planar", native=False, batches=True)
    with pytest.raises(PluginError, match=f"plugin {bad}: format planar is not native but "
                                          "offers a batched gather"):
        QuantRegistry(plugins.yaml(listing(bad)), entry_points=False)
    # native + batching, and non-native without batching, are both fine
    ok = QuantRegistry(plugins.yaml(listing(plugins("nat", native=True, batches=True),
                                            plugins("plain", native=False))),
                       entry_points=False)
    assert ok["nat"].offers_batched_gather() and not ok["plain"].offers_batched_gather()


@pytest.mark.parametrize("text, match", [
    ("plugins: {module: x}\n", "top-level `plugins:` list"),
    ("plugins:\n  - name: x\n", r"plugins\[0\] must be a mapping with a `module:`"),
    ("plugins:\n  - module: x\n    when: always\n", r"unknown key\(s\) \['when'\]"),
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
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), entry_points=True)
    assert "test_i8" in reg, f"entry point plugin missing; loaded: {reg.names()}"
    loaded = reg.formats["test_i8"]
    assert loaded.origin == "entry point strata-testfmt"
    assert loaded.plugin == "strata_testfmt"
    assert reg["test_i8"].native is False


def test_entry_points_off_hides_it(plugins):
    reg = QuantRegistry(plugins.yaml("plugins: []\n"), entry_points=False)
    assert reg.names() == []


def test_listed_and_published_plugin_loads_once(plugins):
    path = plugins.yaml(listing("strata_testfmt"))
    reg = QuantRegistry(path, entry_points=True)
    assert reg.formats["test_i8"].origin == path.name
    assert reg.names().count("test_i8") == 1
