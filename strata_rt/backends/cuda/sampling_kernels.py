"""The sampling kernel's launcher (kernels/model/sampling.cu) and the device sampler a whole
model's decode uses: the next token drawn on the GPU from the logits the output head left
there, so that a sampled step brings back one id, as a greedy one could.

`SamplingKernels.sample` is the bare launch (device pointers in, the id written on the device),
what the GPU tests compare with strata_rt.text.sampling.sample. `DeviceArgmax` is the greedy
step's: the argmax of the head's row (numpy's tie rule) and a NaN/infinity flag, 16 bytes back
instead of the row. `DeviceSampler` owns the few
bytes a decode step needs (the penalised ids, the id, a pinned copy of each) and returns the
id to the host. The logits are read, never written: the host copy the engine makes of them
stays what the kernel saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError
from ...resources import KERNELS_ROOT, kernel_constant
from ...text.sampling import MAX_CANDIDATES, SamplingParams, distinct_ids, plan

if TYPE_CHECKING:
    from ...runtime import Runtime, Stream

SAMPLING_SOURCE = KERNELS_ROOT / "model" / "sampling.cu"
THREADS = kernel_constant(SAMPLING_SOURCE, "SAMPLE_THREADS")
#: the kernel's candidate buffer, which the numpy definition's bound must equal
CAP = kernel_constant(SAMPLING_SOURCE, "SAMPLE_CAP")
if CAP != MAX_CANDIDATES:
    raise StrataError(f"sampling.cu holds {CAP} candidates, text.sampling {MAX_CANDIDATES}")
#: what the kernel writes instead of an id
BAD_LOGITS, ALL_MASKED = -1, -2
_WHY = {BAD_LOGITS: "the logits hold NaN or +inf; the model or its weights are broken",
        ALL_MASKED: "every logit is -inf: no token can be drawn"}


def shared_bytes(vocab: int) -> int:
    """Dynamic shared memory of one launch: the candidates (CAP uint64), then the larger of
    the float64 sums (CAP) and histogram (256 uint32) + scan (THREADS int32) + the penalty's
    bitmap (one bit per id), as sampling.cu lays them out."""
    bitmap = (vocab + 31) // 32 * 4
    return CAP * 8 + max(CAP * 8, 256 * 4 + THREADS * 4 + bitmap)


def signed_seed(seed: int) -> int:
    """A seed 0..2**64-1 as the int64 the launch packs (the kernel reads the same 64 bits)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class SamplingKernels:
    """The prepared sampling launch on one runtime."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self._kernel = rt.module(SAMPLING_SOURCE).kernel("sample_logits", "PiPiffiddqiP")

    def sample(self, stream: Stream, logits: int, vocab: int, seen: int, n_seen: int,
               params: SamplingParams, step: int, out: int) -> None:
        """Enqueues the draw from float32 logits [vocab] at `logits` into int32 out[0]; seen:
        n_seen distinct int32 ids 0..vocab-1 (the penalty's), params with a seed."""
        if params.seed is None:
            raise StrataError("sampling needs a seed: call SamplingParams.resolved() first")
        if not 0 < vocab < 2**31 or n_seen < 0:
            raise StrataError(f"sampling over {vocab} logits with {n_seen} penalised ids")
        sp = plan(params, vocab)
        self._kernel.launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream,
                            args=(logits, vocab, seen, n_seen, float(sp.penalty),
                                  float(sp.temperature), sp.candidates, sp.top_p, sp.min_p,
                                  signed_seed(params.seed), int(step), out),
                            shared=shared_bytes(vocab))


ARGMAX_THREADS = kernel_constant(SAMPLING_SOURCE, "ARGMAX_THREADS")
#: blocks of an argmax launch at most (two per SM of an H100 / H200; each strides the row)
ARGMAX_BLOCKS = 264
#: result bytes of an argmax launch: the uint64 key, the uint32 flag, padding
ARGMAX_RESULT = 16


def argmax_of_key(key: int) -> int:
    """The id a logits_argmax key names (its low 32 bits hold the id's complement)."""
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


def sampler_bytes(context: int) -> tuple[int, int]:
    """Device bytes of a DeviceSampler for `context` penalised ids: (the ids, the drawn id)."""
    return max(1, int(context)) * 4, 16


