"""A chunk's input on its way to the device: the CUDA executor's side of plan.ChunkInput.

begin_chunk starts the host pass (host_copy.stage: the copy into pinned staging memory and the
finite check, in parallel slices) and returns at once. The plan's ChunkInput op enqueues the
gate wait and the upload on the compute stream (InputPass.upload), and the pass opens the gate
when it is done.
So a walk's copy stream streams experts during the host pass, where it used to wait for it.
end_chunk takes the pass's verdict and refuses a non-finite input. The device only ever saw
finite values: the pass zeroes a slice that is not.

A whole model's chunk of token ids (ChunkInput "tokens") takes the same gate with a host pass
that is only T int32: the ids' range check, which takes the finite check's place, and their
copy into pinned memory, both in the calling thread at begin_chunk (cheap, so nothing is
deferred). An id outside the vocabulary is a ConfigError there, before anything is enqueued:
it never reaches the device, whose row gather would otherwise have to guard against it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...config.run.prompts import check_token_ids
from ...errors import ConfigError
from ...host.host_copy import stage

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...runtime import Stream
    from ...runtime.gate import HostGate
    from ...schedule.plan import InputKind


class Uploader(Protocol):
    """What the upload needs of a Runtime."""

    def memcpy_htod(self, dst: int, host: np.ndarray, stream: Stream) -> None: ...


def input_not_finite() -> ConfigError:
    """The error every backend raises for a chunk whose input holds NaN or infinity."""
    return ConfigError("prefill input holds NaN or Inf", source="prefill")


def chunk_token_ids(ids: np.ndarray, vocab: int) -> np.ndarray:
    """A chunk's token ids as int32 [T], refused (ConfigError naming the first bad id and its
    index in the chunk) unless a non-empty 1-D integer array inside 0..vocab-1: the check
    every backend runs on a chunk of token ids before it looks their rows up."""
    return check_token_ids(ids, vocab).astype(np.int32)


class InputPass:
    """The host pass of one chunk at a time, the pinned buffers it fills (`io`: float32
    hidden states, which the chunk's output reuses on its way back; `ids`: int32 token ids)
    and the gate its stream waits at."""

    def __init__(self, gate: HostGate, stream: Stream, io: np.ndarray, ids: np.ndarray):
        self.gate = gate
        self.stream = stream
        self.io, self.ids = io, ids
        self._pass: Future[bool] | None = None

    def start(self, h: np.ndarray, hidden: int) -> None:
        """Starts io[...] = h (float32 [T, hidden]) and its finite check; opens the gate when
        done."""
        self.settle()
        T = int(h.shape[0])
        self._pass = stage(self.io[: T * hidden].reshape(T, hidden), h, self.gate.open)

    def start_tokens(self, ids: np.ndarray) -> None:
        """ids[...] = ids (int32, checked by chunk_token_ids) and opens the gate at once: the
        pass over T ids needs no thread, and the ids cannot fail it later."""
        self.settle()
        self.ids[: ids.size] = ids
        self.gate.open()

    def upload(self, rt: Uploader, kind: InputKind, tokens: int, hidden: int,
               ptr: dict[str, int], embed: Callable[[Stream, int, int], None],
               first: int = 0, wait: bool = True) -> None:
        """ChunkInput on the stream: the wait at the gate, then the upload of the hidden
        states into ptr["x"], or of the token ids into ptr["token_ids"] followed by
        embed(stream, their address, tokens), which decodes their rows into x. A layer
        pass's chunk (prompt_pass) uploads rows first.. of the staged prompt, and only its
        first chunk waits (`wait`): the gate closes behind each wait."""
        if wait:
            self.gate.enqueue(self.stream)
        if kind == "tokens":
            rt.memcpy_htod(ptr["token_ids"], self.ids[first: first + tokens], self.stream)
            embed(self.stream, ptr["token_ids"], tokens)
        else:
            rt.memcpy_htod(ptr["x"], self.io[first * hidden: (first + tokens) * hidden],
                           self.stream)

    def finish(self) -> None:
        """After the chunk ran: raises ConfigError if the input held NaN or infinity."""
        done, self._pass = self._pass, None
        if done is not None and not done.result():
            raise input_not_finite()

    def settle(self) -> None:
        """Waits for an earlier pass, and closes a gate that no stream passed (a chunk that
        failed before its ChunkInput ran), so that the next pass does not find it open."""
        if self._pass is not None:
            self._pass.exception()  # waits; its verdict belonged to the chunk that failed
            self._pass = None
        if self.gate.is_open:
            self.stream.synchronize()
            if self.gate.is_open:
                self.gate.close()
