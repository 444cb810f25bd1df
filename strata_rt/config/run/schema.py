"""The checks behind a run config, one function per part of the YAML schema.

Each check adds what is wrong to a `Problems` collector (key path, the value given, what is
allowed) and returns what it could read, so `run_config.validate` reports every problem of a file
in one pass. Besides the schema they check what would otherwise fail late, after earlier
prompts had run: the prompt files' contents, the output paths, the host memory the run will
allocate and the STRATA_MMQ_KERNEL variant against the chosen format.

Paths in a config are relative to the config file's directory (the outputs' checks:
config/run/outputs.py).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ...backends.cuda.routing.kernels import ROUTINGS
from ...errors import ConfigError, FormatError
from ...runtime.memory import MIB
from ...schedule.planners.planner import AUTO_CHUNK_MAX, ring_sizes
from ...schedule.vram.memory_plan import DEFAULT_RESERVE_MIB, PASS_ORDERS, MemoryPlan, plan_memory
from ...weights.gguf_file.gguf_format import file_layer_formats
from ...weights.gguf_file.gguf_io import open_reader, read_header
from ...weights.model import MoESpec
from ..files.input_files import InputFileError, path_text_problem, regular_file_problem, user_path
from ..files.yaml_input import shown_value
from ..hostmem import MAX_MACHINE
from ..settings import env
from ..settings.engine_config import mmq_kernel_switch, prefill_order_switch
from .host_parts import GGUF_STAGED_LAYERS, host_memory_parts, host_memory_problem
from .prompts import Prompt, hidden_file_problem, read_token_file
from .sampling import SAMPLING_KEYS
from .whole import WHOLE_KEYS

if TYPE_CHECKING:
    from ...formats.contract import QuantFormat
    from ...formats.registry import QuantRegistry
    from ...models.qwen3.whole_memory import WholeSizing

__all__ = ["GGUF_STAGED_LAYERS", "host_memory_parts", "host_memory_problem", "shown_value"]

BUDGET_KEYS = ("expert_cache", "vram_reserve_mib", "vram_budget_mib")
#: what a config naming no VRAM policy gets (the backends' own default)
DEFAULT_VRAM_POLICY = (f"`vram_reserve_mib: {DEFAULT_RESERVE_MIB}` on the CUDA backend (free "
                       "VRAM less that holds experts), no resident expert on the reference "
                       "backend")
#: the prompts a config naming none runs (`run`, `bench`, `profile`; `generate` and
#: `perplexity` take their text from the command line)
DEFAULT_PROMPTS = (512,)
TOP_KEYS = ("model", "format", "backend", "devices", *BUDGET_KEYS, "prefill", "context", "dense",
            "ring_mib", "image_cache_mib", "compute_lanes", "in_place", "profile", "prompts",
            "repeats", "seed", "generate", "output")
_MODEL_KEYS = ("gguf", "synthetic")
_SYNTHETIC_KEYS = ("n_layers", "hidden", "ffn", "n_experts", "top_k", "seed", "rms_eps",
                   *WHOLE_KEYS)
_SYNTHETIC_REQUIRED = ("n_layers", "hidden", "ffn", "n_experts", "top_k")
_PROMPT_KEYS = ("file", "hidden_file")
_GENERATE_KEYS = ("tokens", *SAMPLING_KEYS)  # the sampling keys: config/run/sampling.py



T = TypeVar("T")


class Problems:
    """Collects every problem with its key path so validation reports them all at once."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, value: Any, allowed: str) -> None:
        shown = "(missing)" if value is MISSING else f"got {shown_value(value)}"
        self.items.append(f"{path}: {shown}; {allowed}")

    def parsed(self, doc: dict, key: str, parse: Callable[[object, str], T]) -> T | None:
        """doc[key] through `parse` (value, key) -> setting; None when the key is absent, or
        when parse refuses it (its ConfigError's problems are collected here)."""
        if doc.get(key) is None:
            return None
        try:
            return parse(doc[key], key)
        except ConfigError as e:  # `key: got <repr>; why` -> the value as YAML writes it
            given = f"{key}: got {doc[key]!r}; "
            for msg in e.problems:
                if msg.startswith(given):
                    self.add(key, doc[key], msg[len(given):])
                else:
                    self.items.append(msg)
            return None

    def unknown_keys(self, path: str, doc: dict, known: tuple[str, ...]) -> None:
        for key in doc:
            if key in known:
                continue
            name = key if isinstance(key, str) else shown_value(key)  # `null`, not None
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            self.items.append(f"{join(path, name)}: unknown key; {hint}"
                              f"known keys: {', '.join(known)}")


MISSING = object()

def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and not isinstance(v, bool) and math.isfinite(v)