class DeviceArgmax:
    """The greedy token of one float32 row on the device: `enqueue` clears the result, launches
    logits_argmax and copies its 16 bytes into pinned memory without waiting; `token` reads them
    once the stream has been synchronized (None: the row holds NaN or infinity)."""

    def __init__(self, rt: Runtime, result: int | None = None):
        """result: the device address of ARGMAX_RESULT bytes in an arena the caller sized (a
        whole model's `argmax_result` region, counted by its memory plan); None: a small
        arena of its own."""
        self.rt = rt
        self._kernel = rt.module(SAMPLING_SOURCE).kernel("logits_argmax", "PiP", overlap=True)
        self._host = rt.pinned({"result": ARGMAX_RESULT})
        self._result_host = self._host.view("result", np.uint64)
        self._dev = None
        if result is None:
            self._dev = rt.device_arena({"result": ARGMAX_RESULT})
            result = self._dev.ptr("result")
        self._out = int(result)

    def enqueue(self, stream: Stream, logits: int, vocab: int) -> None:
        if not 0 < vocab < 2**31:
            raise StrataError(f"an argmax over {vocab} logits")
        out = self._out
        self.rt.memset_d8(out, 0, ARGMAX_RESULT, stream)
        blocks = min(ARGMAX_BLOCKS, -(-vocab // ARGMAX_THREADS))
        self._kernel.launch(grid=(blocks, 1, 1), block=(ARGMAX_THREADS, 1, 1), stream=stream,
                            args=(logits, vocab, out))
        self._result_host[:] = 0
        self.rt.memcpy_dtoh(self._result_host, out, stream)

    def token(self) -> int | None:
        """The argmax the last enqueue's copy left (after its stream was synchronized)."""
        key, flag = int(self._result_host[0]), int(self._result_host[1])
        return None if flag & 1 or key == 0 else argmax_of_key(key)

    def close(self) -> None:
        if self._dev is not None:
            self._dev.free()
        self._host.free()


class DeviceSampler:
    """Draws decode steps' tokens on the device for a vocabulary of `vocab` and at most
    `context` penalised ids (the KV cache's positions: a prompt and its tokens)."""

    def __init__(self, rt: Runtime, vocab: int, context: int,
                 device: tuple[int, int] | None = None):
        """device: the addresses of the penalised ids (sampler_bytes(context)[0] bytes) and the
        drawn id (16 bytes) in an arena the caller sized (a whole model's `sample_seen` and
        `sample_out` regions, counted by its memory plan); None: an arena of its own."""
        self.rt, self.vocab, self.context = rt, int(vocab), int(context)
        self.kernels = SamplingKernels(rt)
        seen_bytes, out_bytes = sampler_bytes(self.context)
        self._host = rt.pinned({"seen": seen_bytes, "out": out_bytes})
        self._seen_host = self._host.view("seen", np.int32)
        self._out_host = self._host.view("out", np.int32)
        self._dev = None
        if device is None:
            self._dev = rt.device_arena({"seen": seen_bytes, "out": out_bytes})
            device = (self._dev.ptr("seen"), self._dev.ptr("out"))
        self._seen, self._out = device

    def sample(self, stream: Stream, logits: int, params: SamplingParams,
               seen: Sequence[int] | np.ndarray, step: int) -> int:
        """The id drawn from float32 logits [vocab] at device address `logits` (waits for it:
        the id is the host's)."""
        ids = (distinct_ids(seen, self.vocab) if params.repetition_penalty != 1
               else np.zeros(0, np.int32))
        if ids.size > self.context:
            raise StrataError(f"{ids.size} penalised ids; this sampler holds {self.context}")
        if ids.size:
            self._seen_host[: ids.size] = ids
            self.rt.memcpy_htod(self._seen, self._seen_host[: ids.size], stream)
        self.kernels.sample(stream, logits, self.vocab, self._seen, int(ids.size), params, step,
                            self._out)
        self.rt.memcpy_dtoh(self._out_host[:1], self._out, stream)
        stream.synchronize()
        token = int(self._out_host[0])
        if token < 0:
            raise StrataError(_WHY.get(token, f"the sampling kernel wrote {token}"))
        return token

    def close(self) -> None:
        if self._dev is not None:
            self._dev.free()
        self._host.free()
