"""Running a layer split: one executor and one chunk driver per part, the parts run in layer
order for every chunk, the residual handed from part to part by the HandOff ops their plans
hold (strata_rt.schedule.split).

The engine holds a split as it holds one device: `SplitBackend` answers what the engine asks
of its backend (the logits from the last part, the KV capacity all parts share, the resident
experts of all parts for reporting, close), and `SplitDriver` answers run_chunk. Everything a
single device decides per chunk (walk or staging, decode, lanes, in place) each part decides
for its own layers, with its own residency and ring.

On CUDA each part runs inside its backend's `current()` (its device's context made current:
pycuda acts in the current context), and a part before the last leaves its output on the
device: its end_chunk reads nothing back, and its `finish_chunk` (the wait and the
finiteness verdict) runs once every part of the chunk is issued, so the host never waits
for one part before issuing the next.

STRATA_CHECK_PLAN (check_plan) on a split feeds every part's plan of every chunk to one
split.hazards.SplitChecker in host issue order, after the parts ran: the parts' hand-offs
are only ordered against each other, so no part's plan is complete alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError
from ..driver import ChunkDriver
from ..vram.residency import Residency
from . import LayerSplit, model_split, part_residency
from .hazards import SplitChecker

if TYPE_CHECKING:
    from ...config.settings.engine_config import EngineConfig
    from ...models.qwen3.weights import Qwen3Model
    from ...report.stats import Stats
    from ...weights.layer_formats import LayerFormats
    from ...weights.model import Model, MoESpec
    from ...weights.store import ExpertStore
    from ..executor import Backend, HostContext
    from ..plan import InputKind, LogitRows

#: the backends whose executors run a split's hand-offs
SPLIT_BACKENDS = ("reference", "cuda")


def on_device(backend: Any) -> AbstractContextManager[Any]:
    """The part's device made current for its work (a backend without devices: nothing)."""
    current = getattr(backend, "current", None)
    return current() if current is not None else nullcontext()


class SplitBackend:
    """The parts' backends as one engine backend. `residency` is every part's resident
    pairs in one table (counts and bytes for reports; each part numbers its own slots)."""

    def __init__(self, split: LayerSplit, backends: Sequence[Backend], slot_bytes: int):
        self.split = split
        self.backends = list(backends)
        first = self.backends[0]
        self.name = first.name
        self.host_is_wall = all(b.host_is_wall for b in self.backends)
        self.kv_capacity = min(b.kv_capacity for b in self.backends)
        r = first.residency
        pairs = [pair for b in self.backends for pair in b.residency.pairs]
        self.residency = Residency(r.n_layers, r.n_experts, pairs, slot_bytes)

    @property
    def input_kind(self) -> InputKind:
        """What the first part's chunks bring (the others receive the residual)."""
        return self.backends[0].input_kind

    @property
    def resident_bytes(self) -> list[int]:
        return [b.residency.nbytes for b in self.backends]

    def describe(self) -> list[str]:
        """The split as a run's summary shows it: layers and resident bytes per device."""
        return self.split.describe(self.resident_bytes)

    def take_logits(self) -> np.ndarray:
        return self.backends[-1].take_logits()

    def take_argmax(self) -> int | None:
        """The greedy token the last part took on its device (CudaWhole.take_argmax)."""
        return self.backends[-1].take_argmax()  # type: ignore[attr-defined]

    def max_chunk_tokens(self) -> int | None:
        limits = [f() for f in (getattr(b, "max_chunk_tokens", None) for b in self.backends)
                  if f is not None]
        return min(limits) if limits else None

    def close(self) -> None:
        """Closes the parts in reverse order; the first failure is raised after all ran."""
        error: BaseException | None = None
        for b in reversed(self.backends):
            try:
                b.close()
            except BaseException as e:  # noqa: BLE001 (every part is closed first)
                error = error or e
        if error is not None:
            raise error


