"""Attention of the whole Qwen3-MoE model on the GPU (kernels/model/attention.cu): launchers,
the shape check, and float64 numpy twins on the same fp16 inputs.

Why its own module: attention is the part of a layer whose cost grows with the prompt (at 8K
tokens on the Qwen3-30B shape it costs about as many FLOPs as the MoE), and its results must
not depend on how a prompt is chunked. Two launches per layer and chunk:

1. `qk_norm_rope`: the q/k/v projection rows (fp16 [T, q_dim + 2*kv_dim]) -> per-head RMSNorm
   of q and k over head_dim (float32), RoPE rotating the halves with float32 tables at the
   absolute positions, q fp16 [T, n_heads, head_dim], k and v into the layer's cache rows
   start.. (K and V [context, n_kv_heads, head_dim] each, separate base pointers);
2. `attend`: causal grouped-query flash attention of the chunk's queries over cache rows
   0..start+t, scale head_dim^-0.5 -> fp16 [T, n_heads * head_dim]. Two kernels serve it
   (PREFILL_ATTENTIONS): attention.cu's mma.sync tiles (sm_80 on, head dims 64 and 128; the
   default) and attention_sm90.cu's wgmma tiles (sm_90 devices, head dim 128), the same
   contract, grid and block rows; "auto" takes wgmma where it runs. wgmma is opt-in until its
   GPU tests (tests/test_attention_gpu.py) have run. Their bytes differ from each other (the
   tensor cores' order of adds inside a step), each is chunk invariant on its own.

Both kernels give the same bytes on every run, and `attend` gives a query the same bytes
whatever chunk it arrives in (see the header of attention.cu for why).

Numerics against the float64 twins on the same fp16 inputs: the outputs are rounded to fp16
(relative 2^-11), attention also rounds its probabilities to fp16 before p.v (and sums those
same rounded values for the normaliser); the tests assert NMSE <= 1e-5 (measured errors are
far below that, around 1e-7).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ....config.settings import env
from ....errors import ConfigError
from ....models.qwen3.reference import apply_rope, rope_tables
from ....resources import KERNELS_ROOT
from ....runtime.compile import ARCH_SPECIFIC, ARCH_SPECIFIC_RUNS_ON
from ....weights.model import rms_norm
from .shapes import check_aligned, check_attention_shape, scale_log2

if TYPE_CHECKING:
    from ....models.qwen3.spec import Qwen3Spec
    from ....runtime import Runtime, Stream

ATTENTION_SOURCE = KERNELS_ROOT / "model" / "attention.cu"
#: attend on wgmma (sm_90 devices, compiled for sm_90a; head dim 128)
ATTENTION_SM90_SOURCE = KERNELS_ROOT / "model" / "attention_sm90.cu"
#: the prefill attention kernels, the default first ("auto": wgmma where it runs, else mma)
PREFILL_ATTENTIONS = env.choices("STRATA_PREFILL_ATTENTION")
#: head dims attention_sm90.cu serves
WGMMA_HEAD_DIMS = (128,)
#: threads of attend_sm90_hd128 (two warpgroups) and its tile of cache rows (KT)
WGMMA_THREADS, WGMMA_KV_TILE = 256, 128
#: K/V stages of the wgmma attend: 2 (each tile's products in turn) or 3 (pipelined: a tile's
#: q.k beside the previous tile's p.v), the kernel's name by stages
WGMMA_STAGES = 3
WGMMA_NAMES = {2: "attend_sm90_hd{hd}", 3: "attend_sm90p_hd{hd}"}
#: query rows (positions x heads of one group) per attention block; attention.cu's AT_ROWS
BLOCK_ROWS = 128
#: cache rows per K/V tile (AT_KV); tiles sit at absolute positions j * KV_TILE
KV_TILE = 64
ATTEND_THREADS = 128
#: warps (one (token, head) row each) per qk_norm_rope block; attention.cu's NR_WARPS
NORM_ROPE_WARPS = 8


def attend_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of attend_hd{head_dim}: the block's queries and two stages of
    one K tile and one V tile."""
    return BLOCK_ROWS * head_dim * 2 + 2 * 2 * KV_TILE * head_dim * 2


def wgmma_shared_bytes(head_dim: int, stages: int = WGMMA_STAGES) -> int:
    """Dynamic shared memory of the wgmma attend: the block's queries, `stages` stages of one K
    tile and one V tile of WGMMA_KV_TILE rows, and 1024 bytes for the swizzle atoms'
    alignment."""
    return BLOCK_ROWS * head_dim * 2 + stages * 2 * WGMMA_KV_TILE * head_dim * 2 + 1024


