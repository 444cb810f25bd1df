"""The keys of Engine.open's settings: a mapping keyed by names, each name a field of
EngineConfig. Its own module so EngineConfig's module holds the fields and their resolution,
and a misspelt key is named with the closest field instead of TypeError's traceback."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError


def settings(config: object) -> dict[str, Any]:
    """Engine.open's settings as keywords: ConfigError unless a mapping keyed by names."""
    bad = [k for k in config if not isinstance(k, str)] if isinstance(config, Mapping) else []
    if isinstance(config, Mapping) and not bad:
        return dict(config)
    got = f"a key {bad[0]!r}" if bad else type(config).__name__
    raise ConfigError(f"Engine.open: got {got}; allowed: an EngineConfig, or a dict of its "
                      "settings keyed by their names", source="engine config")


def check_keys(kwargs: dict[str, Any], n_positional: int, fields: tuple[str, ...]) -> None:
    """EngineConfig(**settings) with a key that is not one of its `fields` is a ConfigError
    naming the key and the closest field, as in a run config. Private fields ("_...") are
    what the engine fills in itself: no setting, so neither taken, offered nor listed (a
    caller's `_profile: 1` ended in an AttributeError while the engine opened)."""
    known = tuple(name for name in fields if not name.startswith("_"))
    problems = []
    if n_positional > 1:
        problems.append(f"got {n_positional} positional arguments; give the model, then "
                        "keywords")
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            problems.append(f"{key}: unknown key; {hint}known keys: {', '.join(known)}")
    if n_positional == 0 and "model" not in kwargs:
        problems.append("model: (missing); required: a model, its spec or a model dict")
    if problems:
        raise ConfigError(problems, source="engine config")