#: the largest whole number a config key takes unless it says less: beyond it a size is no
#: run's (and numpy's int64 arithmetic would overflow)
MAX_INT = 1 << 53


def integer(p: Problems, doc: dict, path: str, key: str, *, minimum: int,
            default: Any = MISSING, maximum: int = MAX_INT) -> Any:
    v = doc.get(key, MISSING)
    if v is MISSING:
        if default is MISSING:
            p.add(join(path, key), v, f"required: an integer >= {minimum}")
        return None if default is MISSING else default
    if not is_int(v):
        p.add(join(path, key), v, f"expected an integer >= {minimum}")
        return None
    if v < minimum:
        what = "a size must be positive" if minimum == 1 else f"must be >= {minimum}"
        p.add(join(path, key), v, f"{what} (integer >= {minimum})")
        return None
    if v > maximum:
        p.add(join(path, key), v, f"expected an integer {minimum}..{maximum:,}")
        return None
    return v


def positive_number(p: Problems, doc: dict, key: str, unit: str,
                    zero_ok: bool = False) -> float | None:
    v = doc.get(key)
    if v is None:
        return None
    if not is_number(v) or v < 0 or (v == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        p.add(key, v, f"expected a number {bound} ({unit})")
        return None
    if unit == "MiB" and v * MIB > MAX_MACHINE:
        p.add(key, v, f"more than any machine holds (at most {MAX_MACHINE // MIB:,} MiB)")
        return None
    return float(v)


def mapping(p: Problems, doc: dict, path: str, key: str, required: bool) -> dict | None:
    v = doc.get(key, MISSING)
    if v is MISSING:
        if required:
            p.add(join(path, key), v, "required: a mapping")
        return None
    if not isinstance(v, dict):
        p.add(join(path, key), v, "expected a mapping (key: value lines)")
        return None
    return v


def file_path(p: Problems, path: str, v: Any, base: Path, must_exist: bool) -> Path | None:
    if not isinstance(v, str) or not v:
        p.add(path, v, "expected a file path (string)")
        return None
    why = path_text_problem(v)
    if why is not None:
        p.add(path, v, why)
        return None
    try:
        given = base / user_path(v)
    except InputFileError as e:
        p.add(path, v, e.why)
        return None
    try:
        resolved = given.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop on the way (RuntimeError < 3.13)
        loop = regular_file_problem(given) or ""
        p.add(path, v, loop if "symlink loop" in loop else f"cannot be resolved: {e}")
        return None
    if must_exist:
        why = regular_file_problem(resolved)
        if why is not None:
            shown = shown_value(str(resolved))[1:-1]
            if why.startswith("is a directory"):
                why = f"is a directory ({shown}); expected a file"
            else:
                why = f"{why} ({shown})"
            p.add(path, v, why)
            return None
    return resolved


def check_model(p: Problems, doc: dict, base: Path) -> tuple[MoESpec | None, Path | None, int]:
    """Returns (geometry, gguf path, model seed); geometry None when it cannot be known."""
    model = mapping(p, doc, "", "model", required=True)
    if model is None:
        return None, None, 0
    p.unknown_keys("model", model, _MODEL_KEYS)
    has = [k for k in _MODEL_KEYS if k in model]
    if len(has) != 1:
        p.add("model", {k: model[k] for k in has} if has else MISSING,
              "give exactly one of `gguf: PATH` or `synthetic: {n_layers, hidden, ffn, "
              "n_experts, top_k, seed, rms_eps}`")
        return None, None, 0
    if has == ["gguf"]:
        gguf = file_path(p, "model.gguf", model["gguf"], base, must_exist=True)
        if gguf is None:
            return None, None, 0
        # a broken file is a GGUF problem, not a config one: GGUFError's exit code (1) is the
        # same whichever command (run, bench, profile, inspect) meets it
        _, dims = read_header(gguf)
        dims.pop("arch")
        return MoESpec(**dims), gguf, 0
    syn = mapping(p, model, "model", "synthetic", required=True)
    if syn is None:
        return None, None, 0
    p.unknown_keys("model.synthetic", syn, _SYNTHETIC_KEYS)
    dims = {k: integer(p, syn, "model.synthetic", k, minimum=1) for k in _SYNTHETIC_REQUIRED}
    seed = integer(p, syn, "model.synthetic", "seed", minimum=0, default=0)
    eps = syn.get("rms_eps", 1e-6)
    if not is_number(eps) or not 0 < eps <= 1:
        p.add("model.synthetic.rms_eps", eps, "expected a number > 0 and <= 1 (e.g. 1e-6)")
        eps = None
    if None in dims.values() or eps is None:
        return None, None, seed
    if dims["top_k"] > dims["n_experts"]:
        p.add("model.synthetic.top_k", dims["top_k"],
              f"must be <= n_experts ({dims['n_experts']})")
        return None, None, seed
    return MoESpec(rms_eps=float(eps), **dims), None, seed


def check_format(p: Problems, doc: dict, geom: MoESpec | None,
                 reg: QuantRegistry, gguf: Path | None = None) -> QuantFormat | None:
    """The `format` key; absent with a GGUF model, the loaded format of the file's expert
    tensors' type (weights.gguf_file.gguf_format: the file's bytes run as they are)."""
    name = doc.get("format", MISSING)
    loaded = ", ".join(reg.names()) or "none"
    if name is MISSING and gguf is not None:
        if geom is None:
            return None  # the model's own problem is reported
        formats, why = file_layer_formats(open_reader(gguf), reg, geom.hidden, geom.ffn)
        if formats is None:
            p.add("format", name, f"the GGUF decides it when absent, but {why}")
            return None
        # each layer runs its own format; the largest layer's sizes the slots
        return formats.formats[formats.layouts.index(formats.slot_layout)]
    if not isinstance(name, str) or name not in reg:
        p.add("format", name, f"expected a loaded format: {loaded} (see `strata plugins`)")
        return None
    fmt = reg[name]
    kernel = mmq_kernel_switch()  # run only by the CUDA kernels: checked here too
    if kernel is not None and kernel not in fmt.mmq_variants():
        p.add("STRATA_MMQ_KERNEL (environment)", kernel,
              f"format {name} offers {', '.join(fmt.mmq_variants())}")
    if geom is not None:
        try:
            fmt.check_dims(geom.hidden, geom.ffn)
        except FormatError as e:
            model = doc.get("model", {})
            if "gguf" in model:  # the file's dims, named with the file
                p.add("model.gguf", model["gguf"], f"its dims (hidden {geom.hidden}, ffn "
                      f"{geom.ffn}) do not suit format {name}: {e}")
            else:
                p.add("model.synthetic", {"hidden": geom.hidden, "ffn": geom.ffn},
                      f"format {name}: {e}")
            return None
    return fmt


def check_prompts(p: Problems, doc: dict, base: Path, hidden: int | None,
                  vocab_size: int | None = None, context: int | None = None) -> list[Prompt]:
    """The prompts, with token files read and range-checked (against `vocab_size` once the
    model has a vocabulary) and hidden-state files checked for shape, NaN and Inf. Absent:
    DEFAULT_PROMPTS, each at most what a whole model's `context` leaves beside the tokens
    `generate` asks for."""
    items = doc.get("prompts", MISSING)
    if items is MISSING:
        gen = doc.get("generate")
        asked = gen.get("tokens") if isinstance(gen, dict) else None
        new = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
        room = None if context is None else context - new
        return [Prompt(i, max(1, min(n, room if room is not None else n)))
                for i, n in enumerate(DEFAULT_PROMPTS)]
    allowed = "a list of prompt lengths (integers >= 1), {file: TOKENS} or {hidden_file: X.npy}"
    if not isinstance(items, list) or not items:
        p.add("prompts", items, f"expected {allowed}")
        return []
    out = []
    for i, item in enumerate(items):
        path = f"prompts[{i}]"
        if is_int(item):
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
        f = file_path(p, f"{path}.{key}", value, base, must_exist=True)
        if f is None:
            continue
        try:
            if key == "file":
                n = int(read_token_file(f, vocab_size).size)
                if n == 0:
                    p.add(f"{path}.file", value, "the token file holds no tokens")
                    continue
                out.append(Prompt(i, n, token_file=f))
            else:
                rows, why = hidden_file_problem(f, hidden)
                if why is not None:
                    p.add(f"{path}.hidden_file", value, why)
                    continue
                assert rows is not None  # hidden_file_problem gives rows or why
                out.append(Prompt(i, rows, hidden_file=f))
        except ConfigError as e:
            reason = "; ".join(e.problems)
            p.add(f"{path}.{key}", value, reason if "token id" in reason
                  else f"unreadable: {reason}")
        except (ValueError, OSError) as e:
            p.add(f"{path}.{key}", value, f"unreadable: {e}")
    return out


def check_generate(p: Problems, doc: dict, whole_model: bool, context: int | None,
                   prompts: Sequence[Prompt]) -> int:
    """`generate: {tokens: N}`: the tokens `strata run` adds after each prompt (0 when
    absent; optional beside sampling keys, which `strata generate` reads too). Only a whole model has logits to choose them from, and the longest prompt plus N
    must fit the KV cache (`context`, the positions it holds), checked here rather than after
    the earlier prompts have run."""
    gen = mapping(p, doc, "", "generate", required=False)
    if gen is None:
        return 0
    p.unknown_keys("generate", gen, _GENERATE_KEYS)
    sampling_only = any(k in SAMPLING_KEYS for k in gen)
    n = integer(p, gen, "generate", "tokens", minimum=0, default=0 if sampling_only else MISSING)
    if n is None:
        return 0
    if not whole_model:
        p.add("generate", gen, "only for a whole model (MoE layers alone give no logits to "
              "choose tokens from)")
        return 0
    longest = max((pr.tokens for pr in prompts), default=0)
    if context is not None and longest + n > context:
        p.add("generate.tokens", n,
              f"the longest prompt ({longest} tokens) + {n} new ones need {longest + n} "
              f"KV-cache positions; the context holds {context} (ask for at most "
              f"{max(0, context - longest)}, or raise `context`)")
        return 0
    return n


def auto_chunk(prefill: str | int, prompts: Sequence[Prompt]) -> int:
    """The chunk a run takes: `prefill` when fixed, else what `auto` takes for the longest
    prompt (a longer chunk would only hold unused memory)."""
    if isinstance(prefill, int):
        return prefill
    return min(AUTO_CHUNK_MAX, max((p.tokens for p in prompts), default=1))


def device_memory_plan(spec: MoESpec, fmt: QuantFormat, chunk_tokens: int,
                       ring_bytes: int | None, budget_bytes: int | None = None,
                       whole: WholeSizing | None = None, dense: str = "auto") -> MemoryPlan:
    """The CUDA backend's device arena for `chunk_tokens`, sized by the backend's own
    plan_memory so the config's budget check and the allocation cannot disagree.

    With budget_bytes, resident experts fill what the chunk's buffers and the ring leave
    (BudgetError when those alone do not fit); without, no expert is resident: the least any
    budget must hold. The ring is sized as the backend sizes it before the residency is known
    (every expert streaming), an upper bound of the ring it allocates once it is. whole: a
    whole model's sizing, whose dense part the budget holds first (`dense`: its policy), and
    under STRATA_PREFILL_ORDER layers or auto the layer pass's residual of the context's rows
    (memory_plan.pass_regions), as the backend will allocate it."""
    fmt = fmt.for_variant(mmq_kernel_switch())  # the images the engine will hold
    lay = fmt.layout(spec.hidden, spec.ffn)
    ring_slots = ring_sizes(ring_bytes, lay.slot_bytes, spec.total_experts).total
    routing = env.choice("STRATA_ROUTING", ROUTINGS[0])
    passes = whole.context if whole is not None and prefill_order_switch() in PASS_ORDERS else 0
    return plan_memory(spec, lay, fmt.activation,
                       sys.maxsize if budget_bytes is None else budget_bytes, ring_slots,
                       chunk_tokens, 0 if budget_bytes is None else None, routing, whole, dense,
                       pass_tokens=passes)


def check_budget(p: Problems, doc: dict, geom: MoESpec | None, fmt: QuantFormat | None,
                 chunk: int | None, ring_bytes: int | None,
                 whole: WholeSizing | None = None, dense: str = "auto") -> dict[str, Any]:
    given = [k for k in BUDGET_KEYS if k in doc]
    if not given:  # the default policy: the backend's (DEFAULT_VRAM_POLICY)
        return {}
    if len(given) != 1:
        p.add(" / ".join(BUDGET_KEYS), {k: doc[k] for k in given},
              "give at most one VRAM policy: `expert_cache` (resident experts: a count or "
              "`all`), `vram_reserve_mib` (VRAM left free; the rest holds experts) or "
              "`vram_budget_mib` (VRAM strata_rt may use in all); none: "
              f"{DEFAULT_VRAM_POLICY}")
        return {}
    key = given[0]
    if key == "expert_cache":
        v = doc[key]
        total = geom.total_experts if geom is not None else None
        if v == "all":  # valid whatever the model; unknown dims are reported under `model`
            return {} if total is None else {key: total}
        if not is_int(v) or v < 0 or (total is not None and v > total):
            limit = f"0..{total} (n_layers x n_experts)" if total is not None else ">= 0"
            p.add(key, v, f"expected `all` or an integer {limit}")
            return {}
        return {key: v}
    mib = positive_number(p, doc, key, "MiB", zero_ok=key == "vram_reserve_mib")
    if mib is None or key == "vram_reserve_mib" or geom is None or fmt is None or chunk is None:
        return {key: mib}
    need = device_memory_plan(geom, fmt, chunk, ring_bytes, whole=whole,
                              dense="stream" if dense == "auto" else dense)
    if need.total > mib * MIB:
        p.add(key, doc[key],
              f"cannot hold one chunk's buffers: a {chunk}-token chunk needs "
              f"{need.total / MIB:.1f} MiB on the device ({need.describe()}); raise it, or "
              "lower `prefill` or `ring_mib`")
        return {}
    return {key: mib}
