"""EngineConfig: what an engine is opened with, validated in one place, with every switch
left None filled from the environment.

Every environment switch that changes what the engine does is read here and nowhere below:
the engine, the chunk driver, the executors, the kernel launchers and the GEMMs take the
resolved fields as plain values, so one EngineConfig says everything a run depends on, and
a field the driver reads on every chunk (gather_one, walk_min_tokens, decode) can change
between prompts of an open engine without touching the environment. A field set by the
caller beats its switch. (config/settings/env.py lists the process switches read elsewhere.)

Its own module because the engine, the chunk driver and both backends read it: here it depends
on none of them, so none of them depends on another through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...backends.cuda.routing.kernels import ROUTINGS
from ...errors import ConfigError
from ...schedule.planners.layer_pass import order_refusal
from ...schedule.split import parse_devices
from ...schedule.vram.image_cache import ImageCacheSetting, check_setting, parse_setting
from ...schedule.vram.in_place import InPlaceSetting, parse_in_place
from ...schedule.vram.lanes import LanesSetting, parse_lanes
from ...schedule.vram.residency import RoutingProfile
from . import env
from .settings_keys import check_keys

if TYPE_CHECKING:
    from ...models.qwen3.weights import Qwen3Model
    from ...weights.model import Model, MoESpec

BACKENDS = ("auto", "cuda", "reference")
DENSE_POLICIES = ("auto", "resident", "stream")
#: the choices of the switches resolved into fields of the same meaning (settings/env.py lists them)
DECODES = env.choices("STRATA_DECODE")
DECODE_ATTENTIONS = env.choices("STRATA_DECODE_ATTENTION")
DECODE_DENSES = env.choices("STRATA_DECODE_DENSE")
DECODE_ARGMAXES = env.choices("STRATA_DECODE_ARGMAX")
PREFILL_STREAMS = env.choices("STRATA_PREFILL_STREAM")
PREFILL_ATTENTIONS = env.choices("STRATA_PREFILL_ATTENTION")
TABLE_PRODUCTS = env.choices("STRATA_TABLE_PRODUCTS")
COPY_CHAIN_COUNTS = env.choices("STRATA_COPY_CHAINS")
PREFILL_ORDERS = env.choices("STRATA_PREFILL_ORDER")
DENSE_GEMMS = env.choices("STRATA_DENSE_GEMM")
EMBEDDINGS = env.choices("STRATA_EMBEDDING")
F16_GEMMS = env.choices("STRATA_F16_GEMM")
STORE_MEMORIES = env.choices("STRATA_STORE_MEMORY")


def output_switches() -> dict[str, str]:
    """The output paths the environment sets (STRATA_PREFILL_DUMP_R, STRATA_PREFILL_TRACE),
    by switch: what a run will write besides its config's outputs."""
    found = {"STRATA_PREFILL_DUMP_R": env.text("STRATA_PREFILL_DUMP_R"),
             "STRATA_PREFILL_TRACE": env.text("STRATA_PREFILL_TRACE")}
    return {k: v for k, v in found.items() if v is not None}


def mmq_kernel_switch() -> str | None:
    """STRATA_MMQ_KERNEL, or None when unset: what `mmq_kernel` resolves to, also read by a
    run config's checks, which size the images the engine will hold before it opens."""
    return env.text("STRATA_MMQ_KERNEL")


def prefill_order_switch() -> str:
    """STRATA_PREFILL_ORDER ("chunks" when unset): what `prefill_order` resolves to, also read
    by a run config's budget check, which holds a layer pass's residual under layers or auto
    as the backend will."""
    return env.choice("STRATA_PREFILL_ORDER", PREFILL_ORDERS[0])


def dense_gemm_switch() -> str:
    """STRATA_DENSE_GEMM ("cublas" when unset): what `dense_gemm` resolves to, also read by a
    run config's checks, which size a whole model's dense workspace before the engine opens."""
    return env.choice("STRATA_DENSE_GEMM", DENSE_GEMMS[0])


