"""Exact routing on the GPU (kernels/common/routing_exact.cu) and its numpy twins.

Why: a flipped expert is a different model. Tensor-core logits from fp16 operands moved near-tied
top-k choices (an expert other than the model's, with an output argmax that changed), while the
float32 CUDA-core kernels that route correctly cost 6.5 times as much. Here the routing is a
definition, not an accident of summation order:

- The canonical logit of token t and expert e (`canonical_logits`): in float64, lane l of 32 sums
  x[c] * w[c] for c = l, l + 32, ... in ascending c (products of float32 values are exact in
  float64), then the 32 partial sums meet in an xor tree. Its error against the real dot product
  is ~H * 2^-53 of sum |x w|: far below anything float32 routing can resolve.
- The routed experts are the top k by canonical logit, ties to the lower id, in that order; the
  weights are float32 softmax probabilities over all experts, renormalised over the k picks.

The GPU gets there in two launches. A tensor-core GEMM on split operands (`split_router`: fp16
hi and scaled-residual parts of x and of w / sigma, three mma products) gives logits within a
bound B(t) = c1 |x_t|_2 + c0 of the canonical ones (`ExactBound` derives c1 and c0, assuming
nothing better of the tensor cores' accumulation than one unit in the last place of float32 per
summand); then one warp per token ranks them. Where consecutive picks 0..k are more than 2 B(t)
apart the order is proven; elsewhere a re-rank block computes the canonical logits of the
candidates whose place the bound leaves open (those with another candidate within 2 B(t):
typically a near-tied pair) and ranks the candidates by them. The GEMM runs on wgmma on sm_90
(routing_split_sm90.cu) and on mma.sync elsewhere, with the same bytes. The reference backend
computes the canonical logits of every token and must pick the same experts (tested on the GPU
against random and adversarial near-ties).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ....resources import KERNELS_ROOT
from ....runtime.compile import ARCH_SPECIFIC as SM90_ARCH
from ....runtime.compile import ARCH_SPECIFIC_RUNS_ON as SM90_RUNS_ON
from .kernels import (
    HIDDEN_MULTIPLE,
    ExactWorkspace,
    RoutingShapeError,
    check_routing_shape,
    n_tiles,
)
from .split_tiles import (
    EXACT_SOURCE,
    SM90_SOURCE,
    SPLIT_TILES,
    WgmmaSplitTile,
    runs_on,
    split_tile,
    tile_rule,
)

if TYPE_CHECKING:
    from ....runtime import Runtime, Stream

#: the re-ranking of the tokens the bound leaves open
RERANK_SOURCE = KERNELS_ROOT / "common" / "routing_rerank.cu"
#: the RMSNorm that writes x's split parts for the presplit tiles
NORM_SPLIT_SOURCE = KERNELS_ROOT / "common" / "routing_norm_split.cu"
#: threads of a split RMSNorm block (rmsnorm_rows' block: one per token)
NORM_SPLIT_THREADS = 256
#: lanes of the canonical sum (one warp): the hidden size must be a multiple of it
CANONICAL_LANES = 32
F16_LIMIT = 65504.0
LO_SCALE = 2.0 ** 11
#: columns whose xh wh products the split GEMM sums in fresh registers (routing_exact.cu)
CHUNK_K = 64
#: tokens' norms below this, above F16_LIMIT (a value of x beyond fp16's range) or not finite
#: are not trusted: every expert is re-ranked
NORM_FLOOR = 1e-15
_TOPK_NPL = (1, 2, 4, 8, 16)


# ----------------------------------------------------------------------------- the definition
def canonical_logits(xn: np.ndarray, router: np.ndarray, block: int = 256) -> np.ndarray:
    """float64 [T, E]: the canonical logits of float32 xn [T, H] and router [E, H] (the
    kernels' bits: 32 sequential float64 lane sums, then the xor tree)."""
    x = np.asarray(xn, dtype=np.float32)
    w = np.asarray(router, dtype=np.float32)
    T, H = x.shape
    pad = -H % CANONICAL_LANES  # a lane past the end adds nothing: zero products
    if pad:
        x = np.pad(x, ((0, 0), (0, pad)))
        w = np.pad(w, ((0, 0), (0, pad)))
    steps = (H + pad) // CANONICAL_LANES
    w3 = w.astype(np.float64).reshape(w.shape[0], steps, CANONICAL_LANES)
    out = np.empty((T, w.shape[0]), np.float64)
    for t0 in range(0, T, block):
        x3 = x[t0:t0 + block].astype(np.float64).reshape(-1, steps, CANONICAL_LANES)
        acc = np.zeros((x3.shape[0], w.shape[0], CANONICAL_LANES), np.float64)
        for j in range(steps):  # strictly sequential, as each lane adds
            acc += x3[:, None, j, :] * w3[None, :, j, :]
        s = acc
        while s.shape[-1] > 1:
            half = s.shape[-1] // 2
            s = s[..., :half] + s[..., half:]
        out[t0:t0 + block] = s[..., 0]
    return out


def rank(logits: np.ndarray, top_k: int) -> np.ndarray:
    """int32 [T, k]: the top k by value, largest first, ties to the lower id (-0 == +0)."""
    lg = np.asarray(logits) + 0.0
    return np.argsort(-lg, axis=1, kind="stable")[:, :top_k].astype(np.int32)


def softmax_weights(logits32: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float32 [T, k]: softmax over all experts of float32 logits, taken at ids, renormalised."""
    lg = np.asarray(logits32, dtype=np.float32)
    e = np.exp(lg - lg.max(axis=1, keepdims=True))
    p = np.take_along_axis(e, ids, axis=1) / e.sum(axis=1, keepdims=True, dtype=np.float32)
    return (p / p.sum(axis=1, keepdims=True, dtype=np.float32)).astype(np.float32)


def route_exact(xn: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The routing's definition: (ids int32 [T, k] by canonical logit, weights float32 [T, k]).

    Computed the way the GPU does it, on the CPU: a float64 matmul (any summation order: within
    gamma_H = H 2^-53 of sum |x w| of the real dot product, as the canonical sum is) ranks every
    token; a token whose consecutive picks 0..k lie within twice that bound of each other gets
    its canonical logits, which decide."""
    x = np.asarray(xn, dtype=np.float32)
    w = np.asarray(router, dtype=np.float32)
    T, H = x.shape
    E = w.shape[0]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    logits = x64 @ w64.T
    ids = rank(logits, top_k)
    picks = min(top_k + 1, E)
    vals = np.take_along_axis(logits, rank(logits, picks), axis=1)
    gamma = 2.02 * (H + CANONICAL_LANES) * 2.0 ** -52  # the matmul's and the canonical sum's
    bound = gamma * np.sqrt((x64 * x64).sum(axis=1)) * float(
        np.sqrt((w64 * w64).sum(axis=1)).max(initial=0.0))
    with np.errstate(invalid="ignore"):
        close = ~(vals[:, :-1] - vals[:, 1:] > 2 * bound[:, None]).all(axis=1)
    unsure = np.flatnonzero(close | ~np.isfinite(bound))
    if unsure.size:
        exact = canonical_logits(x[unsure], w)
        ids[unsure] = rank(exact, top_k)
        logits[unsure] = exact
    return ids, softmax_weights(logits.astype(np.float32), ids)


# ----------------------------------------------------------------------------- the GPU's operands
def _f16_parts(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = v.astype(np.float16)
    lo = ((v - hi.astype(np.float32)) * np.float32(LO_SCALE)).astype(np.float16)
    return hi, lo


def x_parts(xn: np.ndarray) -> np.ndarray:
    """float16 [2 T, H]: what the split RMSNorm writes for float32 xn [T, H] and the presplit
    tiles read, the fp16 hi parts, then the residuals scaled by 2^11 (the numpy twin of
    route_split.cuh's split_pair; a value beyond fp16's range gives inf parts, as on the device:
    its token is re-ranked whole)."""
    with np.errstate(over="ignore", invalid="ignore"):
        hi, lo = _f16_parts(np.asarray(xn, dtype=np.float32))
    return np.concatenate([hi, lo])


def router_scale(router: np.ndarray) -> float:
    """sigma: the power of two that brings the layer's largest |w| into (0.5, 1]."""
    m = float(np.max(np.abs(router))) if router.size else 0.0
    return 1.0 if m == 0.0 or not math.isfinite(m) else 2.0 ** math.ceil(math.log2(m))


def split_router(router: np.ndarray) -> np.ndarray:
    """The device bytes of each layer's router: wh [E, H] fp16 and wl [E, H] fp16 (w / sigma
    split), then w [E, H] float32 for the canonical re-check; [L, E, H] -> uint8 [L, 8 E H]."""
    r = np.asarray(router, dtype=np.float32)
    layers = r.reshape(-1, *r.shape[-2:])
    out = []
    for w in layers:
        hi, lo = _f16_parts((w / np.float32(router_scale(w))).astype(np.float32))
        out.append(np.concatenate([hi.view(np.uint8).ravel(), lo.view(np.uint8).ravel(),
                                   w.view(np.uint8).ravel()]))
    return np.stack(out)


def router_bytes(n_experts: int, hidden: int) -> int:
    """Device bytes of one layer's split router."""
    return 8 * n_experts * hidden


class RouterNorms(NamedTuple):
    """What the bound needs of one layer's router [E, H]: sigma, and over the experts the
    largest 2-norm and 1-norm of w / sigma."""

    sigma: float
    m2: float
    m1: float


def router_norms(router: np.ndarray) -> RouterNorms:
    w32 = np.asarray(router, dtype=np.float32)
    sigma = router_scale(w32)
    wp = w32.astype(np.float64) / sigma
    if not wp.size:
        return RouterNorms(sigma, 0.0, 0.0)
    return RouterNorms(sigma, float(np.sqrt((wp * wp).sum(axis=1)).max()),
                       float(np.abs(wp).sum(axis=1).max()))


class ExactBound(NamedTuple):
    """c1, c0 of one layer's bound B(t) = c1 |x_t|_2 + c0 on |split GEMM logit - canonical|."""

    c1: float
    c0: float


def exact_bound(norms: RouterNorms, hidden: int) -> ExactBound:
    """The bound for one layer (its router's norms); every tile sums the same chain. Terms, relative to
    S = sum_c |x_c||w'_c| <= |x|_2 max_e |w'_e|_2 (w' = w / sigma):
    - the split: x and w' each within 2^-22 relative (+2^-36 absolute, fp16 subnormals) of
      their two parts, and the dropped product of residuals: 2^-20 S + 2^-35 (|x|_1 + |w'|_1);
    - the tensor cores: an mma of 16 exact products and an accumulator, assumed to lose up to
      17 units of 2^-23 of its largest term, over the 4 mma of one chunk of 64 columns:
      17 * 4 * 2^-23 S;
    - the running float32 sum of H/64 chunks and the final combine: (H/64 + 1) 2^-24 S;
    - the residual products' own sum (H/8 mma on terms up to 2 S), scaled by 2^-11: H 2^-31 S;
    - |x|_2 computed in float32 (H 2^-23 relative) and the canonical sum's float64 error.
    A 1% margin on top."""
    H = hidden
    kappa = (2.0 ** -20 + 17 * (CHUNK_K // 16) * 2.0 ** -23 + (H // CHUNK_K + 1) * 2.0 ** -24
             + H * 2.0 ** -31 + H * 2.0 ** -52)
    norm_slack = 1.0 + H * 2.0 ** -23
    c1 = 1.01 * norms.sigma * (kappa * norms.m2 + 2.0 ** -35 * math.sqrt(H)) * norm_slack
    c0 = 1.01 * norms.sigma * 2.0 ** -35 * norms.m1
    return ExactBound(c1, c0)


# ----------------------------------------------------------------------------- launchers
#: threads of a re-rank block (routing_rerank.cu: RERANK_WARPS warps per listed token)
RERANK_THREADS = 128
#: blocks of the re-rank launch at most (each loops over the listed tokens): twelve per SM of
#: an H100 / H200; blocks past the list's end exit at once
RERANK_BLOCKS = 1584


#: warps (one expert each) per block of route_one_logits (routing_rerank.cu's ONE_WARPS)
ONE_WARPS = 4
#: warps (one expert each) per block of route_one_norm_logits (ONE_NORM_WARPS): 256 threads,
#: the block rmsnorm_rows normalises a row with, so the norm's bytes are the same
ONE_NORM_WARPS = 8


class ExactRoutingKernels:
    """Launchers of kernels/common/routing_exact.cu on one runtime (device addresses; nothing
    synchronizes, so a sequence can be captured in a graph)."""

    def __init__(self, runtime: Runtime):
        mod = runtime.module(EXACT_SOURCE)
        self.arch = runtime.arch
        #: the tiles whose kernels run on this device
        self.tiles = {name: t for name, t in SPLIT_TILES.items() if runs_on(t, self.arch)}
        sm90 = (runtime.module(SM90_SOURCE, arch=SM90_ARCH) if self.arch == SM90_RUNS_ON
                else None)
        # every launch of the chain waits for the grid before it in the kernel (prior_grid.cuh)
        self._gemm = {name: (sm90 if isinstance(t, WgmmaSplitTile) and sm90 else mod).kernel(
            f"router_logits_split_{name}", "PPPPPiiif", overlap=True)
            for name, t in self.tiles.items()}
        self._topk = {npl: mod.kernel(f"topk_exact_w{npl}", "PPiiiddPPPiPP", overlap=True)
                      for npl in _TOPK_NPL}
        rerank = runtime.module(RERANK_SOURCE)
        self._rerank = {npl: rerank.kernel(f"route_rerank_w{npl}", "PPPiiiiPPPPPi",
                                           overlap=True) for npl in _TOPK_NPL}
        self._rerank_x = {npl: rerank.kernel(f"route_rerank_x_w{npl}", "PPPPPiiiiPPPPPi",
                                             overlap=True) for npl in _TOPK_NPL}
        self._norm_split = runtime.module(NORM_SPLIT_SOURCE).kernel("rmsnorm_split_rows",
                                                                    "PPPPPiifPi")
        self._one_logits = rerank.kernel("route_one_logits", "PPiiP", overlap=True)
        self._one_norm_logits = rerank.kernel("route_one_norm_logits", "PPfPiiPPPiPi",
                                              overlap=True)
        self._one_pick = {npl: rerank.kernel(f"route_one_pick_w{npl}", "PiiPPPPP", overlap=True)
                          for npl in _TOPK_NPL}

    def tile(self, tokens: int, hidden: int, presplit: bool = False) -> str:
        """The split GEMM tile for a chunk of `tokens` on this device; a presplit one only
        where `presplit` allows it."""
        return split_tile(tokens, hidden, tile_rule(self.arch), presplit)

    def norm_split(self, stream: Stream, *, x: int, norm_w: int, eps: float, parts: int,
                   ws: ExactWorkspace, tokens: int, hidden: int, bad: int, layer: int) -> None:
        """The RMSNorm of the presplit tiles: xn of float32 x [T, H] (rmsnorm_rows' values) as
        fp16 hi parts at `parts` and scaled residuals T * H values further on (the bytes of
        float32 xn [T, H] in all), the tokens' scales and norms in `ws`, and the finiteness
        flag lowered at `bad` for `layer` as rmsnorm_rows does."""
        if parts % 16 or hidden % HIDDEN_MULTIPLE:
            raise RoutingShapeError(f"the split RMSNorm needs 16-byte aligned parts and hidden "
                                    f"% {HIDDEN_MULTIPLE} == 0; got parts=0x{parts:x}, "
                                    f"hidden={hidden}")
        self._norm_split.launch(grid=(tokens, 1, 1), block=(NORM_SPLIT_THREADS, 1, 1),
                                stream=stream, args=(x, norm_w, parts, ws.rscale, ws.xnorm,
                                                     tokens, hidden, float(eps), bad, layer))

    def logits(self, stream: Stream, xn: int, router: int, logits: int, ws: ExactWorkspace,
               tokens: int, hidden: int, n_experts: int, sigma: float, tile: str) -> None:
        """logits float32 [T, E] (within the bound of the canonical ones), the token norms and
        a zeroed re-rank count in `ws`. `router`: the layer's split_router bytes (16-byte
        aligned)."""
        check_routing_shape(hidden, n_experts, 1, tokens)
        if xn % 16 or router % 16:
            raise RoutingShapeError(f"split GEMM operands must be 16-byte aligned; got xn=0x"
                                    f"{xn:x}, router=0x{router:x}")
        t = SPLIT_TILES[tile]
        if tile not in self.tiles:
            raise RoutingShapeError(f"split GEMM tile {tile!r} does not run on {self.arch} "
                                    f"(it needs {SM90_RUNS_ON})")
        if not t.fits(hidden):
            raise RoutingShapeError(f"split GEMM tile {tile!r} steps K by {t.bk}: hidden="
                                    f"{hidden} is not a multiple of it")
        self._gemm[tile].launch(grid=(-(-tokens // t.bm), -(-n_experts // t.bn), 1),
                                block=(t.threads, 1, 1), stream=stream, shared=t.shared,
                                args=(xn, router, logits, ws.xnorm, ws.n_rerank, tokens, hidden,
                                      n_experts, float(sigma)))

    def topk(self, stream: Stream, *, logits: int, router32: int, ws: ExactWorkspace,
             tokens: int, hidden: int, n_experts: int, top_k: int, bound: ExactBound,
             ids: int, weights: int, masks: int, xn: int = 0, x: int = 0,
             norm_w: int = 0) -> None:
        """ids int32 [T, k] (the canonical picks), weights float32 [T, k] and the tile masks:
        the warp top-k settles what the bound proves, the re-rank launch the rest. The re-rank
        reads the float32 normalised rows `xn`, or (after norm_split, where no float32 xn
        exists) the residual rows `x` with the norm's weights `norm_w`, and normalises the
        rows it needs with the scales in `ws`: one or the other."""
        if (xn != 0) == (x != 0) or (x != 0) != (norm_w != 0):
            raise RoutingShapeError(f"the exact top-k reads xn, or x with norm_w; got xn=0x{xn:x}"
                                    f", x=0x{x:x}, norm_w=0x{norm_w:x}")
        check_routing_shape(HIDDEN_MULTIPLE, n_experts, top_k, tokens)
        npl = next(n for n in _TOPK_NPL if 32 * n >= n_experts)
        nt = n_tiles(tokens)
        self._topk[npl].launch(grid=(nt, 1, 1), block=(1024, 1, 1), stream=stream,
                               args=(logits, ws.xnorm, tokens, n_experts, top_k,
                                     float(bound.c1), float(bound.c0), ids, weights, masks, nt,
                                     ws.n_rerank, ws.rerank))
        grid, block = (min(tokens, RERANK_BLOCKS), 1, 1), (RERANK_THREADS, 1, 1)
        if norm_w:
            self._rerank_x[npl].launch(grid=grid, block=block, stream=stream, shared=4 * hidden,
                                       args=(logits, x, ws.rscale, norm_w, router32, tokens,
                                             hidden, n_experts, top_k, ws.n_rerank, ws.rerank,
                                             ids, weights, masks, nt))
            return
        self._rerank[npl].launch(grid=grid, block=block, stream=stream,
                                 args=(logits, xn, router32, tokens, hidden, n_experts, top_k,
                                       ws.n_rerank, ws.rerank, ids, weights, masks, nt))

    def one(self, stream: Stream, *, xn: int, router32: int, hidden: int, n_experts: int,
            top_k: int, canon: int, ids: int, weights: int, bounds: int, sorted_token: int,
            row_of: int) -> None:
        """A chunk of one token in two launches, in place of logits, top-k and sort: the
        canonical logit of every expert (float64 into `canon`, n_experts * 8 bytes), then ids
        int32 [1, k] and weights float32 [1, k] as topk writes them for a token it re-ranks in
        full, and the sort's bounds, sorted_token and row_of. `router32`: the layer's float32
        router rows."""
        check_routing_shape(HIDDEN_MULTIPLE, n_experts, top_k, 1)
        self._one_logits.launch(grid=(-(-n_experts // ONE_WARPS), 1, 1),
                                block=(32 * ONE_WARPS, 1, 1), stream=stream,
                                args=(xn, router32, hidden, n_experts, canon))
        self._pick_one(stream, canon, n_experts, top_k, ids, weights, bounds, sorted_token,
                       row_of)

    def one_normed(self, stream: Stream, *, x: int, norm_w: int, eps: float, router32: int,
                   hidden: int, n_experts: int, top_k: int, canon: int, xn: int, act: int,
                   bad: int, layer: int, ids: int, weights: int, bounds: int,
                   sorted_token: int, row_of: int) -> None:
        """`one` with the layer's RMSNorm in front, for a decode step whose experts take fp16
        activations: the token's residual row x normalised by norm_w in every block of the
        logits launch (rmsnorm_rows' bytes, written to xn by the first), the token's top_k
        sorted rows of fp16 activations written to `act` (convert_f16_rows' bytes) and the
        norm's finiteness flag lowered at `bad` for `layer`; then `one`'s pick. Two launches
        in place of four."""
        check_routing_shape(HIDDEN_MULTIPLE, n_experts, top_k, 1)
        self._one_norm_logits.launch(
            grid=(-(-n_experts // ONE_NORM_WARPS), 1, 1), block=(32 * ONE_NORM_WARPS, 1, 1),
            stream=stream, shared=4 * hidden,
            args=(x, norm_w, float(eps), router32, hidden, n_experts, canon, xn, act, top_k,
                  bad, layer))
        self._pick_one(stream, canon, n_experts, top_k, ids, weights, bounds, sorted_token,
                       row_of)

    def _pick_one(self, stream: Stream, canon: int, n_experts: int, top_k: int, ids: int,
                  weights: int, bounds: int, sorted_token: int, row_of: int) -> None:
        npl = next(n for n in _TOPK_NPL if 32 * n >= n_experts)
        self._one_pick[npl].launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream,
                                   args=(canon, n_experts, top_k, ids, weights, bounds,
                                         sorted_token, row_of))
