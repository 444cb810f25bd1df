"""The hooks a quant plugin implements, declared by marker as pytest declares its own.

A plugin is a module (listed in plugins.yaml or published under the entry point group
`strata_rt.quants`) with functions decorated by `strata_rt.hookimpl`. strata_rt's registry
registers every plugin with one pluggy PluginManager and calls the hooks through it, so a
plugin that is disabled (blocked by name) never runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .contract import QuantFormat

PROJECT = "strata_rt"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def strata_rt_formats() -> list[QuantFormat]:
    """Return the format objects this plugin provides (instances of QuantFormat subclasses).

    Called once when the registry loads. Every plugin must implement it: a module that
    provides no format is a configuration mistake, and the registry says so by name.
    Two formats with one name, across all plugins, are an error.
    """
    raise NotImplementedError  # a specification: pluggy calls the plugins' implementations
