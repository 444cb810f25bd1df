"""The CUDA executor's Attention and Logits ops: a whole model's dense part on the GPU.

At open the dense weights go to the device once, in their GGUF types, as layer slots
(strata_rt.models.qwen3.whole_memory), with the head in its type, the RoPE tables (angles in
float64 on the host, as the numpy model computes them) and room for the KV cache. Each
Attention op is five launches on the compute stream, all reading and writing the chunk's
residual `x` in place, after the decodes of its weights into fp16 (DenseDecode; none for F16
weights, which the GEMMs read in place):

    xa   = fp16(RMSNorm(x) * attn_norm)              DenseKernels.rmsnorm_f16
    qkv  = xa . Wqkv^T                               DenseKernels.gemm (fp16 out)
    q, K[start..], V[start..] = norms + RoPE         AttentionKernels.qk_norm_rope
    o    = causal GQA attention over K, V [0, start+T)   AttentionKernels.attend
    x   += o . Wo^T                                  DenseKernels.gemm (fp32, accumulate)

A one-token chunk (a decode step) attends with DecodeAttention instead under decode_attention
"split" (the default, where the head layout has its kernels): the one query row per head is
spread over the cache length (32 blocks per KV head, float32 parts in `decode_part`) and
merged, two launches where the tiled kernel runs one block per KV head. Under decode_dense
"gemv" its projections and head are matrix-vector launches that read each weight in its own
type (GgmlGemv.dense: q, k and v as one launch per run of one type, Wo adding into x, the head
into float32 logits), with no decode into the scratch.

Logits: the chosen rows of x through RMSNorm * output_norm and the output head into float32, at
most LOGIT_ROWS rows per GEMM, each row slice copied back before the next (the host array is the
result). A head not stored as F16 is decoded HEAD_SLICE_ROWS vocabulary rows at a time before
each slice's GEMM (once per call when one slice holds the vocabulary, else once per row slice).
Nothing here synchronises except Logits, which the chunk's end would wait for anyway.

A sampled decode step draws its token from the last Logits op's row where the head left it
(`sample_last`, strata_rt.backends.cuda.sampling_kernels): one id comes back for it. A greedy
one (Logits rows "argmax") takes the row's argmax there (DeviceArgmax): 16 bytes come back
instead of the row, read after the chunk's one wait (`take_argmax`).

The token embedding (on the device that looks token ids up, sizing.embeds) goes to the device
once too, in its GGUF type (a tied head's bytes serve it where the head is on this device);
`embed` decodes the rows of a chunk's uploaded ids into x as float32 (strata_rt.gemm.ggml_rows:
gguf.quants.dequantize's values bit for bit, the rows the host path uploaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError
from ...gemm.ggml_gemv import GgmlGemv
from ...gemm.ggml_rows import GgmlRows
from ...models.qwen3.reference import rope_tables
from ...models.qwen3.whole_memory import (
    LOGIT_ROWS,
    WholeSizing,
    kv_bytes,
)
from ...schedule.plan import Attention, DenseCopy, Logits
from .attention.decode import DecodeAttention
from .attention.kernels import AttentionKernels
from .attention.shapes import decode_supported
from .dense.decode import DenseDecode, head_slices
from .dense.host_store import DenseHostStore, HostMemory
from .dense.kernels import DenseKernels
from .dense.slots import dense_slot_bytes, qkv_runs
from .sampling_kernels import DeviceArgmax, DeviceSampler

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ...models.qwen3.weights import Qwen3Model
    from ...runtime import Runtime, Stream
    from ...text.sampling import SamplingParams


def _no_mark(phase: str) -> None:
    """The default of run_attention's `mark`: no timing table."""


