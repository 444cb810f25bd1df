"""The library API: Engine.open(config) -> engine.prefill(...) -> (array, Stats).

Two kinds of model (strata_rt.weights.whole_model): MoE layers alone, where prefill takes hidden
states [tokens, hidden] and returns the final hidden states; and a whole Qwen3-MoE model, where
prefill takes token ids, returns logits (the last position's, or every position's on request) and
keeps the KV cache for the next call (`kv_length`, `reset`). Both run every chunk through the same
chunk driver and plans; a whole model's layers open with an Attention op and its chunks end
with a Logits op.

A layer split (`devices` names several GPUs) opens one backend per device over the same host
store (schedule/split/driver.py), each running its own contiguous layers, the residual handed
from device to device; the engine sees them as one backend.

The engine owns what does not depend on the backend: the model, the host expert store, the
choice of resident experts (when the config fixes their count), chunking and the residual dump.
It opens in a fixed order so that a failure at any step closes what the earlier steps opened:
the backend's context first (cuda: the Runtime, whose pinned memory then holds the store), the
store, the residency, the backend (an executor, see driver.Executor), then the ChunkDriver,
which runs every chunk on the executor.

MoE layers alone have no attention, so their chunks are independent; a whole model's chunks
carry the KV cache forward. On the reference backend a token's result does not depend on its
chunk at all (same bytes for any chunking, staging or walk; tested for both kinds).

STRATA_PREFILL_DUMP_R: the file (new, empty or an earlier dump, else refused) is emptied when
an engine opens; every prefill appends each chunk's every 64th position (dump_residual), so
runs compare with `cmp`. A prefill writes it as `<path>.partial`, renamed when it completes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends.cuda.chunk_input import input_not_finite
from .backends.nonfinite import NonFiniteError, check_finite
from .config import hostmem
from .config.files.paths import DUMP_STRIDE, output_target
from .config.run.prompts import check_hidden_states, check_token_ids
from .config.settings.engine_config import EngineConfig
from .config.settings.settings_keys import settings
from .errors import ConfigError
from .host.host_copy import all_finite, copy_into, prefault
from .report.stats import Stats
from .report.timing import write_trace
from .schedule.driver import ChunkDriver
from .schedule.executor import Backend, HostContext
from .schedule.plan import LogitRows
from .schedule.planners.planner import AUTO_CHUNK_MAX
from .schedule.split.driver import SplitBackend, SplitDriver, open_split
from .schedule.vram.residency import Residency
from .weights.mmq_variant import check_mmq_kernel, with_variant
from .weights.model import Model
from .weights.store import ExpertStore
from .weights.whole_model import load_model

if TYPE_CHECKING:
    from .backends.cuda.executor import CudaBackend
    from .backends.reference.executor import ReferenceBackend
    from .models.qwen3.spec import Qwen3Spec
    from .models.qwen3.weights import Qwen3Model
    from .text.tokenizer import Tokenizer

__all__ = ["Engine", "load_model", "read_dump"]

log = logging.getLogger(__name__)


def backend_class(name: str) -> tuple[str, type[CudaBackend] | type[ReferenceBackend]]:
    """-> (resolved name, class). `auto` takes cuda when a device answers, else reference and
    says so in one line."""
    if name == "auto":
        from .runtime import cuda_available

        ok, why = cuda_available()
        if not ok:
            log.warning("backend auto -> reference (%s)", why)
        name = "cuda" if ok else "reference"
    if name == "cuda":
        from .backends.cuda.executor import CudaBackend

        return name, CudaBackend
    from .backends.reference.executor import ReferenceBackend

    return "reference", ReferenceBackend


def dump_residual(path: Path, h: np.ndarray, first_position: int) -> None:
    """Appends every DUMP_STRIDE-th position of a chunk's output: int64 position (of the
    prompt), then hidden float32 values, little-endian, per dumped position."""
    positions = np.arange(h.shape[0]) + first_position
    keep = positions % DUMP_STRIDE == 0
    rec = np.dtype([("pos", "<i8"), ("h", "<f4", (h.shape[1],))])
    out = np.empty(int(keep.sum()), dtype=rec)
    out["pos"] = positions[keep]
    out["h"] = h[keep]
    with open(path, "ab") as f:
        f.write(out.tobytes())


def read_dump(path: str | Path, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (positions int64 [n], values float32 [n, hidden]) of a residual dump."""
    rec = np.dtype([("pos", "<i8"), ("h", "<f4", (hidden,))])
    raw = np.fromfile(path, dtype=rec)
    return raw["pos"].astype(np.int64), raw["h"].astype(np.float32)