class SplitDriver:
    """Runs each chunk through every part in layer order (what the engine's run_chunk
    does on one device)."""

    def __init__(self, spec: MoESpec, formats: LayerFormats, cfg: EngineConfig,
                 backend: SplitBackend):
        self.split = backend.split
        self.drivers = [ChunkDriver(spec, formats, cfg, b, part)
                        for b, part in zip(backend.backends, self.split.parts)]
        self.check_plan = bool(cfg.check_plan)
        self._backend = backend
        self._checker: SplitChecker | None = None

    @property
    def last_plan(self) -> Any:
        """The last part's plan of the last chunk (`plans` has every part's)."""
        return self.drivers[-1].last_plan

    @property
    def plans(self) -> list[Any]:
        return [d.last_plan for d in self.drivers]

    @property
    def decode_path(self) -> str | None:
        """What a one-token step runs on each part (ChunkDriver.decode_path): the one path
        where the parts agree, else theirs in layer order joined by "+"."""
        paths = [str(d.decode_path) for d in self.drivers]
        return paths[0] if len(set(paths)) == 1 else "+".join(paths)

    def layer_pass(self, tokens: int, chunk: int, start: int | None,
                   logits: LogitRows | None) -> bool:
        """Never: the parts run chunk by chunk (prefill_order "layers" says so, through the
        first part's ChunkDriver.layer_pass)."""
        return self.drivers[0].layer_pass(tokens, chunk, start, logits)

    def run_chunk(self, x: np.ndarray, stats: Stats, start: int | None = None,
                  logits: LogitRows | None = None, output: bool = True) -> np.ndarray:
        """x: the first part's input (hidden states, or a whole model's token ids); output:
        whether the last part brings its residual back (ChunkDriver.run_chunk)."""
        T = int(x.shape[0])
        out = x
        backends = self._backend.backends
        try:
            last_error: BaseException | None = None
            for part, driver, b in zip(self.split.parts, self.drivers, backends):
                rows = logits if part.last else None
                kept = output or not part.last
                try:
                    with on_device(b):
                        out = (driver.run_received(T, stats, start, rows, kept) if part.receives
                               else driver.run_chunk(x, stats, start, rows, output=kept))
                except BaseException as e:
                    if not part.last:
                        raise
                    last_error = e  # an earlier part's verdict names the earlier layer
                if self.check_plan and last_error is None:
                    self._check(part.index, driver)
            for b in backends[:-1]:
                finish = getattr(b, "finish_chunk", None)
                if finish is not None:
                    with on_device(b):
                        finish()
            if last_error is not None:
                raise last_error
        except BaseException:
            self._checker = None  # a chunk cut short leaves the hand-off order unknown
            raise
        return out

    def _check(self, index: int, driver: ChunkDriver) -> None:
        if self._checker is None:
            self._checker = SplitChecker(self.split, [b.residency for b in
                                                      self._backend.backends],
                                         [b.images for b in self._backend.backends])
        assert driver.last_plan is not None
        self._checker.feed(index, driver.last_plan)

    def close(self) -> None:
        for d, b in zip(self.drivers, self._backend.backends):
            with on_device(b):
                d.close()


def open_split(backend_cls: Any, model: Model, store: ExpertStore, cfg: EngineConfig,
               context: HostContext, whole: Qwen3Model | None) -> SplitBackend:
    """One backend per part of the split `cfg.devices` gets (schedule.split.model_split:
    `expert_cache` resident experts per device, chosen from the profile in each part's
    layers), each executor told of the others so its HandOff can read its sender."""
    if backend_cls.name not in SPLIT_BACKENDS:
        raise ConfigError(f"devices: {list(cfg.device_list)} splits the layers, which the "
                          f"{backend_cls.name} backend does not run yet (one Runtime per "
                          f"device is not built); use `backend: reference` or one device",
                          source="devices")
    split = model_split(model, cfg.device_list, cfg.expert_cache)
    profile = cfg.load_profile()
    backends: list[Any] = []
    try:
        for part in split.parts:
            residency = part_residency(model, part, cfg.expert_cache or 0, profile)
            backends.append(backend_cls(model, store, residency, cfg, context, whole=whole,
                                        part=part))
    except BaseException:
        for b in reversed(backends):
            b.close()
        raise
    for b in backends:
        b.peers = backends
    return SplitBackend(split, backends, model.layout.slot_bytes)
