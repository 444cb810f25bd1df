"""The run configuration: one YAML schema, validated all at once.

A config names a model (a GGUF file or synthetic dims), the format its experts run in, the
backend, one VRAM policy, the chunk size, the ring, a routing profile, the prompts and where the
results go. `load_config` reports every problem in one ConfigError (key path, the value given,
what is allowed) so a user fixes a file in one pass instead of one error per run.

Paths in a config are relative to the config file's directory; `output.json` and
`output.dump_r` are relative to `output.dir` when that is set.

MoE-only models have no embedding table, so a prompt becomes hidden states here: a length gives
Gaussian rows from a generator seeded with `seed + prompt index`; a token file embeds each token
id as a fixed Gaussian row seeded with `(seed, token id)` (equal tokens, equal rows); a
`hidden_file` gives the rows directly.
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from .engine import BACKENDS, EngineConfig
from .errors import ConfigError, FormatError, GGUFError
from .gguf_io import read_header
from .memory_plan import MemoryPlan, plan_memory
from .model import MoESpec
from .planner import AUTO_CHUNK_MAX, STAGING_RING_SLOTS, walk_ring_slots
from .residency import RoutingProfile
from .runtime.memory import MIB

if TYPE_CHECKING:
    from .formats import QuantFormat
    from .registry import QuantRegistry

BUDGET_KEYS = ("expert_cache", "vram_reserve_mib", "vram_budget_mib")

_TOP_KEYS = ("model", "format", "backend", *BUDGET_KEYS, "prefill", "ring_mib", "profile",
             "prompts", "repeats", "seed", "output")
_MODEL_KEYS = ("gguf", "synthetic")
_SYNTHETIC_KEYS = ("n_layers", "hidden", "ffn", "n_experts", "top_k", "seed", "rms_eps")
_SYNTHETIC_REQUIRED = ("n_layers", "hidden", "ffn", "n_experts", "top_k")
_PROMPT_KEYS = ("file", "hidden_file")
_OUTPUT_KEYS = ("dir", "dump_r", "json")


@dataclass(frozen=True)
class Prompt:
    """One prompt: a length, a token file, or a file of hidden states."""

    index: int
    tokens: int
    token_file: Path | None = None
    hidden_file: Path | None = None

    @property
    def label(self) -> str:
        src = self.token_file or self.hidden_file
        return f"{self.tokens} tokens" + (f" ({src.name})" if src else "")

    def hidden_states(self, hidden: int, seed: int) -> np.ndarray:
        """float32 [tokens, hidden], C-contiguous: what Engine.prefill takes."""
        if self.hidden_file is not None:
            return np.ascontiguousarray(np.load(self.hidden_file), dtype=np.float32)
        if self.token_file is not None:
            ids = read_token_file(self.token_file)
            uniq, inverse = np.unique(ids, return_inverse=True)
            table = np.stack([np.random.default_rng([seed, int(t)]).standard_normal(
                hidden, dtype=np.float32) for t in uniq])
            return np.ascontiguousarray(table[inverse.reshape(-1)])
        rng = np.random.default_rng(seed + self.index)
        return rng.standard_normal((self.tokens, hidden), dtype=np.float32)


@dataclass(frozen=True)
class Output:
    dir: Path | None = None
    dump_r: Path | None = None
    json: Path | None = None


@dataclass(frozen=True)
class Config:
    """A validated run. Build it with `load_config` or `validate`, never by hand."""

    source: Path | None
    spec: MoESpec  # dims and format
    backend: str
    prefill: str | int
    prompts: tuple[Prompt, ...]
    gguf: Path | None = None
    model_seed: int = 0
    expert_cache: int | None = None
    vram_reserve_mib: float | None = None
    vram_budget_mib: float | None = None
    ring_mib: float | None = None
    profile: Path | None = None
    repeats: int = 1
    seed: int = 0
    output: Output = field(default_factory=Output)

    @property
    def ring_bytes(self) -> int | None:
        return None if self.ring_mib is None else int(self.ring_mib * MIB)

    def with_prompt_lengths(self, lengths: list[int]) -> Config:
        return replace(self, prompts=tuple(Prompt(i, n) for i, n in enumerate(lengths)))

    def with_backend(self, backend: str) -> Config:
        if backend not in BACKENDS:
            raise ConfigError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
        return replace(self, backend=backend)

    def chunk_tokens(self) -> int:
        """The chunk the memory plan assumes (see auto_chunk)."""
        return auto_chunk(self.prefill, self.prompts)

    def memory_plan(self, fmt: QuantFormat) -> MemoryPlan | None:
        """The device arena `vram_budget_mib` buys (None without a budget): the chunk's
        buffers and the ring first, resident experts in the rest."""
        if self.vram_budget_mib is None:
            return None
        return device_memory_plan(self.spec, fmt, self.chunk_tokens(), self.ring_bytes,
                                  int(self.vram_budget_mib * MIB))

    def resident_experts(self, fmt: QuantFormat) -> int | None:
        """The expert-cache size the config fixes, or None when the CUDA backend derives it
        from free VRAM minus `vram_reserve_mib`."""
        if self.expert_cache is not None:
            return self.expert_cache
        plan = self.memory_plan(fmt)
        return None if plan is None else plan.n_resident

    def engine_config(self, backend: str | None = None,
                      registry: QuantRegistry | None = None) -> EngineConfig:
        """The one mapping from a validated config to the engine's EngineConfig (`auto` is
        resolved by Engine.open, which prints the one line when it falls back). A VRAM budget
        fixes the chunk as well as the cache: left `auto`, the CUDA backend would grow the
        chunk into whatever VRAM is free beyond the budget."""
        from .registry import registry as default_registry

        fmt = (registry or default_registry())[self.spec.format]
        if self.gguf is not None:
            model: dict[str, Any] = {"gguf": str(self.gguf), "format": self.spec.format}
        else:
            model = {"spec": self.spec, "seed": self.model_seed}
        plan = self.memory_plan(fmt)
        return EngineConfig(
            model=model,
            backend=backend or self.backend,
            vram_reserve_mib=self.vram_reserve_mib,
            expert_cache=self.resident_experts(fmt),
            prefill=self.prefill if plan is None else plan.tokens,
            ring_bytes=self.ring_bytes,
            profile=None if self.profile is None else str(self.profile),
            dump_r=None if self.output.dump_r is None else str(self.output.dump_r),
        )


def auto_chunk(prefill: str | int, prompts: Sequence[Prompt]) -> int:
    """The chunk a run takes: `prefill` when fixed, else what `auto` takes for the longest
    prompt (a longer chunk would only hold unused memory)."""
    if isinstance(prefill, int):
        return prefill
    return min(AUTO_CHUNK_MAX, max((p.tokens for p in prompts), default=1))


# ------------------------------------------------------------------------------ memory plan
def device_memory_plan(spec: MoESpec, fmt: QuantFormat, chunk_tokens: int,
                       ring_bytes: int | None, budget_bytes: int | None = None) -> MemoryPlan:
    """The CUDA backend's device arena for `chunk_tokens`, sized by the backend's own
    plan_memory so the config's budget check and the allocation cannot disagree.

    With budget_bytes, resident experts fill what the chunk's buffers and the ring leave
    (BudgetError when those alone do not fit); without, no expert is resident: the least any
    budget must hold. The ring is sized as the backend sizes it before the residency is known
    (every expert streaming), an upper bound of the ring it allocates once it is."""
    lay = fmt.layout(spec.hidden, spec.ffn)
    ring_slots = max(walk_ring_slots(ring_bytes, lay.slot_bytes, spec.total_experts),
                     STAGING_RING_SLOTS)
    if budget_bytes is None:
        return plan_memory(spec, lay, fmt.activation, sys.maxsize, ring_slots, chunk_tokens, 0)
    return plan_memory(spec, lay, fmt.activation, budget_bytes, ring_slots, chunk_tokens, None)


def read_token_file(path: Path) -> np.ndarray:
    """Token ids from a .npy integer array or a text file of integers (spaces, commas or
    newlines between them)."""
    if path.suffix == ".npy":
        ids = np.load(path, mmap_mode="r")
        if ids.dtype.kind not in "iu":
            raise ConfigError(f"{path}: token ids must be integers, found dtype {ids.dtype}")
        return np.asarray(ids).reshape(-1).astype(np.int64)
    text = path.read_text().replace(",", " ").split()
    try:
        return np.array([int(t) for t in text], dtype=np.int64)
    except ValueError as e:
        raise ConfigError(f"{path}: token files hold integers: {e}") from None


# ------------------------------------------------------------------------------ validation
class _Problems:
    """Collects every problem with its key path so validation reports them all at once."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, value: Any, allowed: str) -> None:
        shown = "(missing)" if value is _MISSING else f"got {value!r}"
        self.items.append(f"{path}: {shown}; {allowed}")

    def unknown_keys(self, path: str, doc: dict, known: tuple[str, ...]) -> None:
        for key in doc:
            if key in known:
                continue
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            self.items.append(f"{_join(path, str(key))}: unknown key; {hint}"
                              f"known keys: {', '.join(known)}")


