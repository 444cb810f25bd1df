"""The engine's own kernels of an MoE layer (kernels/common/engine.cu) behind one launcher:
routing (RMSNorm, router logits, softmax top-k, counting sort by expert) with the activation
encoding of the sorted rows, SwiGLU with re-encoding, and the weighted combine into the residual.

Everything here is the part of a layer that is not a format's gather or matmul; the CUDA
executor calls it with device addresses and never sees launch shapes.
"""

from __future__ import annotations

from typing import Any

from .activations import ActivationKernels
from .resources import KERNELS_ROOT

ENGINE_SOURCE = KERNELS_ROOT / "common" / "engine.cu"
#: launch shapes of the engine kernels (must match engine.cu where it assumes them)
ROUTER_TILE = 64
TOPK_THREADS = 128
SCATTER_THREADS = 1024
ROW_THREADS = 256
SWIGLU_THREADS = 128
#: the SwiGLU kernels stride over rows, so a capped grid covers any row count
SWIGLU_MAX_BLOCKS = 2048


class LayerKernels:
    """Prepared launches of engine.cu (and the activation kernels) for one model shape.

    `ptr` maps region names of the device arena to addresses: x, xn, norm, router, logits,
    topk_ids, topk_w, sorted_token, row_of, act_hidden, act_ffn, gate_up_out, down_out."""

    def __init__(self, rt: Any, spec: Any, activation: str, ptr: dict[str, int]):
        self.spec, self.activation, self.ptr = spec, activation, ptr
        mod = rt.module(ENGINE_SOURCE)
        self._norm = mod.kernel("rmsnorm_rows", "PPPif")
        self._router = mod.kernel("router_logits", "PPPiii")
        self._topk = mod.kernel("topk_softmax", "PiiiPP")
        self._bounds = mod.kernel("expert_bounds", "PiiP")
        self._scatter = mod.kernel("expert_scatter", "PiiPPP")
        self._swiglu = mod.kernel(
            "swiglu_q8_1" if activation == "q8_1" else "swiglu_f16", "PPiiiP")
        self._combine = mod.kernel("combine_residual", "PPPiiP")
        self._acts = ActivationKernels(rt)

    def route(self, stream: Any, layer: int, tokens: int, bounds: int, mark: Any) -> None:
        """RMSNorm, router logits, top-k, counting sort and the hidden activations of one
        layer; the row bounds land at `bounds` (device int32 [n_experts + 1])."""
        spec, p, T = self.spec, self.ptr, tokens
        H, E, K = spec.hidden, spec.n_experts, spec.top_k
        mark("route")
        self._norm.launch(grid=(T, 1, 1), block=(ROW_THREADS, 1, 1), stream=stream,
                          args=(p["x"], p["norm"] + layer * H * 4, p["xn"], H,
                                float(spec.rms_eps)))
        self._router.launch(grid=(-(-T // ROUTER_TILE), -(-E // ROUTER_TILE), 1),
                            block=(256, 1, 1), stream=stream,
                            args=(p["xn"], p["router"] + layer * E * H * 4, p["logits"], T,
                                  H, E))
        self._topk.launch(grid=(-(-T // TOPK_THREADS), 1, 1), block=(TOPK_THREADS, 1, 1),
                          stream=stream, args=(p["logits"], T, E, K, p["topk_ids"], p["topk_w"]))
        self._bounds.launch(grid=(1, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=stream,
                            args=(p["topk_ids"], T * K, E, bounds), shared=E * 4)
        self._scatter.launch(grid=(E, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=stream,
                             args=(p["topk_ids"], T * K, K, bounds, p["sorted_token"],
                                   p["row_of"]))
        self._acts.launch(self.activation, stream, p["xn"], H, p["sorted_token"],
                          p["act_hidden"], T * K, H)

    def swiglu(self, stream: Any, bounds: int, lo: int, hi: int, group_rows: int) -> None:
        """silu(gate) * up of experts lo..hi-1, encoded as the down matmul's activations."""
        p = self.ptr
        self._swiglu.launch(grid=(min(group_rows, SWIGLU_MAX_BLOCKS), 1, 1),
                            block=(SWIGLU_THREADS, 1, 1), stream=stream,
                            args=(p["gate_up_out"], bounds, lo, hi, self.spec.ffn, p["act_ffn"]))

    def combine(self, stream: Any, tokens: int) -> None:
        """x += sum over k of w_k * down output of (token, k), in top-k order."""
        spec, p = self.spec, self.ptr
        self._combine.launch(grid=(tokens, 1, 1), block=(ROW_THREADS, 1, 1), stream=stream,
                             args=(p["down_out"], p["row_of"], p["topk_w"], spec.top_k,
                                   spec.hidden, p["x"]))
