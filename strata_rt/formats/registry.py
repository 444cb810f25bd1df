"""Loads quant plugins with pluggy and checks each format against the contract before anything
uses it.

Plugins come from two places, in this order: the modules a plugins.yaml lists (the built-in
list inside the package, or STRATA_PLUGINS / `strata --plugins PATH`), then the entry points of
the group `strata_rt.quants` that installed distributions publish. One pluggy PluginManager
holds them all: entry points load through `pm.load_setuptools_entrypoints`, formats are
collected through the manager's hook caller, and a disabled plugin (`enabled: false` in
plugins.yaml, or STRATA_DISABLE_PLUGINS) is blocked by name (`pm.set_blocked`), so it is never
imported.

A plugin's code runs at import, in its hook and in the format methods the checks call; any
error there, like every broken promise of the contract, becomes one PluginError that names the
plugin and where it came from, with the file and line where it was raised.
"""

from __future__ import annotations

import importlib
import logging
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pluggy

from ..config.files.input_files import CONFIG_LIMIT, InputFileError, read_text
from ..config.files.yaml_input import YamlProblem, load_yaml, shown_value
from ..config.settings import env
from ..errors import PluginError
from ..resources import BUILTIN_PLUGINS_YAML
from . import hookspecs
from .contract import QuantFormat

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "strata_rt.quants"
DEFAULT_PLUGINS_YAML = BUILTIN_PLUGINS_YAML
#: the environment switch naming plugins to skip (comma-separated plugin or module names)
DISABLE_SWITCH = "STRATA_DISABLE_PLUGINS"
_HOOK = "strata_rt_formats"
_IDENTITY = ("name", "block_values", "block_bytes")
_ACTIVATIONS = ("q8_1", "f16")  # the encodings kernels/common builds
_RELATIVE_IMPORT_HINT = (
    "; a module that imports its own siblings relatively (`from .x import ...`) must live in a "
    "package (a folder with __init__.py): list it as `package.module`")


@dataclass(frozen=True)
class PluginEntry:
    """One line of a plugins.yaml."""

    module: str
    enabled: bool


@dataclass(frozen=True)
class LoadedFormat:
    """A format and the plugin that provided it."""

    format: QuantFormat
    plugin: str  # the name the plugin is registered (and disabled) under
    origin: str  # the plugins.yaml that listed it, or "entry point <distribution>"
    module: str = ""  # the plugin's module
    distribution: str | None = None  # the installed distribution that ships the module
    version: str | None = None  # that distribution's version


