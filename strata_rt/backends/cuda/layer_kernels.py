"""The engine's own kernels of an MoE layer behind one launcher: routing (RMSNorm, router
logits, softmax top-k, counting sort by expert) with the activation encoding of the sorted rows,
SwiGLU with re-encoding, and the weighted combine into the residual.

Routing comes in three kernel sets (STRATA_ROUTING): "exact" (the default: the canonical picks
of strata_rt/backends/cuda/routing/exact.py, whatever the near-ties: a split-operand tensor-core
GEMM and a warp top-k that proves its order or re-ranks the candidates in float64), "f16"
(kernels/common/routing.cu: the router GEMM on tensor cores with fp16 operands, so a near-tie
can flip) and "fp32" (kernels/common/engine.cu: float32 logits on CUDA cores, one thread per
token). "exact" and "f16" share the deterministic two-launch counting sort; all three sort rows
the same way (tokens ascending inside an expert).

Everything here is the part of a layer that is not a format's gather or matmul; the CUDA
executor calls it with device addresses and never sees launch shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ...formats.activations import F16, Activation, ActivationKernels
from ...resources import KERNELS_ROOT
from .routing.exact import (
    ExactBound,
    ExactRoutingKernels,
    exact_bound,
    router_norms,
    split_router,
)
from .routing.kernels import (
    RoutingKernels,
    check_routing_shape,
    exact_workspace,
    router_f16,
)
from .routing.split_tiles import SPLIT_TILES

if TYPE_CHECKING:
    from ...runtime import Runtime, Stream
    from ...weights.model import MoESpec

#: opens a phase of the timing table (`mark(phase)`); a no-op when timing is off
Mark = Callable[[str], None]

ENGINE_SOURCE = KERNELS_ROOT / "common" / "engine.cu"
#: launch shapes of the engine kernels (must match engine.cu where it assumes them)
ROUTER_TILE = 64
TOPK_THREADS = 128
SCATTER_THREADS = 1024
ROW_THREADS = 256
#: chunks shorter than this spread each row of the MoE combine over several blocks
COMBINE_SPLIT_BELOW = 128

SWIGLU_THREADS = 128
#: the SwiGLU kernels stride over rows, so a capped grid covers any row count
SWIGLU_MAX_BLOCKS = 2048


def combine_splits(tokens: int, hidden: int) -> int:
    """Blocks per token row of combine_residual: one per ROW_THREADS columns for a short chunk
    (a decode step would otherwise run one block on one SM), else one."""
    return -(-hidden // ROW_THREADS) if tokens < COMBINE_SPLIT_BELOW else 1


class LayerKernels:
    """Prepared launches of engine.cu (and the activation kernels) for one model shape.

    `ptr` maps region names of the device arena to addresses: x, xn, norm, router, logits,
    topk_ids, topk_w, sorted_token, row_of, act_hidden, act_ffn, gate_up_out, down_out,
    nonfinite (the RMSNorm's flag word: the earliest layer << 32 | row whose sum of squares
    is not finite) and route_ws for the exact and f16 routings."""

    def __init__(self, rt: Runtime, spec: MoESpec, activation: Activation, ptr: dict[str, int],
                 routing: str = "exact", first: int = 0):
        self.spec, self.activation, self.ptr, self.routing = spec, activation, ptr, routing
        #: the first layer whose router and norm the regions hold (a layer split's part
        #: holds its own layers only; the flag word still names the model's layer)
        self.first = first
        self._routing: RoutingKernels | None = None
        self._exact: ExactRoutingKernels | None = None
        #: per layer: sigma of the split router and the bound on its logits' error
        self._sigma: list[float] = []
        self._logit_bounds: list[ExactBound] = []
        if routing != "fp32":
            check_routing_shape(spec.hidden, spec.n_experts, spec.top_k)
            self._routing = RoutingKernels(rt)
        if routing == "exact":
            self._exact = ExactRoutingKernels(rt)
        mod = rt.module(ENGINE_SOURCE)
        self._norm = mod.kernel("rmsnorm_rows", "PPPifPi")
        self._router = mod.kernel("router_logits", "PPPiii")
        self._topk = mod.kernel("topk_softmax", "PiiiPP")
        self._bounds = mod.kernel("expert_bounds", "PiiP")
        self._scatter = mod.kernel("expert_scatter", "PiiPPP")
        self._swiglu = mod.kernel(activation.swiglu_kernel, "PPiiiP")
        self._combine = mod.kernel("combine_residual", "PPPiiP", overlap=True)
        self._acts = ActivationKernels(rt)

    def router_weights(self, router: np.ndarray) -> np.ndarray:
        """The host array to upload into the `router` region [L, E, H] in the routing's device
        form; for "exact" also the per-layer scale and bound terms the launches take."""
        if self.routing == "exact":
            norms = [router_norms(w) for w in router]
            self._sigma = [n.sigma for n in norms]
            self._logit_bounds = [exact_bound(n, self.spec.hidden) for n in norms]
            return split_router(router)
        return router_f16(router) if self.routing == "f16" else router

    def route(self, stream: Stream, layer: int, tokens: int, bounds: int, mark: Mark) -> None:
        """RMSNorm, router logits, top-k, counting sort and the hidden activations of one
        layer; the row bounds land at `bounds` (device int32 [n_experts + 1]). `mark(phase)`
        opens each phase of the timing table."""
        spec, p, T = self.spec, self.ptr, tokens
        at = layer - self.first  # the layer's place in the router and norm regions
        H, E, K = spec.hidden, spec.n_experts, spec.top_k
        if self._exact is not None and T == 1 and self.activation is F16:
            # a decode step whose experts take fp16 activations: the norm and the activations
            # ride in the one-token routing's launches (the same bytes, two launches fewer)
            mark("router gemm")
            self._exact.one_normed(
                stream, x=p["x"], norm_w=p["norm"] + at * H * 4, eps=float(spec.rms_eps),
                router32=self._exact_router(at)[1], hidden=H, n_experts=E, top_k=K,
                canon=p["route_ws"], xn=p["xn"], act=p["act_hidden"], bad=p["nonfinite"],
                layer=layer, ids=p["topk_ids"], weights=p["topk_w"], bounds=bounds,
                sorted_token=p["sorted_token"], row_of=p["row_of"])
            return
        tile = (self._exact.tile(T, H, presplit=self.activation is F16)
                if self._exact is not None and T > 1 else None)
        # a presplit tile: the norm writes x's fp16 parts (and each token's scale) into the xn
        # region instead of float32 xn; the re-rank normalises its rows from x, and the fp16
        # activations are copies of the hi rows (convert_f16_rows' bytes of xn)
        presplit = tile is not None and SPLIT_TILES[tile].presplit
        norm_w = p["norm"] + at * H * 4
        mark("rmsnorm")
        if presplit:
            assert self._exact is not None
            self._exact.norm_split(stream, x=p["x"], norm_w=norm_w, eps=float(spec.rms_eps),
                                   parts=p["xn"], ws=exact_workspace(p["route_ws"], T, E),
                                   tokens=T, hidden=H, bad=p["nonfinite"], layer=layer)
        else:
            self._norm.launch(grid=(T, 1, 1), block=(ROW_THREADS, 1, 1), stream=stream,
                              args=(p["x"], norm_w, p["xn"], H, float(spec.rms_eps),
                                    p["nonfinite"], layer))
        if self._routing is None:
            self._route_fp32(stream, at, T, bounds, mark)
        elif self._exact is not None and T == 1:  # a decode step: two launches, sorted too
            mark("router gemm")
            self._exact.one(stream, xn=p["xn"], router32=self._exact_router(at)[1], hidden=H,
                            n_experts=E, top_k=K, canon=p["route_ws"], ids=p["topk_ids"],
                            weights=p["topk_w"], bounds=bounds,
                            sorted_token=p["sorted_token"], row_of=p["row_of"])
        else:
            if self._exact is not None:
                assert tile is not None
                self._route_exact(stream, at, T, tile, mark, norm_w if presplit else 0)
            else:
                mark("router gemm")
                self._routing.logits(stream, p["xn"], p["router"] + at * E * H * 2,
                                     p["logits"], T, H, E)
                mark("softmax top-k")
                self._routing.topk(stream, p["logits"], T, E, K, p["topk_ids"], p["topk_w"],
                                   p["route_ws"])
            mark("sort")
            self._routing.sort(stream, p["topk_ids"], T, E, K, p["route_ws"], bounds,
                               p["sorted_token"], p["row_of"])
        mark("quantize acts")
        if presplit:
            self._acts.gather_f16(stream, p["xn"], H, p["sorted_token"], p["act_hidden"],
                                  T * K, H)
        else:
            self._acts.launch(self.activation, stream, p["xn"], H, p["sorted_token"],
                              p["act_hidden"], T * K, H)

    def _exact_router(self, layer: int) -> tuple[int, int]:
        """The device addresses of a layer's split router (split_router's layout: the fp16 hi
        and lo parts, then the float32 rows) and of its float32 rows."""
        E, H = self.spec.n_experts, self.spec.hidden
        split = self.ptr["router"] + layer * E * H * 8
        return split, split + E * H * 4

    def _route_exact(self, stream: Stream, layer: int, T: int, tile: str, mark: Mark,
                     norm_w: int) -> None:
        """The split GEMM and the top-k with its re-ranking. norm_w (non-zero for a presplit
        tile): the xn region holds x's parts, and the re-rank normalises its rows from x."""
        assert self._exact is not None and self._logit_bounds, "router_weights() ran at open"
        spec, p = self.spec, self.ptr
        H, E, K = spec.hidden, spec.n_experts, spec.top_k
        router, router32 = self._exact_router(layer)
        ws = exact_workspace(p["route_ws"], T, E)
        mark("router gemm")
        self._exact.logits(stream, p["xn"], router, p["logits"], ws, T, H, E,
                           self._sigma[layer], tile)
        mark("softmax top-k")
        self._exact.topk(stream, logits=p["logits"], router32=router32, ws=ws, tokens=T,
                         hidden=H, n_experts=E, top_k=K, bound=self._logit_bounds[layer],
                         ids=p["topk_ids"], weights=p["topk_w"], masks=p["route_ws"],
                         xn=0 if norm_w else p["xn"], x=p["x"] if norm_w else 0, norm_w=norm_w)

    def _route_fp32(self, stream: Stream, layer: int, T: int, bounds: int, mark: Mark) -> None:
        spec, p = self.spec, self.ptr
        H, E, K = spec.hidden, spec.n_experts, spec.top_k
        mark("router gemm")
        self._router.launch(grid=(-(-T // ROUTER_TILE), -(-E // ROUTER_TILE), 1),
                            block=(256, 1, 1), stream=stream,
                            args=(p["xn"], p["router"] + layer * E * H * 4, p["logits"], T,
                                  H, E))
        mark("softmax top-k")
        self._topk.launch(grid=(-(-T // TOPK_THREADS), 1, 1), block=(TOPK_THREADS, 1, 1),
                          stream=stream, args=(p["logits"], T, E, K, p["topk_ids"], p["topk_w"]))
        mark("sort")
        self._bounds.launch(grid=(1, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=stream,
                            args=(p["topk_ids"], T * K, E, bounds), shared=E * 4)
        self._scatter.launch(grid=(E, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=stream,
                             args=(p["topk_ids"], T * K, K, bounds, p["sorted_token"],
                                   p["row_of"]))

    def swiglu(self, stream: Stream, bounds: int, lo: int, hi: int, group_rows: int) -> None:
        """silu(gate) * up of experts lo..hi-1, encoded as the down matmul's activations."""
        p = self.ptr
        self._swiglu.launch(grid=(min(group_rows, SWIGLU_MAX_BLOCKS), 1, 1),
                            block=(SWIGLU_THREADS, 1, 1), stream=stream,
                            args=(p["gate_up_out"], bounds, lo, hi, self.spec.ffn, p["act_ffn"]))

    def combine(self, stream: Stream, tokens: int) -> None:
        """x += sum over k of w_k * down output of (token, k), in top-k order."""
        spec, p = self.spec, self.ptr
        self._combine.launch(grid=(tokens, combine_splits(tokens, spec.hidden), 1),
                             block=(ROW_THREADS, 1, 1), stream=stream,
                             args=(p["down_out"], p["row_of"], p["topk_w"], spec.top_k,
                                   spec.hidden, p["x"]))
