"""Expert blobs of a GGUF file, from its memory map into the expert store, converted across
all cores where the file's type is not the format's.

Memory: nothing holds all experts but the store. A layer whose tensors are the format's own
GGUF type is copied from the map into the store's arena and its pages are dropped from this
process at once, so the peak is the store plus about one layer of the file per host thread
(strata_rt.host.host_copy: layers are copied on several threads). A layer
of another type is converted by worker processes that map the file themselves; each returns
the blobs of a few experts, which go straight into the arena (at most two tasks per worker
wait in this process).

Speed: converting (the gguf package dequantizes, the format quantizes) runs at the speed of
the format's quantizer, one expert per task, on every core, with a progress line and an
estimate of the time left. Workers run the format's own `pack_gguf_experts` on one expert's
slice of the tensors, so their bytes are the bytes one process converting whole layers makes.

Every expert tensor is checked for NaN/Inf (`gguf_checks`) before its bytes are used.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import GGUFError, StrataError
from ..formats.contract import ExpertLayout, QuantFormat
from ..host import host_copy
from ..report.eta import Eta
from .gguf_file.gguf_checks import check_expert_bytes, dequantizable, typed
from .gguf_file.gguf_io import EXPERT_PARTS, FileMap, MoEFile, TensorRef
from .layer_formats import LayerFormats

log = logging.getLogger(__name__)

#: a conversion of fewer weights runs in this process unless workers are asked for: starting
#: processes (each imports numpy, gguf and the format) costs more than they save
SMALL_CONVERSION_WEIGHTS = 1 << 24
#: weights one task converts at most (small experts go several to a task)
TASK_WEIGHTS = 1 << 22
#: tasks submitted per worker ahead of the results (bounds the results waiting here)
IN_FLIGHT_PER_WORKER = 2


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------- one layer
@dataclass(frozen=True)
class LayerSource:
    """The expert tensors of one layer of the file and whether their bytes are the blob's."""

    layer: int  # layer number in the file
    parts: tuple[TensorRef, TensorRef, TensorRef]  # gate, up, down
    raw: bool


class _Part(NamedTuple):
    """What QuantFormat.pack_gguf_experts reads of a gguf ReaderTensor, for some experts."""

    name: str
    tensor_type: Any
    shape: np.ndarray  # GGUF order (innermost first)
    n_elements: int
    n_bytes: int
    data: np.ndarray


def _expert_range(fm: FileMap, ref: TensorRef, lo: int, hi: int) -> tuple[np.ndarray, int]:
    per = ref.nbytes // ref.shape[0]
    return fm.bytes(ref)[lo * per: hi * per], lo * per