class Engine:
    def __init__(self, config: EngineConfig, model: Model, backend: Backend | SplitBackend,
                 backend_name: str,
                 context: HostContext | None = None, whole: Qwen3Model | None = None):
        self.config = config
        self.model = model
        #: the whole model (None: MoE layers alone)
        self.whole = whole
        #: positions the KV cache holds (a whole model's next token goes there)
        self.kv_length = 0
        self.backend: Backend | SplitBackend | None = backend
        self.context = context
        self.driver: ChunkDriver | SplitDriver = (
            SplitDriver(model.spec, model.formats, config, backend)
            if isinstance(backend, SplitBackend)
            else ChunkDriver(model.spec, model.formats, config, backend))
        self.residency: Residency = backend.residency
        self.config.backend = backend_name
        # a symlink is written through; resolve() refused what is not a regular file
        self._dump = output_target(config.dump_r) if config.dump_r else None
        if self._dump is not None:
            self._dump.parent.mkdir(parents=True, exist_ok=True)
            if self._dump.exists():
                self._dump_partial(self._dump)  # refuses what is no regular file
            self._dump.write_bytes(b"")  # each engine starts its dump afresh
        self.chunk_tokens = self._chunk_tokens()
        #: (label, trace events) of every prompt so far, for STRATA_PREFILL_TRACE
        self._traces: list[tuple[str, list[dict[str, Any]]]] = []
        #: the tokenizer, built on the first tokenizer() call
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def open(cls, config: EngineConfig | dict) -> Engine:
        cfg = config if isinstance(config, EngineConfig) else EngineConfig(**settings(config))
        cfg.resolve()
        model, whole = load_model(cfg.model)
        for fmt, _ in model.formats.distinct():
            check_mmq_kernel(fmt, cfg.mmq_kernel, cfg._mmq_kernel_from)
        model = with_variant(model, cfg.mmq_kernel)
        spec, slot = model.spec, model.layout.slot_bytes
        cfg.check_dump(spec.hidden)  # before the engine empties the file dump_r names
        hostmem.require(spec.n_layers * spec.n_experts * slot, "the expert store",
                        f"{spec.n_layers} layers x {spec.n_experts} experts x "
                        f"{hostmem.format_bytes(slot)}")
        name, backend_cls = backend_class(cfg.backend)
        context: HostContext = backend_cls.context_class(cfg.device_list, cfg.store_memory)
        backend: Any = None
        try:
            store = ExpertStore(model, context.host_alloc, context.host_pin)
            if len(cfg.device_list) > 1:  # a layer split: one backend per device, one store
                backend = open_split(backend_cls, model, store, cfg, context, whole)
                return cls(cfg, model, backend, name, context, whole)
            residency = None
            if cfg.expert_cache is not None:
                residency = Residency.from_budget(model, cfg.expert_cache, cfg.load_profile())
            backend = backend_cls(model, store, residency, cfg, context, whole=whole)
            return cls(cfg, model, backend, name, context, whole)
        except BaseException:
            if backend is not None:
                backend.close()
            context.close()
            raise

    def _chunk_tokens(self) -> int:
        if isinstance(self.config.prefill, int):
            return self.config.prefill
        limit = getattr(self.backend, "max_chunk_tokens", None)
        cap = limit() if limit is not None else None  # a split: its parts' smallest
        return min(AUTO_CHUNK_MAX, cap) if cap is not None else AUTO_CHUNK_MAX

    # ------------------------------------------------------------------ whole models
    @property
    def qwen3_spec(self) -> Qwen3Spec | None:
        """The whole model's dimensions (None for MoE layers alone)."""
        return None if self.whole is None else self.whole.spec

    @property
    def context_tokens(self) -> int:
        """Positions the KV cache can hold (0 for MoE layers alone)."""
        return self._open_backend().kv_capacity if self.whole is not None else 0

    def reset(self) -> None:
        """Forgets every cached position: the next prefill starts at position 0."""
        self.kv_length = 0

    def tokenizer(self) -> Tokenizer:
        """The whole model's tokenizer: from its GGUF, or a seeded synthetic vocabulary of the
        model's size for synthetic models. GGUFError when the GGUF carries none, TokenizerError
        when one cannot be built (e.g. the `tokenizers` library is missing). Built on
        the first call and kept: reading a GGUF's vocabulary or building the synthetic one
        costs far more than a prompt's encoding, and every later call returns the same object."""
        from .text.tokenizer import Tokenizer

        if self.whole is None:
            raise ConfigError("MoE layers alone have no tokenizer; open a whole model",
                              source="tokenizer")
        if self._tokenizer is None:
            src = self.config.model.get("gguf") if isinstance(self.config.model, dict) else None
            self.whole.check_file("its tokenizer")  # a GGUF changed since: not "no keys"
            self._tokenizer = (Tokenizer.from_gguf(src) if src is not None
                               else Tokenizer.synthetic(self.whole.spec.vocab))
        return self._tokenizer

    def prefill(self, inputs: np.ndarray, record_routing: bool = False, *,
                all_logits: bool = False) -> tuple[np.ndarray, Stats]:
        """MoE layers alone: hidden states float32 [tokens, hidden] -> the final hidden states
        and the counters. A whole model: token ids [tokens] at positions kv_length.. -> the
        logits float32 [vocab] of the last position (all_logits: [tokens, vocab]) and the
        counters; the KV cache keeps the tokens for the next call."""
        if self.whole is not None:
            return self._prefill_tokens(inputs, record_routing, "all" if all_logits else "last")
        if all_logits:
            raise ConfigError("all_logits needs a whole model; this engine runs MoE layers "
                              "alone", source="prefill")
        return self._prefill_hidden(inputs, record_routing)

    def prefill_argmax(self, token_ids: np.ndarray, record_routing: bool = False
                       ) -> tuple[int, Stats]:
        """`prefill` of a whole model's token ids that returns the last position's greedy
        token (the argmax, lowest id on ties) instead of its logits: under decode_argmax
        "device" a backend that can take it where the logits are (the CUDA one) brings back
        the id alone, else the row comes back and its argmax is taken here. Logits holding NaN
        or infinity raise NonFiniteError, as prefill's do."""
        if self.whole is None:
            raise ConfigError("the greedy token needs a whole model; this engine runs MoE "
                              "layers alone", source="prefill")
        token, stats = self._prefill_tokens(token_ids, record_routing, "argmax")
        return int(token[0]), stats

    def _prefill_tokens(self, token_ids: np.ndarray, record_routing: bool,
                        want: LogitRows) -> tuple[np.ndarray, Stats]:
        t0 = time.perf_counter()
        backend, whole = self._open_backend(), self.whole
        assert whole is not None
        ids = check_token_ids(token_ids, whole.spec.vocab)
        T, C, first = len(ids), self.chunk_tokens, self.kv_length
        if first + T > self.context_tokens:
            raise ConfigError(f"{T} tokens after the {first} cached ones exceed the context of "
                              f"{self.context_tokens} positions; reset() the engine or shorten "
                              "the prompt", source="prefill")
        # the backend looks the rows up itself (input "tokens": on the GPU), or takes the
        # rows decoded here (EngineConfig.embedding "host", or a type no GPU decoder reads)
        x = (ids.astype(np.int32) if backend.input_kind == "tokens"
             else whole.dense.token_embd.rows(ids).astype(np.float32))
        stats, partial = self._start_stats(T, record_routing)
        n_chunks = stats.n_chunks
        logits: list[np.ndarray] = []
        token: int | None = None  # the device's argmax of the last row ("argmax")
        take_argmax = (getattr(backend, "take_argmax", None)
                       if self.config.decode_argmax == "device" else None)
        host_argmax = want == "argmax" and take_argmax is None
        if host_argmax:
            want = "last"  # the row comes back; its argmax is taken below
        # a layer pass runs every chunk at once, layer by layer (driver.layer_pass)
        passing = self.driver.layer_pass(T, C, first, want)
        spans = [(0, T)] if passing else [(c * C, min(T, (c + 1) * C)) for c in range(n_chunks)]
        if passing:  # one run of the layers: progress and the phase table count it as one
            stats.prefill_order, stats.n_chunks = "layers", 1
        for c, (lo, hi) in enumerate(spans):
            stats.chunk_index = c
            rows: LogitRows | None = want if want == "all" or hi == T else None
            out = self._chunk(x[lo:hi], stats, first + lo, start=first + lo, logits=rows,
                              output=partial is not None,  # the residual only for its dump
                              **({"pass_chunk": C} if passing else {}))
            try:  # positions here count from the cache's start already
                if rows == "argmax":
                    token = take_argmax()  # type: ignore[misc]
                    if token is None:
                        raise NonFiniteError("the logits", None, first + hi - 1,
                                             "holds NaN or infinity (checked on the device)")
                elif rows is not None:  # a new array from every backend, checked on the host
                    chunk_logits = np.asarray(backend.take_logits(), dtype=np.float32)
                    at = np.arange(first + lo, first + hi) if rows == "all" else [first + hi - 1]
                    check_finite(chunk_logits, "the logits", None, np.asarray(at))
                    logits.append(chunk_logits)
            except NonFiniteError as e:
                raise self._named(e, 0) from None
            self.kv_length = first + hi
            stats.chunks += n_chunks if passing else 1
            if partial is not None:
                dump_residual(partial, out, first + lo)
        self._finish(stats, partial, t0, T)
        if want == "all":
            return np.concatenate(logits), stats
        if token is not None or host_argmax:
            return np.array([np.argmax(logits[-1][0]) if host_argmax else token], np.int64), stats
        return logits[-1][0], stats

    def _chunk(self, x: np.ndarray, stats: Stats, offset: int, **kw: Any) -> np.ndarray:
        """driver.run_chunk; a non-finite value named by its position (the chunk's at `offset`)."""
        try:
            return self.driver.run_chunk(x, stats, **kw)
        except NonFiniteError as e:
            raise self._named(e, offset) from None

    def _named(self, e: NonFiniteError, offset: int) -> NonFiniteError:
        """`e` with its rows shifted by `offset` and the GGUF named (the weights may be why)."""
        src = self.config.model.get("gguf") if isinstance(self.config.model, dict) else None
        return e.shifted(offset, None if src is None else f"{e.source} of {Path(src).name}")

    @property
    def split_lines(self) -> list[str]:
        """A layer split's parts (device, layers, resident bytes); empty on one device."""
        return self.backend.describe() if isinstance(self.backend, SplitBackend) else []

    def _open_backend(self) -> Backend | SplitBackend:
        if self.backend is None:
            raise ConfigError("this engine is closed", source="prefill")
        return self.backend

    def _start_stats(self, T: int, record_routing: bool, open_dump: bool = True
                     ) -> tuple[Stats, Path | None]:
        spec = self.model.spec
        stats = Stats(tokens=T, n_chunks=max(1, -(-T // self.chunk_tokens)),
                      n_layers=spec.n_layers, on_layer=self.config.progress)
        if record_routing:
            stats.routing_counts = np.zeros((spec.n_layers, spec.n_experts), np.int64)
        return stats, self._open_dump() if open_dump else None

    def _finish(self, stats: Stats, partial: Path | None, t0: float, T: int) -> None:
        if partial is not None and self._dump is not None:
            os.replace(partial, self._dump)
        stats.wall_s = time.perf_counter() - t0
        if self._open_backend().host_is_wall:
            stats.host_s = stats.wall_s  # the reference backend does everything on the host
        if self.config.trace and stats.trace is not None:
            self._traces.append((f"prompt {len(self._traces) + 1} ({T} tokens)", stats.trace))
            write_trace(self.config.trace, self._traces)

    # ------------------------------------------------------------------ MoE layers alone
    def _prefill_hidden(self, hidden: np.ndarray, record_routing: bool
                        ) -> tuple[np.ndarray, Stats]:
        t0 = time.perf_counter()
        self._open_backend()
        spec = self.model.spec
        h = check_hidden_states(hidden, spec.hidden)
        T, C = h.shape[0], self.chunk_tokens
        stats, partial = self._start_stats(T, record_routing, open_dump=False)
        n_chunks = stats.n_chunks
        # A chunk's executor checks its input on the way to the device, in the same pass as
        # the copy; a prompt of several chunks is checked whole first, so none of it runs.
        if n_chunks > 1 and not all_finite(h):
            raise input_not_finite()
        out = np.empty_like(h)
        touched = prefault(out)  # while the GPU works
        for c in range(n_chunks):
            lo, hi = c * C, min(T, (c + 1) * C)
            if hi <= lo:
                break
            stats.chunk_index = c
            result = self._chunk(h[lo:hi], stats, lo)
            touched.result()
            copy_into(out[lo:hi], result)
            stats.chunks += 1
            if c == 0:  # a refused input leaves earlier dumps where they were
                partial = self._open_dump()
            if partial is not None:
                dump_residual(partial, out[lo:hi], lo)
        self._finish(stats, partial, t0, T)
        return out, stats

    def _open_dump(self) -> Path | None:
        """The dump file under its in-progress name (what earlier prefills wrote, moved)."""
        if self._dump is None:
            return None
        partial = self._dump_partial(self._dump)
        if self._dump.is_file():
            os.replace(self._dump, partial)
        else:
            partial.write_bytes(b"")
        return partial

    @staticmethod
    def _dump_partial(dump: Path) -> Path:
        """`<dump>.partial`, once both names are regular files or free: only those are ever
        renamed (a device node given as the dump would be moved away from every process)."""
        partial = dump.with_name(dump.name + ".partial")
        for path in (dump, partial):
            if (path.exists() or path.is_symlink()) and not path.is_file():
                raise ConfigError(f"{path}: is not a regular file; the residual dump is not "
                                  "written there (give a new name or a regular file)",
                                  source="dump_r")
        return partial

    def close(self) -> None:
        """Frees everything, in the reverse order of open: captured graphs, the backend's
        device state, then the context (cuda: the runtime and the pinned store)."""
        if self.backend is None:
            return
        try:
            self.driver.close()
            self.backend.close()
        finally:
            self.backend = None
            if self.context is not None:
                self.context.close()
                self.context = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