class CudaWhole:
    """Runs Attention, DenseCopy and Logits ops for the CUDA executor. `ptr` maps the arena's
    regions (see whole_memory) and the MoE region it shares: `x`, the chunk's float32 residual.
    Streamed dense weights (sizing.dense_stream) wait in a host store from `host` (the
    context: page-locked as EngineConfig.store_memory says, dense.host_store), one slot image
    per layer, for their DenseCopy (which copies that layer's own bytes, not the ring slot's).
    A layer split's part holds layers first.. of the model only (sizing.spec counts them,
    sizing.types holds theirs) and the head only when it is the last (sizing.head): ops name
    the model's layers, which index the part's slots and KV cache from `first`."""

    def __init__(self, rt: Runtime, whole: Qwen3Model, ptr: dict[str, int], ws_bytes: int,
                 sizing: WholeSizing, stream: Stream, host: HostMemory, first: int,
                 decode_attention: str, decode_dense: str, decode_argmax: str,
                 prefill_attention: str):
        self.rt, self.whole, self.spec, self.ptr = rt, whole, whole.spec, ptr
        self.first, self.n_layers, self.has_head = first, sizing.spec.n_layers, sizing.head
        self.context = sizing.context
        self.streamed = sizing.dense_stream
        spec = self.spec
        self.layout = sizing.layout()
        self.decode = DenseDecode(rt, spec, self.layout, ptr["dense_scratch"])
        self.attention = AttentionKernels(rt, spec.n_heads, spec.n_kv_heads, spec.head_dim,
                                          self.context, kernel=prefill_attention)
        #: a one-token chunk's attention (None: the tiled kernel serves every chunk)
        self.decode_attention: DecodeAttention | None = None
        if decode_attention == "split" and decode_supported(spec.n_heads, spec.n_kv_heads,
                                                            spec.head_dim):
            self.decode_attention = DecodeAttention(rt, spec.n_heads, spec.n_kv_heads,
                                                    spec.head_dim, context=self.context)
        self.dense = DenseKernels(rt, ptr["dense_ws"], ws_bytes, sizing.gemm)
        #: a one-token chunk's projections and head as matrix-vector launches (None: GEMMs);
        #: every type's kernel loaded now, not inside a captured graph
        self.gemv: GgmlGemv | None = None
        if decode_dense == "gemv":
            self.gemv = GgmlGemv(rt)
            q_dim = spec.n_heads * spec.head_dim  # the output projection's input
            inputs = {(t, k) for s in self.layout.slots for t, k in (
                (s.types.q, spec.hidden), (s.types.k, spec.hidden), (s.types.v, spec.hidden),
                (s.types.o, q_dim))} | ({(self.layout.head_type, spec.hidden)}
                                        if self.has_head else set())
            for name, k in sorted(inputs):
                self.gemv.prepare_dense(name, k)
        #: the embedding's row gather (its kernel loaded now, not inside a captured graph)
        self.rows: GgmlRows | None = None
        self.embd_type = whole.dense.token_embd.type_name
        self._embd_in_head = sizing.embd_in_head
        if sizing.embeds:
            self.rows = GgmlRows(rt)
            self.rows.kernel(self.embd_type)
        self._store = DenseHostStore(host, whole, first, self.layout) if self.streamed else None
        self._upload(stream)
        self._host = rt.pinned({"logits": LOGIT_ROWS * spec.vocab * 4, "position": 16})
        self._logits_host = self._host.view("logits", np.float32)
        #: the chunk's start on the device, read by an Attention op without a start (a
        #: decode step captured once and replayed at every position); its host copy
        self._position_host = self._host.view("position", np.int32)
        self.position = 0
        #: whether head_out holds one row of logits, contiguous (the last Logits op's rows)
        self._one_row = False
        #: the last Logits op's rows (None: none yet, or still in the pinned buffer)
        self.logits: np.ndarray | None = None
        #: rows whose logits enqueue_logits left in the pinned buffer (None: none pending)
        self._pending_rows: int | None = None
        self._sampler: DeviceSampler | None = None  # opened by the first sampled step
        #: the greedy token's kernel and buffers, opened now under decode_argmax "device" (not
        #: by the first step, whose time they would add to), else by a first greedy step
        self._argmax: DeviceArgmax | None = None
        if decode_argmax == "device" and self.has_head:
            self._argmax = DeviceArgmax(rt, ptr["argmax_result"])
        #: whether the last Logits op left an argmax to read; the token it read (None: the
        #: row held NaN or infinity)
        self._pending_argmax = False
        self.token: int | None = None

    def _upload(self, stream: Stream) -> None:
        rt, spec, p, layout = self.rt, self.spec, self.ptr, self.layout
        if self._store is None:  # resident layers (streamed ones wait in the filled store)
            for i, slot in enumerate(layout.slots):  # i: the part's own index of the layer
                image = dense_slot_bytes(self.whole, self.first + i, slot)
                rt.memcpy_htod(p["dense"] + layout.resident_offset(i), image, stream)
                stream.synchronize()  # the pageable source goes away with the next layer
        if self.has_head:
            d = self.whole.dense
            rt.memcpy_htod(p["head_norm"], d.output_norm.f32().astype(np.float32), stream)
            head = self.whole.output_weight
            rt.memcpy_htod(p["head"],
                           np.ascontiguousarray(head.data).view(np.uint8).reshape(-1), stream)
        if self.rows is not None and not self._embd_in_head:
            embd = self.whole.dense.token_embd
            rt.memcpy_htod(p["embd"],
                           np.ascontiguousarray(embd.data).view(np.uint8).reshape(-1), stream)
        cos, sin = rope_tables(spec, np.arange(self.context), np.float32)
        rt.memcpy_htod(p["rope_cos"], np.ascontiguousarray(cos), stream)
        rt.memcpy_htod(p["rope_sin"], np.ascontiguousarray(sin), stream)
        stream.synchronize()

    def embed(self, stream: Stream, ids: int, tokens: int) -> None:
        """x[r] = float32 row ids[r] of the embedding for r < tokens (ids: int32 on the
        device, inside the vocabulary: the executor checked them before the upload)."""
        if self.rows is None:
            raise RuntimeError("a ChunkInput of token ids, but this device holds no embedding")
        table = self.ptr["head" if self._embd_in_head else "embd"]
        self.rows.rows(stream, self.embd_type, table, ids, self.ptr["x"], tokens,
                       self.spec.vocab, self.spec.hidden)

    def kv_pointers(self, layer: int) -> tuple[int, int]:
        """(keys, values) base addresses of one layer's cache [context, n_kv_heads, head_dim]."""
        per = kv_bytes(self.spec, self.context) // self.spec.n_layers // 2
        base = self.ptr["kv"] + (layer - self.first) * 2 * per
        return base, base + per

    def set_position(self, stream: Stream, start: int) -> None:
        """Enqueues the chunk's start into the device position register (the host copy is
        not touched again before the chunk ends: the executor synchronizes at every chunk's
        end)."""
        self.hold_position(start)
        self.upload_position(stream)

    def hold_position(self, start: int) -> None:
        """The host half of set_position: a split's sender enqueues the upload at its
        ChunkInput, behind its wait for the receiver's copy of the previous position."""
        self.position = int(start)
        self._position_host[0] = self.position

    def upload_position(self, stream: Stream) -> None:
        self.rt.memcpy_htod(self.ptr["position"], self._position_host[:1], stream)

    def receive_position(self, sender: CudaWhole, stream: Stream) -> None:
        """A split part's HandOff: the sender's position register into this one's (a decode
        step replayed as a graph reads it on the device) and its host copy."""
        self.rt.memcpy_peer(self.ptr["position"], sender.ptr["position"], sender.rt, 4, stream)
        self.position = sender.position

    def copy_dense(self, stream: Stream, op: DenseCopy) -> None:
        """Layer op.layer's slot image from the host store into dense ring slot op.slot."""
        if self._store is None:
            raise RuntimeError("DenseCopy in a plan whose dense weights are resident")
        i = op.layer - self.first
        self.rt.memcpy_htod(self.ptr["dense"] + op.slot * self.layout.slot_bytes,
                            self._store.layer(i, self.layout.slots[i].nbytes), stream)

    def run_attention(self, stream: Stream, op: Attention, tokens: int,
                      mark: Callable[[str], None] = _no_mark) -> None:
        """The layer's five launches; mark(phase) opens each phase of the timing table (dense:
        the norm, the Wqkv decode and the QKV GEMM, rope: q/k norms + RoPE + KV append,
        attention, dense o: the Wo decode and its GEMM)."""
        spec, p, T = self.spec, self.ptr, tokens
        if (op.dense_slot is None) == self.streamed:
            raise RuntimeError(f"Attention of layer {op.layer} with dense slot "
                               f"{op.dense_slot}, but the dense weights are "
                               f"{'streamed' if self.streamed else 'resident'}")
        slot = self.layout.slots[op.layer - self.first]
        base = p["dense"] + (self.layout.resident_offset(op.layer - self.first)
                             if op.dense_slot is None
                             else op.dense_slot * self.layout.slot_bytes)
        H, eps = spec.hidden, float(spec.rms_eps)
        k_cache, v_cache = self.kv_pointers(op.layer)
        dk, ak = self.dense, self.attention
        start, start_dev = op.start, 0
        if start is None:  # the register set_position filled (a decode step's plan)
            start, start_dev = self.position, self.ptr["position"]
        gemv = self.gemv if T == 1 else None
        mark("dense qkv")
        dk.rmsnorm_f16(stream, p["x"], base + slot.attn_norm, p["xa"], T, H, eps)
        if gemv is not None:
            for type_name, offset, row, rows in qkv_runs(slot, H, spec.q_dim, spec.kv_dim):
                gemv.dense(stream, type_name, base + offset, p["xa"], p["qkv"] + 2 * row, rows,
                           H, "f16")
        else:
            wqkv = self.decode.wqkv(stream, base, slot)
            dk.gemm(stream, p["xa"], wqkv, p["qkv"], T,
                    spec.q_dim + 2 * spec.kv_dim, H, out_f32=False, accumulate=False)
        mark("qk norm+rope")
        ak.qk_norm_rope(stream, p["qkv"], T, start, base + slot.q_norm, base + slot.k_norm, p["rope_cos"], p["rope_sin"], eps,
                        p["q_rot"], k_cache, v_cache, start_dev)
        mark("attention")
        if T == 1 and self.decode_attention is not None:
            self.decode_attention.attend(stream, q=p["q_rot"], k_cache=k_cache,
                                         v_cache=v_cache, start=start, part=p["decode_part"],
                                         out=p["attn_out"], start_dev=start_dev)
        else:
            ak.attend(stream, p["q_rot"], k_cache, v_cache, start, T, p["attn_out"],
                      start_dev)
        mark("dense o")
        if gemv is not None:
            gemv.dense(stream, slot.types.o, base + slot.o, p["attn_out"], p["x"], H, spec.q_dim,
                       "add_f32")
            return
        wo = self.decode.wo(stream, base, slot)
        dk.gemm(stream, p["attn_out"], wo, p["x"], T, H, spec.q_dim,
                out_f32=True, accumulate=True)

    def logits_op(self, stream: Stream, op: Logits, tokens: int) -> None:
        """A Logits op: rows that fit one block are enqueued (enqueue_logits) and read by
        finish_chunk after the chunk's one synchronisation; more rows wait block by block
        (run_logits). `logits` then holds them."""
        self.logits = None
        if not self.enqueue_logits(stream, op, tokens):
            self.logits = self.run_logits(stream, op, tokens)

    def take_logits(self) -> np.ndarray:
        """The chunk's logits (after finish_chunk)."""
        if self.logits is None:
            raise StrataError("no Logits op ran in this chunk")
        return self.logits

    def take_argmax(self) -> int | None:
        """The chunk's greedy token (after finish_chunk; None: its logits held NaN or Inf)."""
        if self._argmax is None or self._pending_argmax:
            raise StrataError("no Logits op over rows \"argmax\" ran in this chunk")
        return self.token

    def drop_logits(self) -> None:
        """A new chunk: no logits yet, none pending."""
        self.logits, self._pending_rows, self._pending_argmax = None, None, False

    def finish_chunk(self) -> None:
        """After the chunk's stream was synchronized: the rows or the argmax enqueue_logits
        left."""
        if self._pending_rows is not None:
            self.logits = self.collect_logits()
        if self._pending_argmax and self._argmax is not None:
            self.token, self._pending_argmax = self._argmax.token(), False

    def run_logits(self, stream: Stream, op: Logits, tokens: int) -> np.ndarray:
        """float32 [rows, vocab] (a new host array) of the last row or all rows of x, waiting
        for each block of LOGIT_ROWS rows. Each row slice's logits come back as one block
        [n, rows of the slice] per head slice."""
        first = self._logit_rows(op, tokens)
        out = np.empty((tokens - first, self.spec.vocab), np.float32)
        w = 0
        for r0 in range(first, tokens, LOGIT_ROWS):
            n = min(LOGIT_ROWS, tokens - r0)
            w = self._enqueue_block(stream, tokens, first, r0, n, w)
            stream.synchronize()
            self._unpack(out, r0 - first, n)
        return out

    def enqueue_logits(self, stream: Stream, op: Logits, tokens: int) -> bool:
        """Enqueues the head over the call's rows and the copy of their logits into the
        pinned buffer without waiting, where they fit one block (a decode step's row, a
        prompt's last): `collect_logits` reads them once the stream has been synchronized, so
        the host waits once for the chunk, not again for its logits. False, and nothing
        enqueued, where the rows need several blocks (run_logits)."""
        first = self._logit_rows(op, tokens)
        if tokens - first > LOGIT_ROWS:
            return False
        greedy = op.rows == "argmax"
        self._enqueue_block(stream, tokens, first, first, tokens - first, 0, copy=not greedy)
        if not greedy:
            self._pending_rows = tokens - first
            return True
        if self._argmax is None:
            self._argmax = DeviceArgmax(self.rt, self.ptr["argmax_result"])
        self._argmax.enqueue(stream, self.ptr["head_out"], self.spec.vocab)
        self.token, self._pending_argmax = None, True
        return True

    def collect_logits(self) -> np.ndarray:
        """float32 [rows, vocab] (a new host array) of the last enqueue_logits, after its
        stream was synchronized."""
        if self._pending_rows is None:
            raise RuntimeError("collect_logits without enqueue_logits")
        n, self._pending_rows = self._pending_rows, None
        out = np.empty((n, self.spec.vocab), np.float32)
        self._unpack(out, 0, n)
        return out

    def _logit_rows(self, op: Logits, tokens: int) -> int:
        """The first row of x a Logits op reads (it reads through the last)."""
        if not self.has_head:
            raise RuntimeError("Logits on a split part before the last, which holds no head")
        first = 0 if op.rows == "all" else tokens - 1
        self._one_row = tokens - first == 1  # then head slice v0's logits sit at v0
        return first

    def _enqueue_block(self, stream: Stream, tokens: int, first: int, r0: int, n: int,
                       w: int, copy: bool = True) -> int:
        """The head over rows r0 .. r0 + n of x into head_out and (copy) their copy into the
        pinned buffer; w: the head slice decoded by an earlier block of the call (one slice
        is decoded once per call). -> the slice decoded last."""
        spec, p = self.spec, self.ptr
        H, V = spec.hidden, spec.vocab
        head_type = self.layout.head_type
        slices = head_slices(V, self.layout.head_direct)
        self.dense.rmsnorm_f16(stream, p["x"] + r0 * H * 4, p["head_norm"], p["head_in"],
                               n, H, float(spec.rms_eps))
        if tokens == 1 and self.gemv is not None:  # a decode step: the head in its type
            self.gemv.dense(stream, head_type, p["head"], p["head_in"], p["head_out"], V, H,
                            "f32")
        else:
            for v0, rows in slices:
                if r0 == first or len(slices) > 1:  # one slice: decoded once per call
                    w = self.decode.head_slice(stream, p["head"], head_type, v0, rows)
                self.dense.gemm(stream, p["head_in"], w, p["head_out"] + v0 * n * 4, n,
                                rows, H, out_f32=True, accumulate=False)
        if copy:
            self.rt.memcpy_dtoh(self._logits_host[: n * V], p["head_out"], stream)
        return w

    def _unpack(self, out: np.ndarray, at: int, n: int) -> None:
        """Rows at .. at + n of out from the pinned buffer's n rows (per head slice, one
        block [n, rows of the slice])."""
        host = self._logits_host[: n * self.spec.vocab]
        for v0, rows in head_slices(self.spec.vocab, self.layout.head_direct):
            out[at: at + n, v0: v0 + rows] = host[v0 * n: (v0 + rows) * n].reshape(n, rows)

    def sample_last(self, stream: Stream, params: SamplingParams,
                    seen: Sequence[int], step: int) -> int:
        """The token drawn on the device from the last Logits op's row, still in head_out
        (nothing writes it before the next Logits op); seen: the penalty's ids."""
        if not self._one_row:
            raise RuntimeError("sampling needs a Logits op over one row (rows=\"last\")")
        if self._sampler is None:
            self._sampler = DeviceSampler(self.rt, self.spec.vocab, self.context,
                                          (self.ptr["sample_seen"], self.ptr["sample_out"]))
        return self._sampler.sample(stream, self.ptr["head_out"], params, seen, step)

    def close(self) -> None:
        for owned in (self._sampler, self._argmax):
            if owned is not None:
                owned.close()
        self._sampler = self._argmax = None
        if self.dense.cublas is not None:
            self.dense.cublas.destroy()
        self._host = self._store = None  # type: ignore[assignment]
        self._logits_host = np.empty(0, np.float32)