def embedding_switch() -> str:
    """STRATA_EMBEDDING ("auto" when unset): what `embedding` resolves to, also read by a
    run config's checks, which count the embedding the GPU would hold before the engine
    opens."""
    return env.choice("STRATA_EMBEDDING", EMBEDDINGS[0])


@dataclass(init=False)
class EngineConfig:
    """model: what strata_rt.weights.whole_model.load_model takes (MoE layers alone or a whole
    model). context: KV-cache positions of a whole model (None: the model's context length). expert_cache fixes the number of resident experts;
    otherwise the backend derives it (cuda: free VRAM minus vram_reserve_mib; reference: none
    resident). Every field a switch can set (gather_one, check_plan, timing, dump_r, decode, ...)
    defaults to that switch: `resolve` fills it."""

    model: Model | Qwen3Model | MoESpec | dict[str, Any]
    backend: str = "auto"
    #: devices the layers are split over (strata_rt.schedule.split), in layer order: distinct
    #: indices; each device gets the budget keys (expert_cache, vram_*) for itself. None
    #: after resolve: (0,), one device
    devices: tuple[int, ...] | list[int] | str | None = None
    #: for testing only: `devices` may name a GPU more than once ([0, 0]: two parts of the
    #: split on one GPU, sharing its context), so the hand-off path runs on a one-GPU machine;
    #: a real split gains nothing from it
    repeat_devices: bool = False
    context: int | None = None
    #: a whole model's dense weights: "resident" in VRAM, "stream" per layer through a small
    #: ring, or "auto" (resident when the budget holds them beside one chunk, else stream)
    dense: str = "auto"
    vram_reserve_mib: float | None = None
    expert_cache: int | None = None
    prefill: str | int = "auto"
    ring_bytes: int | None = None
    #: device memory for group images of resident experts kept across chunks
    #: (strata_rt.schedule.vram.image_cache): MiB, "all" (room for every group), or None
    #: (STRATA_IMAGE_CACHE_MIB, else none)
    image_cache_mib: ImageCacheSetting = None
    #: compute lanes (schedule.vram.lanes): "auto", "1" or "2"; None: STRATA_COMPUTE_LANES,
    #: else auto (two when every expert is resident)
    compute_lanes: LanesSetting | None = None
    #: products of resident experts read in place (schedule.vram.in_place): "auto", "on" or
    #: "off"; None: STRATA_IN_PLACE, else auto
    in_place: InPlaceSetting | None = None
    #: a layer whose every expert is read in place (strata_rt.schedule.planners.layer_products):
    #: "auto" (one launch per product where the format offers it) or "off" (one per group of
    #: 16); None: STRATA_TABLE_PRODUCTS, else auto
    table_products: str | None = None
    #: copy streams a routed walk's switched copies go round-robin over ("1" .. "4"); None:
    #: STRATA_COPY_CHAINS, else 1
    copy_chains: str | None = None
    #: a whole model's prefill attention on the CUDA backend (PREFILL_ATTENTIONS): "mma"
    #: (attention.cu), "wgmma" (attention_sm90.cu: sm_90, head dim 128) or "auto" (wgmma where
    #: the device runs it); None: STRATA_PREFILL_ATTENTION, else mma
    prefill_attention: str | None = None
    #: a whole model's prompt of several chunks (PREFILL_ORDERS): "chunks", "layers" (the
    #: layer pass, planners/layer_pass.py) or "auto"; None: STRATA_PREFILL_ORDER, else chunks. A
    #: CUDA backend holds a layer pass's residual of the whole context only under the last two
    prefill_order: str | None = None
    profile: str | None = None
    gather_one: bool | None = None
    #: chunks of at least this many tokens take the walk; None: decided by the routed share
    walk_min_tokens: int | None = None
    check_plan: bool | None = None
    timing: bool | None = None
    dump_r: str | None = None
    #: a Chrome/Perfetto trace file of the streams (STRATA_PREFILL_TRACE); implies timing
    trace: str | None = None
    #: CUDA routing kernels (routing.kernels.ROUTINGS): "exact" (default), "f16" or "fp32"
    routing: str | None = None
    #: the format's MMQ variant (STRATA_MMQ_KERNEL); None after resolve: the format's default
    mmq_kernel: str | None = None
    #: a whole model's one-token steps: "auto" (gemv where every layer's format offers it,
    #: else routed), "routed" (the decode plan, where the format's gathers offer it),
    #: "staging" (the staging ring) or "gemv" (the decode plan with matrix-vector launches
    #: over the routed experts; every layer's format must offer them); None: STRATA_DECODE,
    #: else auto (the driver's decode_mode says what it became)
    decode: str | None = None
    #: a whole model's attention in one-token chunks on the CUDA backend (DECODE_ATTENTIONS):
    #: "split" (over the cache length, merged) or "tiled" (the prefill's kernel);
    #: None: STRATA_DECODE_ATTENTION, else split
    decode_attention: str | None = None
    #: a whole model's dense projections and head in one-token chunks on the CUDA backend
    #: (DECODE_DENSES): "gemv" (matrix-vector kernels reading each weight in its own type) or
    #: "gemm" (the chunk's GEMMs); None: STRATA_DECODE_DENSE, else gemv
    decode_dense: str | None = None
    #: where a greedy decode step on the CUDA backend takes its token (DECODE_ARGMAXES):
    #: "device" (Engine.prefill_argmax takes the argmax on the GPU) or "host" (its logits
    #: come back); None: STRATA_DECODE_ARGMAX, else device
    decode_argmax: str | None = None
    #: how prefill chunks stream (PREFILL_STREAMS): "auto", "walk", "routed" or "routed_walk";
    #: None: STRATA_PREFILL_STREAM, else auto
    prefill_stream: str | None = None
    #: CUDA graphs for the walk and the decode step; None: STRATA_CUDA_GRAPH, else on
    cuda_graph: bool | None = None
    #: a whole model's dense GEMM: "cublas" or "own"; None: STRATA_DENSE_GEMM, else cublas
    dense_gemm: str | None = None
    #: a whole model's token embedding (EMBEDDINGS): "device" (the CUDA backend keeps it in
    #: VRAM in its GGUF type and looks each chunk's token ids up on the GPU), "host" (the
    #: rows are decoded on the host and uploaded as hidden states: the same bytes) or "auto"
    #: (whole_memory.embeds_on_gpu: device unless a plain float type the head does not share);
    #: None: STRATA_EMBEDDING, else auto
    embedding: str | None = None
    #: the grouped fp16 GEMM: "auto", "cutlass" or "own" (strata_rt.gemm.cutlass_gemm.cutlass_for);
    #: None: STRATA_F16_GEMM, else auto
    f16_gemm: str | None = None
    #: how the CUDA backend page-locks its host stores, the experts' and a whole model's
    #: streamed dense layers' (STORE_MEMORIES): "alloc"
    #: (cuMemHostAlloc, then the fill) or "register" (filled first, then cuMemHostRegister);
    #: None: STRATA_STORE_MEMORY, else alloc
    store_memory: str | None = None
    #: called as progress(chunk, n_chunks, layer, n_layers) after each layer
    progress: Callable[[int, int, int, int], None] | None = None
    _profile: RoutingProfile | None = field(default=None, repr=False, init=False)
    #: how dump_r was given, for its problems: the field, or its switch
    _dump_r_from: str = field(default="dump_r", repr=False, init=False)
    #: how mmq_kernel was given, for its refusal (weights.mmq_variant.check_mmq_kernel)
    _mmq_kernel_from: str = field(default="mmq_kernel", repr=False, init=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: D107 (see settings_keys.check_keys)
        check_keys(kwargs, len(args), _FIELDS)
        _dataclass_init(self, *args, **kwargs)  # type: ignore[arg-type]

    @property
    def device_list(self) -> tuple[int, ...]:
        """The devices as resolve leaves them (a tuple of distinct indices; (0,) unset)."""
        if isinstance(self.devices, tuple):
            return self.devices
        return parse_devices(self.devices if self.devices is not None else [0],
                             repeats=bool(self.repeat_devices))

    def load_profile(self) -> RoutingProfile | None:
        if self.profile is not None and self._profile is None:
            self._profile = RoutingProfile.load(self.profile)
        return self._profile

    def _type_problems(self) -> list[str]:
        """The fields a library caller may fill with anything: each of its kind, or None."""
        problems = []
        if self.profile is not None and not isinstance(self.profile, str | os.PathLike):
            problems.append(f"profile: got {self.profile!r}; allowed: a file path")
        v = self.vram_reserve_mib
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                              or not 0 <= v <= 1 << 30):
            problems.append(f"vram_reserve_mib: got {v!r}; allowed: MiB from 0 to "
                            "1,073,741,824 (1 PiB)")
        w = self.walk_min_tokens
        if w is not None and not _whole(w, 1, 1 << 31):
            problems.append(f"walk_min_tokens: got {w!r}; allowed: a number of tokens >= 1")
        for name in ("gather_one", "check_plan", "timing", "cuda_graph", "repeat_devices"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                problems.append(f"{name}: got {getattr(self, name)!r}; allowed: true or false")
        if self.mmq_kernel is not None and not isinstance(self.mmq_kernel, str):
            problems.append(f"mmq_kernel: got {self.mmq_kernel!r}; allowed: a variant's name "
                            "(`strata plugins` lists them)")
        if self.progress is not None and not callable(self.progress):
            problems.append(f"progress: got {self.progress!r}; allowed: a function called as "
                            "progress(chunk, n_chunks, layer, n_layers)")
        return problems

    def _output_problems(self) -> list[str]:
        """The dump and trace paths (given, or from the environment), checked before the
        engine opens: regular files or new names only, none of them the model's GGUF."""
        from ..files.paths import output_collisions, output_file_problem, results_file_problem

        outputs = {}
        from_env = output_switches()
        for key, switch in (("dump_r", "STRATA_PREFILL_DUMP_R"),
                            ("trace", "STRATA_PREFILL_TRACE")):
            value = getattr(self, key)
            value = from_env.get(switch) if value is None else value
            if value is None:
                continue
            if not isinstance(value, str | os.PathLike) or not str(value):
                return [f"{key}: got {value!r}; allowed: a file path"]
            outputs[key] = Path(value)
        problems = []
        if "dump_r" in outputs:
            outputs["dump_r (its .partial file)"] = Path(f"{outputs['dump_r']}.partial")
        for key, path in outputs.items():
            why = output_file_problem(path)
            if why is not None:
                problems.append(f"{key}: got {str(path)!r}; {why}")
        gguf = self.model.get("gguf") if isinstance(self.model, dict) else None
        inputs = {"the model's GGUF file": Path(gguf)} if isinstance(gguf, str) else {}
        if self.profile is not None:
            inputs["the routing profile"] = Path(self.profile)
        clashes = output_collisions(outputs, inputs)
        trace = outputs.get("trace")  # JSON; the dump is raw records, appended
        why = None if clashes or trace is None else results_file_problem(trace)
        return problems + clashes + ([] if why is None else [f"trace: got {str(trace)!r}; {why}"])

    def check_dump(self, hidden: int) -> None:
        """Refuses the residual dump's file, or its .partial name it is moved to while
        written, when it exists and is no earlier dump of a model `hidden` wide (nor empty):
        the engine empties it when it opens. The rule `strata_rt run` checks its outputs by
        (paths.dump_file_problem); called once the model, so its hidden size, is known."""
        from ..files.paths import dump_file_problem

        if not self.dump_r:
            return
        label = self._dump_r_from
        problems = [f"{name}: got {str(path)!r}; {why}" for name, path in (
            (label, Path(self.dump_r)),
            (f"{label.split(' ')[0]} (its .partial file)", Path(f"{self.dump_r}.partial")))
            if (why := dump_file_problem(path, hidden)) is not None]
        if problems:
            raise ConfigError(problems, source="engine config")

    @property
    def copy_streams(self) -> int:
        """The copy streams a routed walk's copies go over: copy_chains, or one under
        STRATA_PREFILL_TIMING, whose phase timer times copies on the first copy stream."""
        return 1 if self.timing or self.copy_chains is None else int(self.copy_chains)

    def resolve(self) -> EngineConfig:
        """Validates, and fills switches left None from the environment."""
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend: got {self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if not (self.prefill == "auto" or _whole(self.prefill, 1, 1 << 31)):
            problems.append(f"prefill: got {self.prefill!r}; allowed: \"auto\" or a positive "
                            "number of tokens (at most 2^31)")
        if self.expert_cache is not None and not _whole(self.expert_cache, 0, 1 << 40):
            problems.append(f"expert_cache: got {self.expert_cache!r}; allowed: an integer "
                            ">= 0")
        if self.routing is not None and self.routing not in ROUTINGS:
            problems.append(f"routing: got {self.routing!r}; allowed: {', '.join(ROUTINGS)}")
        if self.context is not None and not _whole(self.context, 1, 1 << 24):
            problems.append(f"context: got {self.context!r}; allowed: a positive number of "
                            "tokens (at most 16,777,216)")
        if self.dense not in DENSE_POLICIES:
            problems.append(f"dense: got {self.dense!r}; allowed: {', '.join(DENSE_POLICIES)}")
        why = check_setting(self.image_cache_mib)
        if why is not None:
            problems.append(f"image_cache_mib: got {self.image_cache_mib!r}; {why}")
        if self.compute_lanes is not None:
            try:
                self.compute_lanes = parse_lanes(self.compute_lanes)
            except ConfigError as e:
                problems.extend(e.problems)
        if self.in_place is not None:
            try:
                self.in_place = parse_in_place(self.in_place)
            except ConfigError as e:
                problems.extend(e.problems)
        if _whole(self.copy_chains, 1, len(COPY_CHAIN_COUNTS)):  # a count, as an int
            self.copy_chains = str(self.copy_chains)
        if self.ring_bytes is not None and not _whole(self.ring_bytes, 1, 1 << 50):
            problems.append(f"ring_bytes: got {self.ring_bytes!r}; allowed: a positive size "
                            "(at most 1 PiB)")
        for name, allowed in (("decode", DECODES), ("decode_attention", DECODE_ATTENTIONS),
                              ("decode_dense", DECODE_DENSES),
                              ("decode_argmax", DECODE_ARGMAXES),
                              ("prefill_stream", PREFILL_STREAMS),
                              ("prefill_attention", PREFILL_ATTENTIONS),
                              ("table_products", TABLE_PRODUCTS),
                              ("copy_chains", COPY_CHAIN_COUNTS),
                              ("prefill_order", PREFILL_ORDERS),
                              ("dense_gemm", DENSE_GEMMS), ("embedding", EMBEDDINGS),
                              ("f16_gemm", F16_GEMMS), ("store_memory", STORE_MEMORIES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                problems.append(f"{name}: got {value!r}; allowed: {', '.join(allowed)}")
        try:
            self.devices = self.device_list
        except ConfigError as e:
            problems.extend(e.problems)
        problems += self._type_problems()
        if not problems:
            problems += self._output_problems()
        if problems:
            raise ConfigError(problems, source="engine config")
        given = {name for name in ("prefill_order", "prefill_stream")
                 if getattr(self, name) is not None}
        if self.gather_one is None:
            self.gather_one = env.flag("STRATA_PREFILL_GATHER_ONE")
        if self.walk_min_tokens is None:
            self.walk_min_tokens = env.integer("STRATA_WALK_MIN_TOKENS")
        if self.check_plan is None:
            self.check_plan = env.flag("STRATA_CHECK_PLAN")
        if self.trace is None:
            self.trace = env.text("STRATA_PREFILL_TRACE")
        if self.timing is None:
            self.timing = env.flag("STRATA_PREFILL_TIMING") or self.trace is not None
        if self.dump_r is None:
            self.dump_r = env.text("STRATA_PREFILL_DUMP_R")
            if self.dump_r is not None:
                self._dump_r_from = "STRATA_PREFILL_DUMP_R (environment)"
        if self.routing is None:
            self.routing = env.choice("STRATA_ROUTING", ROUTINGS[0])
        if self.image_cache_mib is None:
            self.image_cache_mib = parse_setting(env.text("STRATA_IMAGE_CACHE_MIB"))
        if self.compute_lanes is None:
            self.compute_lanes = parse_lanes(env.choice("STRATA_COMPUTE_LANES", "auto"),
                                             "STRATA_COMPUTE_LANES")
        if self.in_place is None:
            self.in_place = parse_in_place(env.choice("STRATA_IN_PLACE", "auto"),
                                           "STRATA_IN_PLACE")
        if self.mmq_kernel is None:
            self.mmq_kernel = mmq_kernel_switch()
            self._mmq_kernel_from = "STRATA_MMQ_KERNEL"
        # a plain choice: the field, else its switch, else the first choice (strings: `or`)
        self.decode = self.decode or env.choice("STRATA_DECODE", DECODES[0])
        self.decode_attention = (self.decode_attention
                                 or env.choice("STRATA_DECODE_ATTENTION", DECODE_ATTENTIONS[0]))
        self.decode_dense = self.decode_dense or env.choice("STRATA_DECODE_DENSE",
                                                            DECODE_DENSES[0])
        self.decode_argmax = self.decode_argmax or env.choice("STRATA_DECODE_ARGMAX",
                                                              DECODE_ARGMAXES[0])
        self.prefill_stream = self.prefill_stream or env.choice("STRATA_PREFILL_STREAM",
                                                                PREFILL_STREAMS[0])
        self.prefill_attention = (self.prefill_attention
                                  or env.choice("STRATA_PREFILL_ATTENTION", PREFILL_ATTENTIONS[0]))
        self.table_products = self.table_products or env.choice("STRATA_TABLE_PRODUCTS",
                                                                TABLE_PRODUCTS[0])
        self.copy_chains = self.copy_chains or env.choice("STRATA_COPY_CHAINS",
                                                          COPY_CHAIN_COUNTS[0])
        self.f16_gemm = self.f16_gemm or env.choice("STRATA_F16_GEMM", F16_GEMMS[0])
        self.store_memory = self.store_memory or env.choice("STRATA_STORE_MEMORY",
                                                            STORE_MEMORIES[0])
        if self.prefill_order is None:
            self.prefill_order = prefill_order_switch()
        if self.cuda_graph is None:
            self.cuda_graph = env.flag("STRATA_CUDA_GRAPH", default=True)
        if self.dense_gemm is None:
            self.dense_gemm = dense_gemm_switch()
        if self.embedding is None:
            self.embedding = embedding_switch()
        why = order_refusal(self.prefill_order, self.prefill_stream, self.device_list, given)
        if why is not None:
            raise ConfigError(why, source="engine config")
        return self


def _whole(v: object, lo: int, hi: int) -> bool:
    """Whether v is an int (not a bool) in lo..hi."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


@dataclass
class _Fields(EngineConfig):
    """EngineConfig's fields with the dataclass's own __init__, which EngineConfig.__init__
    calls once the keywords are known (dataclass(init=False) keeps the class's own)."""


_dataclass_init = _Fields.__init__
_FIELDS = tuple(f.name for f in fields(EngineConfig))