_MISSING = object()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(p: _Problems, doc: dict, path: str, key: str, *, minimum: int, default: Any = _MISSING):
    v = doc.get(key, _MISSING)
    if v is _MISSING:
        if default is _MISSING:
            p.add(_join(path, key), v, f"required: an integer >= {minimum}")
        return None if default is _MISSING else default
    if not _is_int(v):
        p.add(_join(path, key), v, f"expected an integer >= {minimum}")
        return None
    if v < minimum:
        what = "a size must be positive" if minimum == 1 else f"must be >= {minimum}"
        p.add(_join(path, key), v, f"{what} (integer >= {minimum})")
        return None
    return v


def _positive_number(p: _Problems, doc: dict, key: str, unit: str, zero_ok: bool = False):
    v = doc.get(key)
    if v is None:
        return None
    if not _is_number(v) or v < 0 or (v == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        p.add(key, v, f"expected a number {bound} ({unit})")
        return None
    return float(v)


def _mapping(p: _Problems, doc: dict, path: str, key: str, required: bool) -> dict | None:
    v = doc.get(key, _MISSING)
    if v is _MISSING:
        if required:
            p.add(_join(path, key), v, "required: a mapping")
        return None
    if not isinstance(v, dict):
        p.add(_join(path, key), v, "expected a mapping (key: value lines)")
        return None
    return v


def _path(p: _Problems, path: str, v: Any, base: Path, must_exist: bool) -> Path | None:
    if not isinstance(v, str) or not v:
        p.add(path, v, "expected a file path (string)")
        return None
    resolved = (base / Path(v).expanduser()).resolve()
    if must_exist and not resolved.is_file():
        p.add(path, v, f"no such file ({resolved})")
        return None
    return resolved


def _model(p: _Problems, doc: dict, base: Path):
    """Returns (geometry, gguf path, model seed); geometry None when it cannot be known."""
    model = _mapping(p, doc, "", "model", required=True)
    if model is None:
        return None, None, 0
    p.unknown_keys("model", model, _MODEL_KEYS)
    has = [k for k in _MODEL_KEYS if k in model]
    if len(has) != 1:
        p.add("model", {k: model[k] for k in has} if has else _MISSING,
              "give exactly one of `gguf: PATH` or `synthetic: {n_layers, hidden, ffn, "
              "n_experts, top_k, seed, rms_eps}`")
        return None, None, 0
    if has == ["gguf"]:
        gguf = _path(p, "model.gguf", model["gguf"], base, must_exist=True)
        if gguf is None:
            return None, None, 0
        try:
            _, dims = read_header(gguf)
        except GGUFError as e:
            p.add("model.gguf", model["gguf"], str(e))
            return None, None, 0
        dims.pop("arch")
        return MoESpec(**dims), gguf, 0
    syn = _mapping(p, model, "model", "synthetic", required=True)
    if syn is None:
        return None, None, 0
    p.unknown_keys("model.synthetic", syn, _SYNTHETIC_KEYS)
    dims = {k: _int(p, syn, "model.synthetic", k, minimum=1) for k in _SYNTHETIC_REQUIRED}
    seed = _int(p, syn, "model.synthetic", "seed", minimum=0, default=0)
    eps = syn.get("rms_eps", 1e-6)
    if not _is_number(eps) or eps <= 0:
        p.add("model.synthetic.rms_eps", eps, "expected a number > 0 (e.g. 1e-6)")
        eps = None
    if None in dims.values() or eps is None:
        return None, None, seed
    if dims["top_k"] > dims["n_experts"]:
        p.add("model.synthetic.top_k", dims["top_k"],
              f"must be <= n_experts ({dims['n_experts']})")
        return None, None, seed
    return MoESpec(rms_eps=float(eps), **dims), None, seed


def _format(p: _Problems, doc: dict, geom: MoESpec | None, reg: QuantRegistry):
    name = doc.get("format", _MISSING)
    loaded = ", ".join(reg.names()) or "none"
    if not isinstance(name, str) or name not in reg:
        p.add("format", name, f"expected a loaded format: {loaded} (see `strata plugins`)")
        return None
    fmt = reg[name]
    if geom is not None:
        try:
            fmt.check_dims(geom.hidden, geom.ffn)
        except FormatError as e:
            where = "model.gguf" if "gguf" in doc.get("model", {}) else "model.synthetic"
            p.add(where, {"hidden": geom.hidden, "ffn": geom.ffn}, f"format {name}: {e}")
            return None
    return fmt


def _prompts(p: _Problems, doc: dict, base: Path, hidden: int | None) -> list[Prompt]:
    items = doc.get("prompts", _MISSING)
    allowed = "a list of prompt lengths (integers >= 1), {file: TOKENS} or {hidden_file: X.npy}"
    if not isinstance(items, list) or not items:
        p.add("prompts", items, f"expected {allowed}")
        return []
    out = []
    for i, item in enumerate(items):
        path = f"prompts[{i}]"
        if _is_int(item):
            if item < 1:
                p.add(path, item, "a prompt length must be >= 1")
            else:
                out.append(Prompt(i, item))
            continue
        if not isinstance(item, dict) or len(item) != 1:
            p.add(path, item, f"expected one of: {allowed}")
            continue
        p.unknown_keys(path, item, _PROMPT_KEYS)
        key, value = next(iter(item.items()))
        if key not in _PROMPT_KEYS:
            continue
        f = _path(p, f"{path}.{key}", value, base, must_exist=True)
        if f is None:
            continue
        try:
            if key == "file":
                n = int(read_token_file(f).size)
                if n == 0:
                    p.add(f"{path}.file", value, "the token file holds no tokens")
                    continue
                out.append(Prompt(i, n, token_file=f))
            else:
                arr = np.load(f, mmap_mode="r")
                if arr.ndim != 2 or (hidden is not None and arr.shape[1] != hidden) \
                        or arr.dtype.kind != "f" or arr.shape[0] == 0:
                    want = f"[tokens, {hidden if hidden is not None else 'hidden'}]"
                    p.add(f"{path}.hidden_file", value,
                          f"expected a float array {want}, found {arr.dtype} {arr.shape}")
                    continue
                out.append(Prompt(i, int(arr.shape[0]), hidden_file=f))
        except (ConfigError, ValueError, OSError) as e:
            reason = "; ".join(e.problems) if isinstance(e, ConfigError) else str(e)
            p.add(f"{path}.{key}", value, f"unreadable: {reason}")
    return out


def _budget(p: _Problems, doc: dict, geom: MoESpec | None, fmt: QuantFormat | None,
            chunk: int | None, ring_bytes: int | None) -> dict[str, Any]:
    given = [k for k in BUDGET_KEYS if k in doc]
    if len(given) != 1:
        p.add(" / ".join(BUDGET_KEYS), {k: doc[k] for k in given} if given else _MISSING,
              "give exactly one VRAM policy: `expert_cache` (resident experts: a count or "
              "`all`), `vram_reserve_mib` (VRAM left free; the rest holds experts) or "
              "`vram_budget_mib` (VRAM strata_rt may use in all)")
        return {}
    key = given[0]
    if key == "expert_cache":
        v = doc[key]
        total = geom.total_experts if geom is not None else None
        if v == "all":  # valid whatever the model; unknown dims are reported under `model`
            return {} if total is None else {key: total}
        if not _is_int(v) or v < 0 or (total is not None and v > total):
            limit = f"0..{total} (n_layers x n_experts)" if total is not None else ">= 0"
            p.add(key, v, f"expected `all` or an integer {limit}")
            return {}
        return {key: v}
    mib = _positive_number(p, doc, key, "MiB", zero_ok=key == "vram_reserve_mib")
    if mib is None or key == "vram_reserve_mib" or geom is None or fmt is None or chunk is None:
        return {key: mib}
    need = device_memory_plan(geom, fmt, chunk, ring_bytes)
    if need.total > mib * MIB:
        p.add(key, doc[key],
              f"cannot hold one chunk's buffers: a {chunk}-token chunk needs "
              f"{need.total / MIB:.1f} MiB on the device ({need.describe()}); raise it, or "
              "lower `prefill` or `ring_mib`")
        return {}
    return {key: mib}


def validate(doc: Any, base_dir: Path, source: Path | None = None,
             registry: QuantRegistry | None = None) -> Config:
    """A parsed YAML document -> Config, or ConfigError listing every problem."""
    from .registry import registry as default_registry

    where = str(source) if source else "config"
    if not isinstance(doc, dict):
        keys = f"a mapping of keys ({', '.join(_TOP_KEYS)})"
        raise ConfigError(f"the file is empty; expected {keys}" if doc is None
                          else f"expected {keys}, got {type(doc).__name__}", source=where)
    reg = registry or default_registry()
    p = _Problems()
    p.unknown_keys("", doc, _TOP_KEYS)
    geom, gguf, model_seed = _model(p, doc, base_dir)
    fmt = _format(p, doc, geom, reg)

    backend = doc.get("backend", "auto")
    if backend not in BACKENDS:
        p.add("backend", backend, f"allowed: {', '.join(BACKENDS)}")

    prefill = doc.get("prefill", "auto")
    if prefill != "auto" and not (_is_int(prefill) and prefill >= 1):
        p.add("prefill", prefill, "expected `auto` or a chunk size in tokens (integer >= 1)")
        prefill = None

    ring_mib = _positive_number(p, doc, "ring_mib", "MiB")
    ring_bytes = None if ring_mib is None else int(ring_mib * MIB)
    if ring_bytes is not None and geom is not None and fmt is not None:
        slot = fmt.layout(geom.hidden, geom.ffn).slot_bytes
        if ring_bytes < slot:
            p.add("ring_mib", doc["ring_mib"],
                  f"the ring must hold at least one expert slot ({slot / MIB:.2f} MiB for "
                  f"{fmt.name} at hidden {geom.hidden}, ffn {geom.ffn})")
            ring_bytes = None

    prompts = _prompts(p, doc, base_dir, geom.hidden if geom else None)
    chunk = auto_chunk(prefill, prompts) if prefill is not None and prompts else None
    budget = _budget(p, doc, geom, fmt, chunk, ring_bytes)

    profile = None
    if doc.get("profile") is not None:
        profile = _path(p, "profile", doc["profile"], base_dir, must_exist=True)
    if profile is not None:
        try:
            counts = RoutingProfile.load(profile).counts
        except ConfigError as e:
            p.add("profile", doc["profile"], "; ".join(e.problems))
        else:
            if geom is not None and counts.shape != (geom.n_layers, geom.n_experts):
                p.add("profile", doc["profile"],
                      f"its counts are {counts.shape[0]} layers x {counts.shape[1]} experts; "
                      f"the model has {geom.n_layers} x {geom.n_experts}")
    repeats = _int(p, doc, "", "repeats", minimum=1, default=1)
    seed = _int(p, doc, "", "seed", minimum=0, default=0)

    output = Output()
    out_doc = _mapping(p, doc, "", "output", required=False)
    if out_doc is not None:
        p.unknown_keys("output", out_doc, _OUTPUT_KEYS)
        out_dir = None
        if out_doc.get("dir") is not None:
            out_dir = _path(p, "output.dir", out_doc["dir"], base_dir, must_exist=False)
        files = {k: _path(p, f"output.{k}", out_doc[k], out_dir or base_dir, must_exist=False)
                 for k in ("dump_r", "json") if out_doc.get(k) is not None}
        output = Output(dir=out_dir, **files)

    if p.items:
        raise ConfigError(p.items, source=where)
    assert geom is not None and fmt is not None
    return Config(source=source, spec=replace(geom, format=fmt.name), backend=backend,
                  prefill=prefill, prompts=tuple(prompts), gguf=gguf, model_seed=model_seed,
                  ring_mib=ring_mib, profile=profile, repeats=repeats, seed=seed,
                  output=output, **budget)


def load_config(path: str | Path, registry: QuantRegistry | None = None) -> Config:
    """Reads and validates a YAML run config; ConfigError names the file and every problem."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no such config file: {path}", source=str(path)) from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise ConfigError(f"cannot read the config file: {e.strerror or e}",
                          source=str(path)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", source=str(path)) from None
    return validate(doc, path.resolve().parent, source=path, registry=registry)