def wgmma_runs(arch: str, head_dim: int) -> bool:
    """Whether attention_sm90.cu serves this device (Runtime.arch) and head dim."""
    return arch == ARCH_SPECIFIC_RUNS_ON and head_dim in WGMMA_HEAD_DIMS


def pick_attention(kernel: str, arch: str, head_dim: int) -> str:
    """The kernel a PREFILL_ATTENTIONS setting gives on this device: "auto" takes wgmma where
    it runs; "wgmma" where it cannot run is a ConfigError naming why."""
    if kernel not in PREFILL_ATTENTIONS:
        raise ConfigError(f"prefill attention {kernel!r}: allowed "
                          f"{', '.join(PREFILL_ATTENTIONS)}", source="GPU attention")
    runs = wgmma_runs(arch, head_dim)
    if kernel == "wgmma" and not runs:
        raise ConfigError(f"prefill attention wgmma runs on {ARCH_SPECIFIC_RUNS_ON} devices "
                          f"with head dim {', '.join(map(str, WGMMA_HEAD_DIMS))}; this is "
                          f"{arch} with head dim {head_dim} (use mma or auto)",
                          source="GPU attention")
    return "wgmma" if kernel == "wgmma" or (kernel == "auto" and runs) else "mma"


def positions_per_block(n_heads: int, n_kv_heads: int) -> int:
    """Query positions one attention block serves (all `group` heads of each)."""
    return BLOCK_ROWS // (n_heads // n_kv_heads)


