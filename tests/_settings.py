"""Shared checks for an engine setting that comes from a config key, an EngineConfig field or
an environment switch (compute_lanes, in_place): the three sources in their order of
precedence, and refusals that name the source; and the reference-backend runs their tests
compare (outputs and the plans behind them)."""

from __future__ import annotations

import pytest
import yaml

from strata_rt.config.run.run_config import load_config
from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError
from strata_rt.weights.model import SMALL_SPEC


def check_engine_setting(monkeypatch: pytest.MonkeyPatch, field: str, switch: str,
                         default: str, explicit: str, from_env: str, bad: str,
                         bad_env: str) -> None:
    """Default without either; the field over the switch; the switch without the field; a bad
    field value names the field, a bad switch value names the switch."""
    def resolved(**kw: object) -> object:
        return getattr(EngineConfig(model=SMALL_SPEC, **kw).resolve(), field)  # type: ignore[arg-type]

    assert resolved() == default
    assert resolved(**{field: explicit}) == explicit
    monkeypatch.setenv(switch, from_env)
    assert resolved() == from_env
    assert resolved(**{field: explicit}) == explicit
    with pytest.raises(ConfigError, match=field):
        resolved(**{field: bad})
    monkeypatch.setenv(switch, bad_env)
    with pytest.raises(ConfigError, match=switch):
        resolved()


def check_yaml_key(tmp_path, key: str, value: object, want: str, bad: object) -> None:
    """A small run config with `key: value` reads as `want` into the Config and its
    EngineConfig; `key: bad` is refused naming the key and the value."""
    doc = {"model": {"synthetic": {"n_layers": 2, "hidden": 512, "ffn": 256, "n_experts": 32,
                                   "top_k": 4}},
           "format": "iq3_xxs", "backend": "reference", "expert_cache": 32, "prompts": [200],
           key: value}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_config(path)
    assert getattr(cfg, key) == want and getattr(cfg.engine_config(), key) == want
    path.write_text(yaml.safe_dump({**doc, key: bad}))
    with pytest.raises(ConfigError, match=f"{key}: got {bad!r}"):
        load_config(path)


def run_reference(model, prompts, **cfg) -> tuple[list, list]:
    """Each prompt through one reference engine (plans checked): (outputs, chunk plans)."""
    outs, plans = [], []
    with Engine.open(EngineConfig(model=model, backend="reference", check_plan=True,
                                  **cfg)) as eng:
        for h in prompts:
            outs.append(eng.prefill(h)[0])
            plans.append(eng.driver.last_plan)
    return outs, plans
