"""The run configuration: one YAML schema, validated all at once.

A config names a model (a GGUF file or synthetic dims), the format its experts run in, the
backend, one VRAM policy, the chunk size, the ring, a routing profile, the prompts and where the
results go. `load_config` reports every problem in one ConfigError (key path, the value given,
what is allowed) so a user fixes a file in one pass instead of one error per run.

Validation also checks what would otherwise fail after the run had started: the prompt files'
contents (token id ranges, NaN and Inf in hidden states), the output paths, the host memory the
run will allocate and the STRATA_MMQ_KERNEL variant. The checks live in config/run/schema.py and
the prompts in config/run/prompts.py; this module holds the validated objects and what derives from
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...runtime.memory import MIB
from ...schedule.split import parse_devices
from ...schedule.vram.image_cache import ImageCacheSetting, check_setting
from ...schedule.vram.in_place import InPlaceSetting, parse_in_place
from ...schedule.vram.lanes import LanesSetting, parse_lanes
from ...schedule.vram.memory_plan import MemoryPlan
from ...schedule.vram.residency import RoutingProfile
from ...weights.model import MoESpec
from ..files.input_files import CONFIG_LIMIT, InputFileError, read_text
from ..files.yaml_input import YamlProblem, load_yaml
from ..settings.engine_config import BACKENDS, EngineConfig
from .outputs import check_output, input_paths, output_collisions
from .prompts import Prompt, read_token_file
from .sampling import check_sampling
from .schema import (
    BUDGET_KEYS,
    TOP_KEYS,
    Problems,
    auto_chunk,
    check_budget,
    check_format,
    check_generate,
    check_model,
    check_prompts,
    device_memory_plan,
    file_path,
    host_memory_problem,
    integer,
    is_int,
    mapping,
    positive_number,
    shown_value,
)
from .whole import (
    check_context,
    check_dense,
    check_moe_only_file,
    check_prompts_fit,
    check_whole,
    whole_host_parts,
    whole_sizing,
)

if TYPE_CHECKING:
    from ...formats.contract import QuantFormat
    from ...formats.registry import QuantRegistry
    from ...models.qwen3.spec import Qwen3Spec
    from ...models.qwen3.whole_memory import DenseTypes, WholeSizing
    from ...text.sampling import SamplingParams

__all__ = ["BUDGET_KEYS", "Config", "Output", "Prompt", "auto_chunk", "device_memory_plan",
           "load_config", "read_token_file", "validate"]


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
    #: room for group images of resident experts (strata_rt.schedule.vram.image_cache): MiB or "all"
    image_cache_mib: ImageCacheSetting = None
    #: compute lanes (strata_rt.schedule.vram.lanes); None: STRATA_COMPUTE_LANES, else auto
    compute_lanes: LanesSetting | None = None
    #: products of resident experts read in place (strata_rt.schedule.vram.in_place); None:
    #: STRATA_IN_PLACE, else auto
    in_place: InPlaceSetting | None = None
    profile: Path | None = None
    repeats: int = 1
    seed: int = 0
    output: Output = field(default_factory=Output)
    #: a whole model's spec (None: MoE layers alone) and its synthetic options
    whole: Qwen3Spec | None = None
    whole_options: dict[str, Any] = field(default_factory=dict)
    #: the GGML types of the whole model's dense matrices (what sizes them on the device)
    whole_types: DenseTypes | None = None
    #: with a GGUF and no `format`: the format of its largest layer (what sizes the slots);
    #: every layer then runs its experts as the file stores them (weights.gguf_file.gguf_format)
    stored_format: QuantFormat | None = None
    #: KV-cache positions (None: the whole model's context length)
    context: int | None = None
    #: the devices the layers are split over (strata_rt.schedule.split); the budget keys
    #: apply to each of them
    devices: tuple[int, ...] = (0,)

    #: a whole model's dense weights: auto, resident or stream
    dense: str = "auto"
    #: tokens `strata run` produces after each prompt (`generate: {tokens: N}`)
    generate_tokens: int = 0
    #: how they (and `strata generate`'s) are chosen: `generate:`'s sampling keys; None: greedy
    sampling: SamplingParams | None = None

    @property
    def whole_sizes(self) -> WholeSizing | None:
        """What a whole model's device memory is sized by (None for MoE layers alone)."""
        return whole_sizing(self.whole, self.whole_types, self.context)

    @property
    def ring_bytes(self) -> int | None:
        return None if self.ring_mib is None else int(self.ring_mib * MIB)

    def input_paths(self) -> dict[str, Path]:
        """The files a run of this config reads, by what they are: no output may be one."""
        return input_paths(self.source, self.gguf, self.prompts, self.profile)

    def with_prompt_lengths(self, lengths: list[int]) -> Config:
        """The config with these prompt lengths (`--prompts`), host memory checked again."""
        cfg = replace(self, prompts=tuple(Prompt(i, n) for i, n in enumerate(lengths)))
        fmt = cfg.expert_format()
        plan = cfg.memory_plan(fmt) if cfg.whole is not None else None
        stream = cfg.dense == "stream" or (plan is not None and plan.dense_stream)
        extra = whole_host_parts(cfg.whole, cfg.whole_options, cfg.whole_types,
                                 cfg.gguf is not None, stream)
        why = host_memory_problem(cfg.spec, fmt, cfg.gguf is not None, cfg.prompts,
                                  cfg.chunk_tokens(), extra)
        if why is not None:
            raise ConfigError(f"--prompts: {why}", source="command line")
        positions = cfg.context or cfg.whole.context if cfg.whole is not None else None
        if positions is not None and max(lengths) > positions:
            raise ConfigError(f"--prompts: got a prompt of {max(lengths):,} tokens; the KV cache "
                              f"holds {positions:,} positions: give at most {positions:,} (or "
                              "raise the config's `context`)", source="command line")
        if cfg.whole is not None and cfg.generate_tokens:
            p = Problems()
            check_generate(p, {"generate": {"tokens": cfg.generate_tokens}}, True,
                           cfg.context or cfg.whole.context, cfg.prompts)
            if p.items:
                raise ConfigError([f"--prompts with {item}" for item in p.items],
                                  source="command line")
        return cfg

    def with_devices(self, devices: tuple[int, ...]) -> Config:
        """The config with these devices (`--devices`), checked against the layers."""
        if len(devices) > self.spec.n_layers:
            raise ConfigError(f"--devices: {len(devices)} devices for {self.spec.n_layers} "
                              "layers; each device needs at least one layer",
                              source="command line")
        return replace(self, devices=devices)

    def with_backend(self, backend: str) -> Config:
        if backend not in BACKENDS:
            raise ConfigError(f"backend: got {backend!r}; allowed: {', '.join(BACKENDS)}")
        return replace(self, backend=backend)

    def chunk_tokens(self) -> int:
        """The chunk the memory plan assumes (see auto_chunk)."""
        return auto_chunk(self.prefill, self.prompts)

    def expert_format(self, registry: QuantRegistry | None = None) -> QuantFormat:
        """The experts' format object (for a file run as stored, its largest layer's)."""
        if self.stored_format is not None:
            return self.stored_format
        from ...formats.registry import registry as default_registry

        return (registry or default_registry())[self.spec.format]

    def memory_plan(self, fmt: QuantFormat) -> MemoryPlan | None:
        """The device arena `vram_budget_mib` buys (None without a budget): the chunk's
        buffers and the ring first, resident experts in the rest."""
        if self.vram_budget_mib is None:
            return None
        return device_memory_plan(self.spec, fmt, self.chunk_tokens(), self.ring_bytes,
                                  int(self.vram_budget_mib * MIB), self.whole_sizes,
                                  self.dense)

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
        resolved by Engine.open, which logs the one line when it falls back). A VRAM budget
        fixes the chunk as well as the cache: left `auto`, the CUDA backend would grow the
        chunk into whatever VRAM is free beyond the budget."""
        fmt = self.expert_format(registry)
        if self.gguf is not None:
            as_stored = self.stored_format is not None
            model: dict[str, Any] = {"gguf": str(self.gguf),
                                     "format": None if as_stored else self.spec.format}
        elif self.whole is not None:
            model = {"qwen3": self.whole, "seed": self.model_seed,
                     "format": self.spec.format, **self.whole_options}
        else:
            model = {"spec": self.spec, "seed": self.model_seed}
        plan = self.memory_plan(fmt)
        dense = self.dense
        if plan is not None and self.whole is not None:
            # the budget decided where the dense weights live: the engine plans within free
            # VRAM, where `auto` would find room to keep them resident beyond the budget
            dense = "stream" if plan.dense_stream else "resident"
        return EngineConfig(
            model=model,
            backend=backend or self.backend,
            devices=self.devices,
            context=self.context,
            dense=dense,
            vram_reserve_mib=self.vram_reserve_mib,
            expert_cache=self.resident_experts(fmt),
            prefill=self.prefill if plan is None else plan.tokens,
            ring_bytes=self.ring_bytes,
            image_cache_mib=self.image_cache_mib,
            compute_lanes=self.compute_lanes,
            in_place=self.in_place,
            profile=None if self.profile is None else str(self.profile),
            dump_r=None if self.output.dump_r is None else str(self.output.dump_r),
        )


#: a chunk longer than any prompt a machine holds
MAX_TOKENS = 1 << 31
#: runs per prompt: more is a typo, not a measurement (it would run for ever)
MAX_REPEATS = 1_000_000


def validate(doc: Any, base_dir: Path, source: Path | None = None,
             registry: QuantRegistry | None = None) -> Config:
    """A parsed YAML document -> Config, or ConfigError listing every problem."""
    from ...formats.registry import registry as default_registry

    where = str(source) if source else "config"
    if not isinstance(doc, dict):
        keys = f"a mapping of keys ({', '.join(TOP_KEYS)})"
        raise ConfigError(f"the file is empty; expected {keys}" if doc is None
                          else f"expected {keys}, got {type(doc).__name__}", source=where)
    reg = registry or default_registry()
    p = Problems()
    p.unknown_keys("", doc, TOP_KEYS)
    geom, gguf, model_seed = check_model(p, doc, base_dir)
    fmt = check_format(p, doc, geom, reg, gguf)
    whole, whole_options, whole_types = check_whole(p, doc, geom, gguf)
    check_moe_only_file(p, doc, gguf, whole)
    context = check_context(p, doc, whole)
    dense = check_dense(p, doc, whole)
    whole_sizes = whole_sizing(whole, whole_types, context)

    backend = doc.get("backend", "auto")
    if backend not in BACKENDS:
        p.add("backend", backend, f"allowed: {', '.join(BACKENDS)}")

    prefill = doc.get("prefill", "auto")
    if prefill != "auto" and not (is_int(prefill) and 1 <= prefill <= MAX_TOKENS):
        p.add("prefill", prefill, "expected `auto` or a chunk size in tokens (integer "
              f"1..{MAX_TOKENS:,})")
        prefill = None

    ring_mib = positive_number(p, doc, "ring_mib", "MiB")
    ring_bytes = None if ring_mib is None else int(ring_mib * MIB)
    if ring_bytes is not None and geom is not None and fmt is not None:
        slot = fmt.layout(geom.hidden, geom.ffn).slot_bytes
        if ring_bytes < slot:
            p.add("ring_mib", doc["ring_mib"],
                  f"the ring must hold at least one expert slot ({slot / MIB:.2f} MiB for "
                  f"{fmt.name} at hidden {geom.hidden}, ffn {geom.ffn})")
            ring_bytes = None

    image_cache_mib = doc.get("image_cache_mib")
    why = check_setting(image_cache_mib)
    if why is not None:
        p.add("image_cache_mib", image_cache_mib, why)
        image_cache_mib = None
    elif image_cache_mib is not None and "vram_budget_mib" in doc:
        p.add("image_cache_mib", image_cache_mib,
              "the image cache takes device memory beside what `vram_budget_mib` plans; give "
              "`expert_cache` or `vram_reserve_mib` with it")
        image_cache_mib = None

    compute_lanes = p.parsed(doc, "compute_lanes", parse_lanes)
    in_place = p.parsed(doc, "in_place", parse_in_place)
    devices = check_devices(p, doc, geom)

    prompts = check_prompts(p, doc, base_dir, geom.hidden if geom else None,
                            whole.vocab if whole is not None else None,
                            None if whole is None else context or whole.context)
    if whole is not None:
        for pr in prompts:
            if pr.hidden_file is not None:
                p.add(f"prompts[{pr.index}].hidden_file", str(pr.hidden_file),
                      "a whole model takes tokens: give a length or {file: TOKENS}")
    chunk = auto_chunk(prefill, prompts) if prefill is not None and prompts else None
    budget = check_budget(p, doc, geom, fmt, chunk, ring_bytes, whole_sizes, dense)

    profile = None
    if doc.get("profile") is not None:
        profile = file_path(p, "profile", doc["profile"], base_dir, must_exist=True)
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
    generate_tokens = check_generate(p, doc, whole is not None,
                                     None if whole is None else context or whole.context,
                                     prompts)
    if whole is not None and not generate_tokens:  # else check_generate counted them in
        check_prompts_fit(p, doc, prompts, context or whole.context)
    sampling = check_sampling(p, doc.get("generate"))
    repeats = integer(p, doc, "", "repeats", minimum=1, default=1, maximum=MAX_REPEATS)
    seed = integer(p, doc, "", "seed", minimum=0, default=0)

    output = Output()
    out_doc = mapping(p, doc, "", "output", required=False)
    if out_doc is not None:
        output = Output(**check_output(p, out_doc, base_dir))
        outputs = {f"output.{k}": v for k, v in (("json", output.json),
                                                 ("dump_r", output.dump_r)) if v is not None}
        p.items += output_collisions(outputs, input_paths(source, gguf, prompts, profile))

    if geom is not None and fmt is not None and prompts and chunk is not None:
        stream = dense == "stream"
        if whole_sizes is not None and budget.get("vram_budget_mib") and dense == "auto":
            plan = device_memory_plan(geom, fmt, chunk, ring_bytes,
                                      int(budget["vram_budget_mib"] * MIB), whole_sizes)
            stream = plan.dense_stream
        extra = whole_host_parts(whole, whole_options, whole_types, gguf is not None, stream)
        why = host_memory_problem(geom, fmt, gguf is not None, prompts, chunk, extra)
        if why is not None:
            p.items.append(f"model: {why}")

    if p.items:
        raise ConfigError(p.items, source=where)
    assert geom is not None and fmt is not None
    return Config(source=source, spec=replace(geom, format=fmt.name), backend=backend,
                  prefill=prefill, prompts=tuple(prompts), gguf=gguf, model_seed=model_seed,
                  ring_mib=ring_mib, image_cache_mib=image_cache_mib,
                  compute_lanes=compute_lanes, in_place=in_place, profile=profile,
                  devices=devices,
                  repeats=repeats, seed=seed,
                  output=output, whole=whole, whole_options=whole_options,
                  whole_types=whole_types, context=context,
                  dense=dense, generate_tokens=generate_tokens,
                  sampling=None if sampling.is_greedy else sampling,
                  stored_format=fmt if gguf is not None and "format" not in doc else None,
                  **budget)


def check_devices(p: Problems, doc: dict, geom: MoESpec | None) -> tuple[int, ...]:
    """`devices`: distinct device indices, no more than the model has layers."""
    if "devices" not in doc:
        return (0,)
    value = doc["devices"]
    bad = [v for v in value if not is_int(v) or v < 0] if isinstance(value, list) else []
    if bad:  # shown as YAML writes it (`true`, not True)
        p.add("devices", value, f"{shown_value(bad[0])} is not a device index (an integer "
              ">= 0)")
        return (0,)
    try:
        devices = parse_devices(value)
    except ConfigError as e:
        p.add("devices", value, "; ".join(msg.removeprefix(f"devices: got {value!r}; ")
                                          .removeprefix("devices: ") for msg in e.problems))
        return (0,)
    if geom is not None and len(devices) > geom.n_layers:
        p.add("devices", doc["devices"], f"{len(devices)} devices for {geom.n_layers} layers; "
              "each device needs at least one layer")
    return devices


def load_config(path: str | Path, registry: QuantRegistry | None = None) -> Config:
    """Reads and validates a YAML run config; ConfigError names the file and every problem."""
    if not str(path):
        raise ConfigError("no config file given (the path is empty)", source="config")
    path = Path(path)
    try:
        doc = load_yaml(read_text(path, CONFIG_LIMIT, "a YAML run config"))
    except InputFileError as e:
        raise ConfigError(f"cannot read the config file: {e.why}" if e.why != "no such file"
                          else f"no such config file: {path}", source=str(path)) from None
    except YamlProblem as e:
        raise ConfigError(str(e), source=str(path)) from None
    return validate(doc, path.resolve().parent, source=path, registry=registry)