# ----------------------------------------------------------------------------- numpy twins
def rope_cos_sin(spec: Qwen3Spec, context: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The float32 tables the kernels read: cos and sin [context, head_dim/2] of positions
    0..context-1 (strata_rt.models.qwen3.reference.rope_tables)."""
    n = spec.context if context is None else int(context)
    cos, sin = rope_tables(spec, np.arange(n), np.float32)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def qk_norm_rope_reference(qkv: np.ndarray, start: int, q_norm: np.ndarray,
                           k_norm: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float,
                           n_heads: int, n_kv_heads: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 q [T, n_heads, hd], k and v [T, n_kv_heads, hd] from the fp16 projection rows:
    what qk_norm_rope computes before rounding to fp16 (cos/sin: the whole float32 tables)."""
    hd = len(q_norm)
    x = np.asarray(qkv).astype(np.float64)
    T = len(x)
    q = x[:, : n_heads * hd].reshape(T, n_heads, hd)
    k = x[:, n_heads * hd: (n_heads + n_kv_heads) * hd].reshape(T, n_kv_heads, hd)
    v = x[:, (n_heads + n_kv_heads) * hd:].reshape(T, n_kv_heads, hd)
    c = np.asarray(cos[start: start + T], np.float64)
    s = np.asarray(sin[start: start + T], np.float64)
    q = apply_rope(rms_norm(q, np.asarray(q_norm, np.float64), eps), c, s)
    k = apply_rope(rms_norm(k, np.asarray(k_norm, np.float64), eps), c, s)
    return q, k, v.copy()


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                        start: int) -> np.ndarray:
    """float64 causal GQA attention: queries q [T, n_heads, hd] at positions start.. over
    keys/values [>= start + T, n_kv_heads, hd] (cache rows; rows past start+T-1 are ignored),
    query head j reading KV head j // group, scale hd^-0.5 -> [T, n_heads * hd]."""
    qf = np.asarray(q, np.float64)
    T, n_heads, hd = qf.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    kf = np.asarray(keys[: start + T], np.float64)
    vf = np.asarray(values[: start + T], np.float64)
    qg = (qf * hd ** -0.5).reshape(T, n_kv, group, hd).transpose(1, 0, 2, 3)  # [kv, t, g, d]
    kt = kf.transpose(1, 2, 0)  # [kv, d, s]
    vt = vf.transpose(1, 0, 2)  # [kv, s, d]
    out = np.empty((n_kv, T, group, hd))
    pos = np.arange(start + T)
    step = 64
    for t0 in range(0, T, step):  # a block of queries at a time, each masked to its prefix
        t1 = min(T, t0 + step)
        n = start + t1
        sc = (qg[:, t0:t1].reshape(n_kv, -1, hd) @ kt[:, :, :n]).reshape(n_kv, t1 - t0, group, n)
        mask = pos[None, :n] > (start + np.arange(t0, t1))[:, None]  # key after query
        sc = np.where(mask[None, :, None, :], -np.inf, sc)
        p = np.exp(sc - sc.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[:, t0:t1] = (p.reshape(n_kv, -1, n) @ vt[:, :n]).reshape(n_kv, t1 - t0, group, hd)
    out = out.transpose(1, 0, 2, 3)
    return out.reshape(T, n_heads * hd)


# ----------------------------------------------------------------------------- launchers
class AttentionKernels:
    """Prepared launches of attention.cu for one head layout. Pointers are device addresses
    (ints); nothing here synchronizes, so a layer's launches can be captured in a graph.
    `context` (optional) is the KV cache's length in positions, checked against every chunk.
    `kernel`: a PREFILL_ATTENTIONS setting for `attend` (`self.kernel` says which runs)."""

    def __init__(self, rt: Runtime, n_heads: int, n_kv_heads: int, head_dim: int,
                 context: int | None = None, kernel: str = PREFILL_ATTENTIONS[0]):
        check_attention_shape(n_heads, n_kv_heads, head_dim, context=context)
        #: the kernel `attend` launches: "wgmma" or "mma"
        self.kernel = pick_attention(kernel, rt.arch, head_dim)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.context = context
        self.positions_per_block = positions_per_block(n_heads, n_kv_heads)
        self.scale_log2 = scale_log2(head_dim)
        mod = rt.module(ATTENTION_SOURCE)
        self._norm_rope = mod.kernel(f"qk_norm_rope_hd{head_dim}", "PiiPPPPfPPPiiP",
                                      overlap=True)
        if self.kernel == "wgmma":
            self.shared, self._threads = wgmma_shared_bytes(head_dim), WGMMA_THREADS
            self._attend = rt.module(ATTENTION_SM90_SOURCE, arch=ARCH_SPECIFIC).kernel(
                WGMMA_NAMES[WGMMA_STAGES].format(hd=head_dim), "PPPPiiiifP")
        else:
            self.shared, self._threads = attend_shared_bytes(head_dim), ATTEND_THREADS
            self._attend = mod.kernel(f"attend_hd{head_dim}", "PPPPiiiifP")

    def qk_norm_rope(self, stream: Stream, qkv: int, T: int, start: int, q_norm: int,
                     k_norm: int, cos: int, sin: int, eps: float, q_out: int, k_cache: int,
                     v_cache: int, start_dev: int = 0) -> None:
        """qkv fp16 [T, q_dim + 2*kv_dim] -> q_out fp16 [T, n_heads, hd], and cache rows
        start..start+T-1 of k_cache and v_cache (fp16 [context, n_kv_heads, hd] each).
        q_norm, k_norm: float32 [hd]; cos, sin: float32 [context, hd/2]. start_dev: the
        address of a device int32 holding the start, read by the kernel instead of `start`
        (a captured decode step; the caller checks that position against the cache), or 0."""
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim, T, start,
                              self.context)
        rows = T * (self.n_heads + 2 * self.n_kv_heads)
        self._norm_rope.launch(grid=(-(-rows // NORM_ROPE_WARPS), 1, 1),
                               block=(32 * NORM_ROPE_WARPS, 1, 1), stream=stream,
                               args=(qkv, T, start, q_norm, k_norm, cos, sin, float(eps), q_out,
                                     k_cache, v_cache, self.n_heads, self.n_kv_heads,
                                     start_dev))

    def attend_grid(self, T: int) -> tuple[int, int, int]:
        """(query blocks, KV heads, 1): block x serves positions P*x.. of one KV head's group."""
        return (-(-T // self.positions_per_block), self.n_kv_heads, 1)

    def attend(self, stream: Stream, q: int, k_cache: int, v_cache: int, start: int, T: int,
               out: int, start_dev: int = 0) -> None:
        """out fp16 [T, n_heads * hd] = causal attention of q fp16 [T, n_heads, hd] (positions
        start..) over cache rows 0..start+T-1 (which must hold this chunk's keys/values).
        q, k_cache and v_cache must be 16-byte aligned. start_dev as for qk_norm_rope."""
        check_attention_shape(self.n_heads, self.n_kv_heads, self.head_dim, T, start,
                              self.context)
        check_aligned({"q": q, "k_cache": k_cache, "v_cache": v_cache})
        if out % 4:
            raise ConfigError(f"out=0x{out:x} is not 4-byte aligned", source="GPU attention")
        self._attend.launch(grid=self.attend_grid(T), block=(self._threads, 1, 1),
                            stream=stream, shared=self.shared,
                            args=(q, k_cache, v_cache, out, T, start, self.n_heads,
                                  self.n_kv_heads, self.scale_log2, start_dev))
