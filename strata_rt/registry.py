"""Loads quant plugins (plugins.yaml, then the `strata_rt.quants` entry points) with pluggy and
checks each format against the contract before anything uses it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pluggy
import yaml

from . import env, hookspecs
from .errors import PluginError
from .formats import QuantFormat
from .resources import BUILTIN_PLUGINS_YAML

ENTRY_POINT_GROUP = "strata_rt.quants"
DEFAULT_PLUGINS_YAML = BUILTIN_PLUGINS_YAML
_IDENTITY = ("name", "block_values", "block_bytes", "kernel_dir")


@dataclass(frozen=True)
class LoadedFormat:
    format: QuantFormat
    plugin: str  # module name
    origin: str  # the name of the plugins YAML that listed it, or "entry point <dist>"


def _read_plugins_yaml(path: Path) -> list[str]:
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise PluginError(f"{path}: plugin list not found") from None
    except yaml.YAMLError as e:
        raise PluginError(f"{path}: not valid YAML: {e}") from None
    entries = doc.get("plugins") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise PluginError(f"{path}: expected a top-level `plugins:` list of {{module, enabled}}")
    modules = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("module"), str):
            raise PluginError(f"{path}: plugins[{i}] must be a mapping with a `module:` string")
        unknown = set(entry) - {"module", "enabled"}
        if unknown:
            raise PluginError(f"{path}: plugins[{i}] has unknown key(s) {sorted(unknown)}; "
                              "allowed: module, enabled")
        enabled = entry.get("enabled", True)
        if not isinstance(enabled, bool):
            raise PluginError(f"{path}: plugins[{i}].enabled must be true or false")
        if enabled:
            modules.append(entry["module"])
    return modules


def _check_format(fmt: object, plugin: str) -> QuantFormat:
    if not isinstance(fmt, QuantFormat):
        raise PluginError(f"plugin {plugin}: strata_rt_formats returned {fmt!r}, "
                          "which is not a strata_rt.formats.QuantFormat")
    for attr in _IDENTITY:
        if not hasattr(fmt, attr):
            raise PluginError(f"plugin {plugin}: format {type(fmt).__name__} lacks `{attr}`")
    if fmt.activation not in ("q8_1", "f16"):
        raise PluginError(f"plugin {plugin}: format {fmt.name} has activation "
                          f"{fmt.activation!r}; allowed: q8_1, f16")
    if not fmt.native and fmt.offers_batched_gather():
        raise PluginError(f"plugin {plugin}: format {fmt.name} is not native but offers a "
                          "batched gather; only native formats (plain byte-range blobs) batch")
    return fmt


class QuantRegistry:
    """The loaded formats by name, with where each came from."""

    def __init__(self, plugins_yaml: Path | None = None, entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.formats: dict[str, LoadedFormat] = {}
        listing = Path(plugins_yaml or DEFAULT_PLUGINS_YAML)
        for module in _read_plugins_yaml(listing):
            self._register_module(module, listing.name)
        if entry_points:
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist else "?"
                self._register_module(ep.value, f"entry point {dist}", ep.load)

    def _register_module(self, name: str, origin: str, loader=None) -> None:
        try:
            module = loader() if loader else importlib.import_module(name)
        except Exception as e:  # a plugin's import runs its code: any error is the plugin's
            raise PluginError(f"plugin {name} ({origin}): cannot import it: "
                              f"{type(e).__name__}: {e}") from None
        if self.pm.is_registered(module):
            return
        impl = getattr(module, "strata_rt_formats", None)
        if impl is None or not hasattr(impl, hookspecs.PROJECT + "_impl"):
            raise PluginError(
                f"plugin {name} ({origin}) implements no strata_rt hook: define "
                "`@strata_rt.hookimpl def strata_rt_formats(): return [YourFormat()]`")
        try:
            self.pm.register(module, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {name} ({origin}): {e}") from None
        for fmt in module.strata_rt_formats() or []:
            fmt = _check_format(fmt, name)
            if fmt.name in self.formats:
                other = self.formats[fmt.name]
                raise PluginError(
                    f"two formats named {fmt.name!r}: one from plugin {other.plugin} "
                    f"({other.origin}), one from plugin {name} ({origin})")
            self.formats[fmt.name] = LoadedFormat(fmt, name, origin)

    def __getitem__(self, name: str) -> QuantFormat:
        try:
            return self.formats[name].format
        except KeyError:
            raise PluginError(f"unknown format {name!r}; loaded: "
                              f"{', '.join(sorted(self.formats)) or 'none'}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.formats

    def names(self) -> list[str]:
        return list(self.formats)


_DEFAULT: QuantRegistry | None = None


def registry(reload: bool = False) -> QuantRegistry:
    """The process-wide registry (plugins.yaml next to the package, or STRATA_PLUGINS, plus
    entry points)."""
    global _DEFAULT
    if _DEFAULT is None or reload:
        plugins_yaml = env.text("STRATA_PLUGINS")
        _DEFAULT = QuantRegistry(Path(plugins_yaml) if plugins_yaml else None)
    return _DEFAULT