def read_plugins_yaml(path: Path) -> list[PluginEntry]:
    """The entries of a plugins.yaml, in order, disabled ones included."""
    try:
        doc = load_yaml(read_text(path, CONFIG_LIMIT, "a plugins.yaml")) or {}
    except InputFileError as e:
        if e.why == "no such file":
            raise PluginError(f"{path}: plugin list not found") from None
        if e.why.startswith("is a directory"):
            raise PluginError(f"{path}: is a directory; expected a plugins.yaml file") from None
        raise PluginError(f"{path}: cannot read the plugin list: {e.why}") from None
    except YamlProblem as e:
        raise PluginError(f"{path}: {e}") from None
    entries = doc.get("plugins") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise PluginError(f"{path}: expected a top-level `plugins:` list of {{module, enabled}}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
            raise PluginError(f"{path}: plugins[{i}] must be a mapping with a `module:` string")
        module = entry["module"]
        if not all(part.isidentifier() for part in module.split(".")):
            shown = repr(module) if len(module) <= 80 else repr(module[:80]) + "..."
            raise PluginError(f"{path}: plugins[{i}].module: got {shown}; expected a Python "
                              "module name (words of letters, digits and _ joined by dots, "
                              "e.g. my_formats.q4)")
        unknown = set(entry) - {"module", "enabled"}
        if unknown:
            names = sorted(k if isinstance(k, str) else shown_value(k) for k in unknown)
            raise PluginError(f"{path}: plugins[{i}] has unknown key(s) {', '.join(names)}; "
                              "allowed: module, enabled")
        enabled = entry.get("enabled", True)
        if not isinstance(enabled, bool):
            raise PluginError(f"{path}: plugins[{i}].enabled must be true or false")
        out.append(PluginEntry(entry["module"], enabled))
    return out


def disabled_from_env() -> list[str]:
    """The plugin names in STRATA_DISABLE_PLUGINS (comma-separated; blanks ignored)."""
    value = env.text(DISABLE_SWITCH)
    return [n.strip() for n in (value or "").split(",") if n.strip()]


def _raised_at(e: BaseException) -> str:
    """` (at file.py:LINE)` for the innermost frame of e's traceback outside the import
    machinery and this module: where a plugin's own code failed."""
    if isinstance(e, SyntaxError) and e.filename:
        return ""  # its message already names the file and line
    internal = (__file__, pluggy.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<") and "importlib" not in Path(f.filename).parts
              and not any(Path(f.filename).parent == Path(i).parent for i in internal)]
    if not frames:
        return ""
    path = Path(frames[-1].filename)
    name = f"{path.parent.name}/{path.name}" if path.name == "__init__.py" else path.name
    return f" (at {name}:{frames[-1].lineno})"


def _failure(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}{_raised_at(e)}"
    if isinstance(e, ImportError) and "no known parent package" in str(e):
        text += _RELATIVE_IMPORT_HINT
    return text


def _check_format(fmt: object, plugin: str, origin: str) -> QuantFormat:
    where = f"plugin {plugin} ({origin})"
    if not isinstance(fmt, QuantFormat):
        raise PluginError(f"{where}: {_HOOK} returned {fmt!r}, "
                          "which is not a strata_rt.formats.contract.QuantFormat")
    for attr in _IDENTITY:
        if not hasattr(fmt, attr):
            raise PluginError(f"{where}: format {type(fmt).__name__} lacks `{attr}`")
    activation = getattr(fmt.activation, "name", fmt.activation)  # an Activation or its name
    if activation not in _ACTIVATIONS:
        raise PluginError(f"{where}: format {fmt.name} has activation {fmt.activation!r}; "
                          f"allowed: {', '.join(_ACTIVATIONS)}")
    try:  # plugin code: its launchers (may import its device module) and its sources
        batches = fmt.offers_batched_gather()
        sources = [Path(p) for p in fmt.kernel_sources()]
    except Exception as e:
        raise PluginError(f"{where}: format {fmt.name}: {_failure(e)}") from None
    if not fmt.native and batches:
        raise PluginError(f"{where}: format {fmt.name} is not native but offers a batched "
                          "gather; only native formats (plain byte-range blobs) batch")
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise PluginError(f"{where}: format {fmt.name} lists kernel sources that do not exist: "
                          f"{', '.join(missing)}")
    return fmt


def _distribution(module: str) -> tuple[str | None, str | None]:
    """(distribution, version) of the installed distribution that ships `module`."""
    top = module.partition(".")[0]
    names = metadata.packages_distributions().get(top) or []
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if top == "strata_rt":  # run from a source tree that was never installed
        from .. import __version__

        return "strata_rt", __version__
    return None, None


class QuantRegistry:
    """The loaded formats by name, with the plugin, distribution and version of each."""

    def __init__(self, plugins_yaml: Path | None = None, entry_points: bool = True,
                 disabled: Iterable[str] | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.formats: dict[str, LoadedFormat] = {}
        #: plugin name -> what disabled it ("<plugins.yaml>" or STRATA_DISABLE_PLUGINS)
        self.disabled: dict[str, str] = {}
        self._origin: dict[str, str] = {}  # plugin name -> origin
        self._module: dict[str, str] = {}  # plugin name -> module
        listing = Path(plugins_yaml or DEFAULT_PLUGINS_YAML)
        entries = read_plugins_yaml(listing)
        eps = self._entry_points() if entry_points else []
        wanted_off = list(disabled_from_env() if disabled is None else disabled)
        self._block(entries, eps, wanted_off, listing.name)
        if listing.resolve() != Path(DEFAULT_PLUGINS_YAML).resolve():
            folder = str(listing.resolve().parent)  # a package beside the list imports as is
            if folder not in sys.path:
                sys.path.append(folder)
        for entry in entries:
            if entry.enabled:
                self._register_listed(entry.module, listing.name)
        for ep in eps:
            self._load_entry_point(ep)
        self._collect()

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _entry_points() -> list[metadata.EntryPoint]:
        """The group's entry points, one per name; two distributions publishing one name is an
        error (pluggy would load whichever it met first)."""
        by_name: dict[str, metadata.EntryPoint] = {}
        seen: set[str] = set()
        for dist in metadata.distributions():
            dist_name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if dist_name in seen:
                continue  # the same distribution found twice on sys.path: the first wins
            seen.add(dist_name)
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP:
                    continue
                other = by_name.setdefault(ep.name, ep)
                if other is ep or other.value == ep.value:
                    continue
                raise PluginError(
                    f"two plugins named {ep.name!r} publish entry points in group "
                    f"{ENTRY_POINT_GROUP}: {_ep_label(other)} and {_ep_label(ep)}; "
                    "uninstall one of them")
        return list(by_name.values())

    def _block(self, entries: list[PluginEntry], eps: list[metadata.EntryPoint],
               wanted_off: list[str], listing: str) -> None:
        ep_module = {ep.name: ep.module for ep in eps}
        known = {e.module for e in entries} | set(ep_module) | set(ep_module.values())
        unknown = [n for n in wanted_off if n not in known]
        if unknown:
            raise PluginError(
                f"{DISABLE_SWITCH} names {', '.join(repr(n) for n in unknown)}, which no "
                f"plugin is called; plugins: {', '.join(sorted(known)) or 'none'}")
        off = {e.module: listing for e in entries if not e.enabled}
        off.update({n: DISABLE_SWITCH for n in wanted_off})
        for name, module in ep_module.items():  # an entry point is off by its name or module
            if name not in off and module in off:
                off[name] = off[module]
        for name, why in off.items():
            self.pm.set_blocked(name)
            self.disabled[name] = why
            log.debug("plugin %s disabled by %s", name, why)

    def _register_listed(self, module_name: str, origin: str) -> None:
        if self.pm.is_blocked(module_name):
            return
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                raise PluginError(
                    f"plugin {module_name} ({origin}): cannot import it: no module named "
                    f"{e.name!r} on the Python path or beside {origin} (install the package "
                    "that provides it, or fix the name)") from None
            raise PluginError(f"plugin {module_name} ({origin}): cannot import it: "
                              f"{_failure(e)}") from None
        except Exception as e:  # a plugin's import runs its code: any error is the plugin's
            raise PluginError(f"plugin {module_name} ({origin}): cannot import it: "
                              f"{_failure(e)}") from None
        if self.pm.is_registered(module):
            return  # listed twice
        try:
            self.pm.register(module, name=module_name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {module_name} ({origin}): {e}") from None
        self._require_hook(module_name, origin)
        self._origin[module_name] = origin
        self._module[module_name] = module_name

    def _load_entry_point(self, ep: metadata.EntryPoint) -> None:
        if self.pm.is_blocked(ep.name) or self.pm.has_plugin(ep.name):
            return
        known = sys.modules.get(ep.module) if ep.attr is None else None
        if known is not None and self.pm.is_registered(known):
            return  # its module is listed in plugins.yaml (or published twice): loaded once
        origin = f"entry point {ep.dist.name if ep.dist else '?'}"
        try:
            loaded = self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {ep.name} ({origin}): {e}") from None
        except Exception as e:  # importing the plugin ran its code
            raise PluginError(f"plugin {ep.name} ({origin}): cannot import {ep.value}: "
                              f"{_failure(e)}") from None
        if not loaded:
            return
        self._require_hook(ep.name, origin)
        self._origin[ep.name] = origin
        self._module[ep.name] = ep.module

    def _require_hook(self, name: str, origin: str) -> None:
        """After registration: the plugin must implement strata_rt's hook and no unknown one
        (a misspelled hook name would otherwise be ignored)."""
        plugin = self.pm.get_plugin(name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            self.pm.unregister(name=name)
            raise PluginError(f"plugin {name} ({origin}): {e}; the hook is {_HOOK}") from None
        if getattr(self.pm.hook, _HOOK) not in (self.pm.get_hookcallers(plugin) or []):
            self.pm.unregister(name=name)
            raise PluginError(
                f"plugin {name} ({origin}) implements no strata_rt hook: define "
                f"`@strata_rt.hookimpl def {_HOOK}(): return [YourFormat()]`")

    # ------------------------------------------------------------------ collecting
    def _collect(self) -> None:
        """Calls the hook through pluggy, one plugin at a time (a subset caller without the
        others), so each format and each failure is credited to its plugin."""
        dists = {id(plugin): dist for plugin, dist in self.pm.list_plugin_distinfo()}
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None or name not in self._origin:
                continue  # blocked, or registered by someone else
            origin = self._origin[name]
            others = [p for p in self.pm.get_plugins() if p is not plugin]
            hook = self.pm.subset_hook_caller(_HOOK, remove_plugins=others)
            try:
                results = hook()
            except Exception as e:
                raise PluginError(f"plugin {name} ({origin}): {_HOOK}() raised "
                                  f"{_failure(e)}") from None
            if not any(results):
                raise PluginError(f"plugin {name} ({origin}): {_HOOK}() returned no formats")
            dist = dists.get(id(plugin))
            if dist is not None:
                distribution, version = dist.metadata["Name"], dist.version
            else:
                distribution, version = _distribution(self._module[name])
            for result in results:
                if not isinstance(result, (list, tuple)):
                    raise PluginError(f"plugin {name} ({origin}): {_HOOK} returned {result!r}; "
                                      "expected a list of formats")
                for fmt in result:
                    fmt = _check_format(fmt, name, origin)
                    if fmt.name in self.formats:
                        other = self.formats[fmt.name]
                        raise PluginError(
                            f"two formats named {fmt.name!r}: one from plugin {other.plugin} "
                            f"({other.origin}), one from plugin {name} ({origin})")
                    self.formats[fmt.name] = LoadedFormat(
                        fmt, name, origin, self._module[name], distribution, version)
                    log.debug("format %s from plugin %s (%s)", fmt.name, name, origin)

    # ------------------------------------------------------------------ lookup
    def __getitem__(self, name: str) -> QuantFormat:
        try:
            return self.formats[name].format
        except KeyError:
            off = "".join(f"; plugin {p} is disabled ({why})" for p, why in self.disabled.items())
            raise PluginError(f"unknown format {name!r}; loaded: "
                              f"{', '.join(sorted(self.formats)) or 'none'}{off}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.formats

    def names(self) -> list[str]:
        return list(self.formats)


def _ep_label(ep: metadata.EntryPoint) -> str:
    return f"{ep.value} from {ep.dist.name if ep.dist else 'an unknown distribution'}"


_DEFAULT: QuantRegistry | None = None


def plugin_list_path() -> Path:
    """The plugins.yaml in use: STRATA_PLUGINS, else the package's own."""
    given = env.text("STRATA_PLUGINS")
    return Path(given) if given else BUILTIN_PLUGINS_YAML


def registry(reload: bool = False) -> QuantRegistry:
    """The process-wide registry: the built-in plugins.yaml (or STRATA_PLUGINS) plus entry
    points, less the plugins STRATA_DISABLE_PLUGINS names."""
    global _DEFAULT
    if _DEFAULT is None or reload:
        plugins_yaml = env.text("STRATA_PLUGINS")
        _DEFAULT = QuantRegistry(Path(plugins_yaml) if plugins_yaml else None)
    return _DEFAULT
