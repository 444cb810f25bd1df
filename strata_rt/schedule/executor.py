"""What a backend is to the chunk driver (strata_rt.schedule.driver): the executor that routes a
layer, runs plan ops and captures them for replay, and the host context an engine opens it on.
The CUDA executor and the numpy reference executor implement it; the driver and the engine
hold nothing else of a backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..report.stats import Stats
from .plan import InputKind, Op
from .vram.image_cache import ImageCache
from .vram.residency import Residency

if TYPE_CHECKING:
    from ..runtime import Stream


class Replay(Protocol):
    """A captured op sequence (a CUDA graph)."""

    def launch(self, stream: Stream) -> None: ...

    def free(self) -> None: ...


class Executor(Protocol):
    """What a backend does for the driver. Ops come in host issue order; each executor maps
    them onto its own streams (the CUDA executor) or runs them in that order (numpy)."""

    name: str
    residency: Residency
    #: group images kept on the device across chunks (an empty cache: none)
    images: ImageCache
    #: ring slots the streamed walk cycles through (the staging ring uses STAGING_RING_SLOTS)
    walk_slots: int
    #: bytes one Copy of each layer moves (its expert blob; layers of a mixed file differ)
    layer_blob_bytes: tuple[int, ...]
    #: whether `capture` may be used (CUDA graphs on, no timing events)
    can_capture: bool
    #: whether a routed walk's RouteCopies switches its copies on the device (the numpy
    #: executor; the CUDA one inside a captured graph, whose copies sit in conditional nodes)
    routed_copies: bool
    #: slots of the dense ring when a whole model's dense weights stream; None: resident
    #: (or MoE layers alone)
    dense_ring: int | None
    #: what begin_chunk takes for a whole model's chunk, and the kind of its plans'
    #: ChunkInput: "tokens" where the executor looks the embedding rows up itself, else
    #: "hidden" (MoE layers alone always)
    input_kind: InputKind
    #: prompt rows a layer pass (schedule.planners.layer_pass) may hold on this executor; 0: it
    #: cannot run one (the CUDA executor keeps the prompt's residual only when asked for)
    pass_tokens: int

    def lanes_for(self, tokens: int) -> int:
        """Compute lanes a chunk of `tokens` is planned with (strata_rt.schedule.vram.lanes)."""

    def in_place_for(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` reads resident groups in place
        (strata_rt.schedule.vram.in_place)."""

    @property
    def routed_gathers(self) -> bool:
        """Whether GatherRouted runs here (the format's kernels skip unrouted experts on the
        device and read the host store); without it a decode step takes the staging ring."""

    def begin_chunk(self, x: np.ndarray, stats: Stats, start: int | None = None) -> None:
        """Takes the chunk's input and its absolute position (None: MoE layers alone), which
        an Attention op without a start reads. The input is what `input_kind` names: hidden
        states float32 [T, hidden] (a whole model's: the embedding rows of its tokens), or a
        whole model's T token ids. It reaches the device at the plan's ChunkInput op; a
        chunk whose states are not all finite, or whose ids are not all inside the
        vocabulary, raises ConfigError (here or at end_chunk) and never reaches the device
        as such."""

    def begin_pass(self, x: np.ndarray, stats: Stats, start: int) -> None:
        """begin_chunk for a layer pass over a whole model's prompt (len(x) <= pass_tokens
        rows at position `start`): the residual holds every row; each PromptRows op of the
        plan picks the rows the ops after it act on, and its chunk's ChunkInput brings them
        in. end_chunk then returns the residual of every row."""

    def route_layer(self, layer: int) -> None:
        """Enqueues (or runs) one layer's routing ahead of a staging-ring layer."""

    def routed_counts(self, layer: int, stats: Stats) -> np.ndarray:
        """Waits for that routing; rows per expert of the layer (host int array), also added
        to stats.routing_counts when it is not None."""

    def execute(self, ops: Iterable[Op], stats: Stats, counts: np.ndarray | None) -> None:
        """Runs ops; counts: the layer's rows per expert when the host knows them (staging),
        None on the walk (routing stays on the device)."""

    def capture(self, ops: Iterable[Op]) -> Replay:
        """The ops captured for replay; raises when the driver refuses the capture."""

    def replay(self, replay: Replay) -> None: ...

    def synchronize(self) -> None: ...

    def collect_walk_routing(self, stats: Stats) -> None:
        """Adds the last walk's routing to stats.routing_counts (which is not None) by the
        time end_chunk returns: at once, or (CUDA) with the chunk's one wait."""

    def end_chunk(self, stats: Stats, output: bool = True) -> np.ndarray:
        """The chunk's output hidden states (the driver's caller copies them). output False:
        the caller reads none (a whole model's prefill that dumps nothing), so an executor
        may skip bringing them back and return an empty array."""

    def take_logits(self) -> np.ndarray:
        """float32 [rows, vocab] of the chunk's Logits op (valid after end_chunk): an array
        of its own, which the engine hands to its caller as it is."""


class HostContext(Protocol):
    """What an engine opens first and closes last: the host memory its expert store lives in
    (the CUDA context: memory of the Runtime it also holds, page-locked by `host_pin` once the
    store is filled; the reference backend's pins nothing)."""

    def host_alloc(self, nbytes: int) -> np.ndarray: ...

    def host_pin(self, host: np.ndarray) -> None: ...

    def close(self) -> None: ...


class Backend(Executor, Protocol):
    """An executor as the engine holds it: opened on a host context, closed once."""

    #: True where everything runs on the host (the engine then reports host time = wall time)
    host_is_wall: bool
    #: positions a whole model's KV cache holds (0 for MoE layers alone)
    kv_capacity: int

    def close(self) -> None: ...
