"""The CUDA executor's side of a layer pass (strata_rt.schedule.planners.layer_pass): the residual
of every row of a prompt, the window of it that the ops act on, and what a pass keeps per chunk. Its
own module so the executor keeps to dispatch: a pass changes the chunk's state in a few places only,
all of them here.

Window. Every kernel that reads or writes the residual (LayerKernels' routing and combine,
CudaWhole's attention, head and embedding lookup, the input upload) takes it from ptr["x"] of
the arena's address map, a dict the executor shares with them and which they read at every
launch. At each PromptRows a pass points that entry at rows [first, first + tokens) of the
`pass_x` region (memory_plan.pass_regions) and the executor's row count at tokens, so every
op after it runs as it would on an ordinary chunk of those rows, reusing the chunk-sized
scratch (routing, sorted activations, group buffers, attention, logits) chunk after chunk.
Addresses are baked into launches as they are enqueued, so a captured pass replays its
windows; PassReplay keeps the windows its capture went through, and a replay leaves the
executor at the last one, as running the ops would have, for the live Logits after it.
`leave` points the map home again: at the pass's end, or at the next begin after a pass that
failed midway.

Input. begin_pass stages the whole prompt once in pinned memory of the pass (its token ids,
or its hidden rows with their finite check) and opens the input gate once. The first chunk's
ChunkInput waits at the gate (which closes behind each wait, so the others must not) and
every chunk's ChunkInput uploads its own rows: ids[first:first + tokens] looked up into the
window, or the hidden rows copied there.

Routing counts. Every chunk's LayerBegin routes into the same per-layer row bounds, so each
one's bounds are copied into pinned memory of the pass right after its routing (inside a
captured pass too: a few hundred bytes per chunk and layer); the pass's end adds every chunk's
counts to the counts begin_pass was given.

Non-finite rows. The RMSNorm's flag word (layer << 32 | row within the chunk) is one word per
chunk (`pass_flags`); the earliest layer, then the earliest row, is reported as a row of the
prompt (its chunk's first row added).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError
from ...schedule.vram.memory_plan import pass_chunks
from ..nonfinite import NonFiniteError
from .chunk_input import InputPass

if TYPE_CHECKING:
    from ...runtime import Graph, Runtime, Stream
    from ...schedule.plan import InputKind, PromptRows
    from .device_state import DeviceState
    from .split_part import PartReplay

#: the RMSNorm flag word when no row was flagged (rmsnorm_rows lowers it with atomicMin)
NO_ROW = (1 << 64) - 1
#: the regions a pass points elsewhere while it runs
MOVED = ("x", "nonfinite")


def flag_error(flagged: int, first: int = 0) -> NonFiniteError | None:
    """The error an RMSNorm flag word reports (None: no row flagged); first: the row of the
    prompt its chunk starts at."""
    if flagged == NO_ROW:
        return None
    return NonFiniteError("the RMSNorm before the MoE", flagged >> 32,
                          first + (flagged & 0xFFFFFFFF), "overflows or holds NaN/Inf: the sum "
                          "of squares of the row is not finite (checked on the device)")


@dataclass
class PassReplay:
    """A captured layer pass and the windows (first row, rows) its capture went through, in
    chunk order: a replay leaves the executor at the last (PromptPass.replayed)."""

    graph: Graph | PartReplay
    windows: tuple[tuple[int, int], ...]

    def launch(self, stream: Stream) -> None:
        self.graph.launch(stream)

    def free(self) -> None:
        self.graph.free()


class PromptPass:
    """A backend's layer-pass state: `capacity` prompt rows in chunks of at most `chunk_rows`
    (the executor's chunk buffers), `layers` layers routed per chunk. The device regions
    `pass_x` and `pass_flags` are in the arena already; this holds the pinned memory: the
    staged prompt (ids, or float32 hidden rows: capacity x hidden), each chunk's row bounds
    and flag word."""

    def __init__(self, rt: Runtime, dev: DeviceState, hidden: int, layers: int,
                 n_experts: int, chunk_rows: int, capacity: int, input_kind: InputKind):
        self.rt, self.dev, self.hidden = rt, dev, hidden
        self.chunk_rows, self.capacity = chunk_rows, capacity
        self.input_kind = input_kind
        #: chunks the pass has room for (their flag words and bounds)
        self.chunks = pass_chunks(capacity, chunk_rows)
        staged = ({"ids": capacity * 4} if input_kind == "tokens"
                  else {"io": capacity * hidden * 4})
        self._host = rt.pinned({**staged, "bounds": self.chunks * layers * (n_experts + 1) * 4,
                                "flags": self.chunks * 8})
        io = self._host.view("io", np.float32) if "io" in staged else np.empty(0, np.float32)
        ids = self._host.view("ids", np.int32) if "ids" in staged else np.empty(0, np.int32)
        #: the prompt's host pass: the ordinary input's gate, the pass's own staging
        self.input = InputPass(dev.input.gate, dev.compute, io, ids)
        self.bounds = self._host.view("bounds", np.int32).reshape(self.chunks, layers,
                                                                 n_experts + 1)
        self.flags = self._host.view("flags", np.uint64)
        #: the ordinary chunk's addresses of the regions a pass moves (leave restores them)
        self.home = {name: dev.ptr[name] for name in MOVED}
        #: the prompt's rows (0: no pass under way), its windows in chunk order, the current
        self.rows = 0
        self.windows: list[tuple[int, int]] = []
        self.chunk = 0
        self._counts: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self.rows > 0

    def check(self, rows: int, start: int, kv_capacity: int) -> None:
        """Refuses a prompt of `rows` at `start` that the pass cannot hold."""
        if not 0 < rows <= self.capacity:
            raise StrataError(f"a layer pass over {rows} prompt rows; this backend holds "
                              f"1..{self.capacity} (its prompt residual, sized at open)")
        if start < 0 or start + rows > kv_capacity:
            raise StrataError(f"a layer pass over positions {start}..{start + rows - 1}; the "
                              f"KV cache holds {kv_capacity}")

    def begin(self, x: np.ndarray, counts: np.ndarray | None) -> int:
        """Stages the prompt's input x (checked token ids int32 [P], or hidden states
        [P, hidden]) and points the map at the pass; counts: the layers' rows of a
        routing_counts array the pass's end adds to (None: none). -> the first window's
        rows, at most a chunk's."""
        dev = self.dev
        dev.input.settle()  # the gate is shared: an ordinary chunk's leftovers first
        if self.input_kind == "tokens":
            self.input.start_tokens(x)
        else:
            self.input.start(x, self.hidden)
        self.rows, self.windows, self.chunk, self._counts = int(x.shape[0]), [], 0, counts
        self.bounds[...] = 0  # a chunk that routes nothing adds nothing
        self.rt.memset_d8(dev.ptr["pass_flags"], 0xFF, self.chunks * 8, dev.compute)
        dev.ptr["x"], dev.ptr["nonfinite"] = dev.ptr["pass_x"], dev.ptr["pass_flags"]
        return min(self.rows, self.chunk_rows)

    def window(self, op: PromptRows) -> int:
        """A PromptRows: the map at its rows (and its chunk's flag word). -> its rows."""
        if not self.active:
            raise StrataError(f"{op!r} outside a layer pass (begin_pass opens one)")
        w = (op.first, op.tokens)
        if op.first < 0 or not 0 < op.tokens <= self.chunk_rows or sum(w) > self.rows:
            raise StrataError(f"{op!r}: this pass holds prompt rows 0..{self.rows - 1} in "
                              f"chunks of at most {self.chunk_rows}")
        if w not in self.windows:
            if len(self.windows) == self.chunks:
                raise StrataError(f"{op!r}: a pass of more than {self.chunks} chunks; this "
                                  f"backend has room for {self.chunks} of its chunk size")
            self.windows.append(w)
        self._point(self.windows.index(w))
        return op.tokens

    def _point(self, chunk: int) -> None:
        p = self.dev.ptr
        p["x"] = p["pass_x"] + self.windows[chunk][0] * self.hidden * 4
        p["nonfinite"] = p["pass_flags"] + chunk * 8
        self.chunk = chunk

    def upload_from(self) -> tuple[InputPass, int, bool]:
        """A ChunkInput's source: the staged prompt, the window's first row, and whether it
        waits at the gate (the first chunk only)."""
        first = self.windows[self.chunk][0] if self.windows else 0
        return self.input, first, first == 0

    def routed(self, at: int, bounds: int) -> None:
        """After a chunk's LayerBegin: layer `at` (the backend's own index) of its bounds
        (device address) into the chunk's pinned row, on the compute stream."""
        self.rt.memcpy_dtoh(self.bounds[self.chunk, at], bounds, self.dev.compute)

    def read_back(self, residual: bool = True) -> np.ndarray:
        """Enqueues the copies of the whole residual (into a new host array [P, hidden],
        returned; valid once the stream is waited for; residual False: none, an empty array)
        and of the chunks' flag words."""
        dev, n = self.dev, max(len(self.windows), 1)
        out = np.empty((self.rows if residual else 0, self.hidden), np.float32)
        if residual:
            self.rt.memcpy_dtoh(out, dev.ptr["pass_x"], dev.compute)
        self.flags[:] = NO_ROW  # what the copy below overwrites
        self.rt.memcpy_dtoh(self.flags[:n], dev.ptr["pass_flags"], dev.compute)
        return out

    def finish(self) -> None:
        """After the wait for the pass: refuses a non-finite input, adds every chunk's
        routing, refuses a flagged row (the earliest layer, then prompt row); leaves the
        pass whatever happens."""
        try:
            self.input.finish()
            if self._counts is not None:
                for c in range(len(self.windows)):
                    self._counts += np.diff(self.bounds[c], axis=1)
            flagged = [e for c, (first, _) in enumerate(self.windows)
                       if (e := flag_error(int(self.flags[c]), first)) is not None]
            if flagged:
                raise min(flagged, key=lambda e: (e.layer or 0, e.row))
        finally:
            self.leave()

    def leave(self) -> None:
        """The ordinary chunk's state again: the residual and flag word at their addresses;
        a pass left midway first waits for its input's host pass and closes a gate that no
        stream passed (InputPass.settle)."""
        if not self.active:
            return
        self.input.settle()
        self.dev.ptr.update(self.home)
        self.rows, self.windows, self.chunk, self._counts = 0, [], 0, None

    def captured(self, graph: Graph | PartReplay) -> PassReplay:
        return PassReplay(graph, tuple(self.windows))

    def replayed(self, replay: PassReplay) -> int:
        """After a replay of a captured pass: its windows, the map at the last. -> its rows."""
        if not self.active:
            raise StrataError("a captured layer pass replayed outside a pass (begin_pass)")
        self.windows = list(replay.windows)
        if not self.windows:
            return min(self.rows, self.chunk_rows)
        self._point(len(self.windows) - 1)
        return self.windows[-1][1]
