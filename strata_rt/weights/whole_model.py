"""Which model an engine runs: MoE layers alone (benchmarks, plugin tests) or a whole Qwen3-MoE
model (token ids in, logits out), from what `EngineConfig.model` names.

    {"spec": MoESpec, "seed": int}            MoE layers alone, synthetic
    {"gguf": path, "format": name}            a GGUF: a whole model when it carries
                                              token_embd.weight, else MoE layers alone;
                                              format absent: the file's (gguf_format);
                                              a conversion is cached (convert_cache) unless
                                              "convert_cache": False
    {"qwen3": Qwen3Spec | dict | "tiny", "seed": int, "format": name}
                                              a whole synthetic model (seeded)
    a Model, a Qwen3Model or a MoESpec        as given
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..formats.contract import QuantFormat
from ..models.qwen3.gguf_full import read_qwen3_gguf
from ..models.qwen3.spec import TINY_SPEC, Qwen3Spec
from ..models.qwen3.weights import Qwen3Model
from .gguf_file.gguf_io import open_reader
from .model import Model, MoESpec

log = logging.getLogger(__name__)

#: synthetic whole models by name
NAMED_SPECS = {"tiny": TINY_SPEC}
WHOLE_MODEL_TENSOR = "token_embd.weight"


def qwen3_spec(value: Any) -> Qwen3Spec:
    """A Qwen3Spec from a spec, a name of NAMED_SPECS or a dict of its fields."""
    if isinstance(value, Qwen3Spec):
        return value
    if isinstance(value, str):
        if value not in NAMED_SPECS:
            raise ConfigError(f"model.qwen3: unknown name {value!r}; named specs: "
                              f"{', '.join(NAMED_SPECS)}, or give the fields")
        return NAMED_SPECS[value]
    if isinstance(value, dict):
        try:
            return Qwen3Spec(**value)
        except TypeError as e:
            raise ConfigError(f"model.qwen3: {e}") from None
    raise ConfigError(f"model.qwen3: got {type(value).__name__}; expected a name, a Qwen3Spec "
                      "or a mapping of its fields")


#: the keys of each kind of model dict, the one that names the kind first
MODEL_KEYS = {"gguf": ("gguf", "format", "convert_cache"),
              "qwen3": ("qwen3", "seed", "format", "tied", "dense_type", "pool_layers"),
              "spec": ("spec", "seed")}


def _count(lo: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


#: key -> (whether a value is of its kind, what it takes)
_MODEL_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "gguf": (lambda v: isinstance(v, str | os.PathLike) and os.fspath(v) != "",
             "the path of a GGUF file"),
    "format": (lambda v: v is None or isinstance(v, str | QuantFormat), "a format's name"),
    "convert_cache": (lambda v: isinstance(v, bool), "true or false"),
    "tied": (lambda v: isinstance(v, bool), "true or false"),
    "seed": (_count(0), "an integer >= 0"),
    "pool_layers": (lambda v: v is None or _count(1)(v), "a number of layers >= 1"),
    "spec": (lambda v: isinstance(v, MoESpec), "a MoESpec"),
}


def check_model_dict(m: dict[Any, Any]) -> None:
    """ConfigError listing what is wrong with a model dict (one kind of MODEL_KEYS, its keys
    alone, each value of its kind), each problem naming its key: a dict with two kinds, a
    misspelt key or a seed of 1.5 would otherwise run another model than the one meant."""
    kinds = [k for k in MODEL_KEYS if k in m]
    if len(kinds) != 1:
        got = f"keys {', '.join(kinds)}" if kinds else f"keys {', '.join(map(repr, m)) or '(none)'}"
        raise ConfigError(f"model: a dict with {got}; give exactly one of gguf, qwen3 or spec")
    allowed = MODEL_KEYS[kinds[0]]
    problems = []
    for key, value in m.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            problems.append(f"model.{key}: unknown key of a {kinds[0]} model; {hint}known "
                            f"keys: {', '.join(allowed)}")
        elif key in _MODEL_VALUES and not _MODEL_VALUES[key][0](value):
            problems.append(f"model.{key}: got {value!r}; allowed: {_MODEL_VALUES[key][1]}")
    if problems:
        raise ConfigError(problems)


def is_whole_gguf(path: str | Path) -> bool:
    """Whether a GGUF file holds a whole model (an embedding) rather than MoE layers alone."""
    reader = open_reader(Path(path))
    return any(t.name == WHOLE_MODEL_TENSOR for t in reader.tensors)


def load_model(m: Model | Qwen3Model | MoESpec | dict[str, Any]
               ) -> tuple[Model, Qwen3Model | None]:
    """-> (the MoE layers the chunk driver runs, the whole model or None)."""
    if isinstance(m, Qwen3Model):
        return m.moe, m
    if isinstance(m, Model):
        return m, None
    if isinstance(m, MoESpec):
        return Model.synthetic(m, 0), None
    if isinstance(m, dict):
        check_model_dict(m)
        if "qwen3" in m:
            spec = qwen3_spec(m["qwen3"])
            whole = Qwen3Model.synthetic(spec, int(m.get("seed", 0)), m.get("format", "fp16"),
                                         tied=bool(m.get("tied", False)),
                                         dense_type=m.get("dense_type", "F32"),
                                         pool_layers=m.get("pool_layers"))
            return whole.moe, whole
        if "gguf" in m:
            fmt = m.get("format")  # None: each layer as the file stores it (gguf_format)
            path = Path(m["gguf"])
            if fmt is not None and m.get("convert_cache", True):  # asked for: written once
                from .convert_cache import converted_path
                from .model import _resolve_format

                path = converted_path(path, _resolve_format(fmt)) or path
            if is_whole_gguf(path):
                whole = read_qwen3_gguf(path, fmt)
                return whole.moe, whole
            return Model.from_gguf(path, fmt), None
        if "spec" in m:
            return Model.synthetic(m["spec"], int(m.get("seed", 0))), None
    raise ConfigError(f"model: got {type(m).__name__}; allowed: a Model, a Qwen3Model, a "
                      "MoESpec, {'spec': MoESpec, 'seed': int}, {'qwen3': spec, 'seed': int, "
                      "'format': name} or {'gguf': path, 'format': name}")