def convert_experts(fm: FileMap, fmt: QuantFormat, src: LayerSource, lo: int, hi: int
                    ) -> np.ndarray:
    """Blobs of experts lo..hi-1 of one layer, through the format's pack_gguf_experts:
    uint8 [hi - lo, blob_bytes]. The one conversion path (in this process and in workers)."""
    from gguf import GGMLQuantizationType

    parts = []
    for ref in src.parts:
        raw, _ = _expert_range(fm, ref, lo, hi)
        shape = (hi - lo, *ref.shape[1:])
        parts.append(_Part(ref.name, GGMLQuantizationType(ref.ggml_type),
                           np.array(shape[::-1], np.uint64), math.prod(shape), raw.size,
                           typed(raw, ref.ggml_type, shape)))
    try:
        out = np.asarray(fmt.pack_gguf_experts(*parts), dtype=np.uint8)
    except StrataError as e:
        names = ", ".join(r.name for r in src.parts)
        raise GGUFError(f"{fm.path}: layer {src.layer} experts {lo}..{hi - 1} ({names}) do not "
                        f"convert to {fmt.name}: {e}") from None
    finally:
        for ref in src.parts:
            _, start = _expert_range(fm, ref, lo, hi)
            fm.release_range(ref.offset + start, (hi - lo) * (ref.nbytes // ref.shape[0]),
                             ref.file)
    return out.reshape(hi - lo, -1)


_worker_fmt: QuantFormat | None = None
_worker_maps: dict[str, FileMap] = {}


def _init_worker(fmt: QuantFormat, parent: int | None = None) -> None:
    """A worker leaves Ctrl-C to its parent (which ends it at once, see _end_workers), and on
    Linux asks the kernel to send it SIGTERM when the parent dies, however the parent dies
    (SIGKILL included): no worker outlives the conversion it works for."""
    global _worker_fmt
    _worker_fmt = fmt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if parent is not None and os.getppid() != parent:  # it died before the request
                os._exit(1)
        except (OSError, AttributeError):  # no prctl: the parent's _end_workers remains
            pass


#: prctl(2) option: the signal a process receives when its parent exits
PR_SET_PDEATHSIG = 1


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Ends the pool's workers now (SIGTERM, then SIGKILL after 1 s) rather than after the
    experts they are converting (half a minute on large shapes): an interrupted conversion
    keeps nothing, and Ctrl-C or SIGTERM should end the run at once."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 1.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    pool.shutdown(wait=False, cancel_futures=True)


def _worker_task(path: str, src: LayerSource, lo: int, hi: int) -> np.ndarray:
    fm = _worker_maps.get(path)
    if fm is None:
        fm = _worker_maps[path] = FileMap(Path(path))
    assert _worker_fmt is not None
    return convert_experts(fm, _worker_fmt, src, lo, hi)


# ---------------------------------------------------------------------------- the source
def _raw_ok(fmt: QuantFormat, lay: ExpertLayout, refs: tuple[TensorRef, ...]) -> bool:
    """Whether the blob is the tensors' bytes, expert by expert: gate rows, up rows, down
    rows in the format's own GGUF type (the layout every format with a GGUF type keeps)."""
    own = fmt.gguf_part_types()
    if None in own or any(r.ggml_type != t for r, t in zip(refs, own)):
        return False
    g, u, d = (r.nbytes // r.shape[0] for r in refs)
    return (lay.gate_up_offset == 0 and lay.gate_up_bytes == g + u
            and lay.down_offset == g + u and lay.down_bytes == d and lay.blob_bytes == g + u + d)


class GGUFExperts:
    """The expert source of a model loaded from a GGUF file (see the module doc). Model
    reaches it through `blob`, `write_layer`, `write_layers` and `layers`."""

    def __init__(self, fm: FileMap, formats: LayerFormats, n_experts: int,
                 sources: list[LayerSource], workers: int | None = None):
        #: each layer's format; a conversion has one target (the config's format) for all
        self.formats = formats
        self.fm, self.fmt, self.layout, self.n_experts = (fm, formats.format(0),
                                                          formats.slot_layout, n_experts)
        self.sources = sources
        self.workers = workers
        self._notice_given = False

    @classmethod
    def open(cls, moe: MoEFile, fmt: QuantFormat | LayerFormats,
             workers: int | None = None) -> GGUFExperts:
        """Checks that every layer's expert tensors are its format's types or convertible;
        raises one GGUFError listing every layer's problem. `fmt`: one format for every layer
        (converting what is of another type), or each layer's (a mixed file read as stored)."""
        hidden, ffn = moe.dims["hidden"], moe.dims["ffn"]
        formats = (fmt if isinstance(fmt, LayerFormats)
                   else LayerFormats.uniform(fmt, len(moe.experts), hidden, ffn))
        sources, problems = [], []
        for layer, refs in enumerate(moe.experts):
            assert refs is not None, "open_moe rejects files with missing expert tensors"
            parts = tuple(refs[p] for p in EXPERT_PARTS)
            fmt, lay = formats.format(layer), formats.layout(layer)
            raw = _raw_ok(fmt, lay, parts)
            for ref in parts if not raw else ():
                if not dequantizable(ref.ggml_type) and ref.ggml_type not in fmt.gguf_part_types():
                    problems.append(f"tensor {ref.name} has type {ref.type_name}: format "
                                    f"{fmt.name} does not take it raw and the gguf package "
                                    "cannot dequantize it")
            sources.append(LayerSource(layer, parts, raw))  # type: ignore[arg-type]
        if problems:
            from .gguf_file.gguf_io import problems_error

            raise problems_error(moe.path, problems)
        return cls(FileMap(moe.path), formats, moe.dims["n_experts"], sources, workers)

    @property
    def converted_types(self) -> list[str]:
        return sorted({r.type_name for s in self.sources if not s.raw for r in s.parts
                       if r.ggml_type != self.fmt.ggml_type})

    def layers(self, lo: int, hi: int) -> GGUFExperts:
        return GGUFExperts(self.fm, self.formats.sliced(lo, hi), self.n_experts,
                           self.sources[lo:hi], self.workers)

    # ------------------------------------------------------------------ reading
    def _check(self, src: LayerSource, lo: int = 0, hi: int | None = None,
               out: np.ndarray | None = None) -> None:
        """Checks experts lo..hi-1 of the layer for NaN/Inf, a tensor at a time, copying each
        tensor's bytes into `out` (raw layers) while its pages are mapped, then dropping them:
        about one tensor of the file is mapped at any time. Raises after the layer, listing
        each tensor with a problem."""
        hi = self.n_experts if hi is None else hi
        problems, col = [], 0
        for ref in src.parts:
            raw, start = _expert_range(self.fm, ref, lo, hi)
            bad = check_expert_bytes(ref.name, src.layer, raw, ref.ggml_type,
                                     (hi - lo, *ref.shape[1:]), first_expert=lo)
            if bad is not None:
                problems.append(bad)
            elif out is not None:
                per = raw.size // (hi - lo)
                out[:, col: col + per] = raw.reshape(hi - lo, per)
                col += per
            self.fm.release_range(ref.offset + start, raw.size, ref.file)
        if problems:
            from .gguf_file.gguf_io import problems_error

            raise problems_error(self.fm.path, problems)

    def _copy_raw(self, src: LayerSource, out: np.ndarray, lo: int = 0,
                  hi: int | None = None) -> None:
        self._check(src, lo, hi, out)

    def blob(self, layer: int, e: int) -> np.ndarray:
        out = np.zeros((1, self.layout.blob_bytes), np.uint8)
        src = self.sources[layer]
        if src.raw:
            self._copy_raw(src, out, e, e + 1)
        else:
            self._check(src, e, e + 1)
            out[:] = convert_experts(self.fm, self.fmt, src, e, e + 1)
        return out[0]

    def write_layer(self, layer: int, out: np.ndarray) -> None:
        """Writes the layer's blobs into out[n_experts, >= blob_bytes]."""
        self._write([(layer, out)])

    def write_layers(self, grid: np.ndarray) -> None:
        """Writes every layer into grid[n_layers, n_experts, >= blob_bytes] (the store)."""
        self._write([(layer, grid[layer]) for layer in range(len(self.sources))])

    # ------------------------------------------------------------------ the work
    def check_all(self) -> None:
        """Every layer checked for NaN/Inf (a tensor at a time): a conversion written in parts
        finds a NaN in the last layer before converting the first."""
        for src in self.sources:
            self._check(src)

    def write_jobs(self, jobs: list[tuple[int, np.ndarray]], eta: Eta) -> None:
        """(layer, out) pairs written as `write_layer` does, advancing the caller's progress
        line (one line over several calls: the conversion cache writes a file in parts)."""
        self._write(jobs, eta)

    def _write(self, jobs: list[tuple[int, np.ndarray]], shared: Eta | None = None) -> None:
        blob = self.layout.blob_bytes  # conversions: one target format, every layer alike
        conv = [(self.sources[i], out[:, :blob]) for i, out in jobs if not self.sources[i].raw]
        doing = f"converting experts to {self.fmt.name}" if conv else "loading experts"
        eta = shared or Eta(f"{self.fm.path.name}: {doing}", len(jobs) * self.n_experts,
                            "experts")
        def copy(job: tuple[int, np.ndarray]) -> None:
            i, out = job
            self._copy_raw(self.sources[i], out[:, :self.formats.layout(i).blob_bytes])

        try:
            # a layer per task on the host threads (the first bad layer's error, as in order)
            host_copy.run_each(copy, [(i, out) for i, out in jobs if self.sources[i].raw],
                               lambda _: eta.advance(self.n_experts))
            if conv:
                for src, _ in conv:  # a NaN in the last layer is found before the long part
                    self._check(src)
                self._say_converting()
                self._convert(conv, eta)
        finally:
            if shared is None:
                eta.close()

    def _say_converting(self) -> None:
        if self._notice_given:
            return
        self._notice_given = True  # one line per file, not one per layer
        log.warning("%s: expert tensors of type %s are not %s; converting them through float "
                    "weights (dequantized by the gguf package, then quantized)",
                    self.fm.path, ", ".join(self.converted_types), self.fmt.name)

    def _plan(self, conv: list[tuple[LayerSource, np.ndarray]], workers: int
              ) -> list[tuple[LayerSource, np.ndarray, int, int]]:
        weights = 3 * self.layout.hidden * self.layout.ffn
        total = len(conv) * self.n_experts
        k = max(1, min(TASK_WEIGHTS // weights, math.ceil(total / (2 * workers)),
                       self.n_experts))
        return [(src, out, lo, min(lo + k, self.n_experts))
                for src, out in conv for lo in range(0, self.n_experts, k)]

    def _convert(self, conv: list[tuple[LayerSource, np.ndarray]], eta: Eta) -> None:
        weights = len(conv) * self.n_experts * 3 * self.layout.hidden * self.layout.ffn
        workers = self.workers
        if workers is None:
            workers = 1 if weights < SMALL_CONVERSION_WEIGHTS else default_workers()
        tasks = self._plan(conv, workers)
        if workers <= 1:
            for src, out, lo, hi in tasks:
                out[lo:hi] = convert_experts(self.fm, self.fmt, src, lo, hi)
                eta.advance(hi - lo)
            return
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding CUDA
        pending: dict[Future, tuple[np.ndarray, int, int]] = {}
        queue = iter(tasks)
        pool = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx,
                                   initializer=_init_worker, initargs=(self.fmt, os.getpid()))

        def submit() -> None:
            task = next(queue, None)
            if task is not None:
                src, out, lo, hi = task
                pending[pool.submit(_worker_task, str(self.fm.path), src, lo, hi)] = \
                    (out, lo, hi)

        try:
            for _ in range(workers * IN_FLIGHT_PER_WORKER):
                submit()
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    out, lo, hi = pending.pop(f)
                    out[lo:hi] = f.result()
                    eta.advance(hi - lo)
                    submit()
        except BrokenProcessPool:
            _end_workers(pool)
            raise StrataError(f"{self.fm.path}: a conversion worker died (out of memory?); "
                              f"{workers} workers were converting experts to {self.fmt.name}"
                              ) from None
        except BaseException:  # Ctrl-C, SIGTERM (strata_rt.report.interrupts), an error of ours
            _end_workers(pool)
            raise
        pool.shutdown(wait=True)
