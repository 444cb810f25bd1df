"""MoE routing on the GPU in four launches (kernels/common/routing.cu), and its numpy twins.

Why: routing used to cost ~0.64 ms per layer at 8K tokens (float32 router GEMM on CUDA cores,
then one thread per token for the top-k), more than some whole layers on short prompts. Here:

1. router logits on tensor cores: fp16(xn) x fp16(router) with float32 accumulation
   (mma.sync m16n8k16). xn stays float32 in device memory and is rounded to fp16 as it is
   loaded; the router weights are kept on the device as fp16 (`router_f16`);
2. softmax top-k, one warp per token: picks by logit (softmax is monotone), ties to the lower
   expert id; weights are float32 softmax probabilities renormalised over the k picks. The same
   kernel writes, per expert and tile of 32 tokens, a bit mask of the tile's tokens that chose it;
3. a scan over tiles per expert (popcounts of the masks);
4. a scatter: bounds, sorted_token and row_of, tokens ascending within an expert.

Every step is deterministic and a token's results do not depend on its chunk (see routing.cu).

Numerics. Only the logits differ from the float32 reference (`model.route`): xn and the router
are rounded to fp16 (11 significant bits) and then multiplied exactly and summed in float32, so
a logit moves by about 2^-11 of sqrt(sum (x_c w_c)^2). The top-k set changes only where two
candidate logits lie that close; tests measure how often on random inputs and bound it. Inputs
beyond the fp16 range (|v| > 65504) are clamped to +-65504, so a logit stays finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ....errors import StrataError
from ....resources import KERNELS_ROOT

if TYPE_CHECKING:
    from ....runtime import Runtime, Stream


ROUTING_SOURCE = KERNELS_ROOT / "common" / "routing.cu"
#: routing kernels of the CUDA backend (STRATA_ROUTING), the default first: "exact" (the
#: canonical picks of backends/cuda/routing/exact.py: split-operand tensor-core logits, proven or
#: re-ranked), "f16" (these kernels: fp16 operands, near-ties may flip) or "fp32" (engine.cu's
#: float32 CUDA-core kernels)
ROUTINGS = ("exact", "f16", "fp32")
#: device bytes per router weight: split fp16 hi/lo + float32 for the re-check, fp16, float32
ROUTER_BYTES = {"exact": 8, "f16": 2, "fp32": 4}
#: tokens per sort tile (one bit each of a 32-bit mask); the top-k block covers one tile
ROUTE_TILE = 32
MAX_EXPERTS = 512
MAX_TOP_K = 16
#: the hidden size must be a multiple of this: the K step of every tile the rule can fall back
#: on (a tile with a longer K step serves only hidden sizes it divides)
HIDDEN_MULTIPLE = 64
F16_LIMIT = np.float32(65504.0)
SCAN_THREADS = 256


class GemmTile(NamedTuple):
    """The arguments of one instantiation router_gemm<BM, BN, WARPS_M, WARPS_N, BK, STAGES>
    (kernel router_logits_f16_<name>): BM tokens x BN experts per block, WARPS_M x WARPS_N
    warps, K steps of BK through a STAGES-deep ring."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int
    stages: int

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * 32

    @property
    def shared(self) -> int:
        """Dynamic shared memory of one block: the ring of float32 xn and fp16 router tiles,
        and the K step's xn converted to fp16; rows padded by 8 values."""
        row = self.bk + 8
        return self.stages * (self.bm * row * 4 + self.bn * row * 2) + self.bm * row * 2

    def fits(self, hidden: int) -> bool:
        """Whether the tile's K step divides the hidden size."""
        return hidden % self.bk == 0


#: GEMM tile shapes by name, as routing.cu instantiates them. All give the same bytes (each
#: logit is the same chain of mma steps); they differ in speed only.
GEMM_TILES: dict[str, GemmTile] = {
    "m64": GemmTile(64, 128, 2, 4, 32, 4),
    "m16": GemmTile(16, 64, 1, 4, 64, 3),
    "m16k128": GemmTile(16, 64, 1, 4, 128, 4),
    "m64k64": GemmTile(64, 128, 2, 4, 64, 4),
    "m64k128": GemmTile(64, 128, 2, 4, 128, 3),
}
#: the default tile by chunk length: the first row whose max_tokens (None: any) covers the
#: chunk and whose tile's K step divides hidden. A tile with a K step above HIDDEN_MULTIPLE
#: needs a later row that covers the same chunks as its fallback; the last row must cover
#: every chunk with a tile whose K step divides HIDDEN_MULTIPLE.
#: Set from bench/bench_routing.py's sweep on an H200: up to 2,048 tokens many short blocks
#: with K steps of 128 (one wave of blocks), beyond them one wave of 64-token blocks, also with
#: K steps of 128; m16 and m64 where hidden is not a multiple of 128.
GEMM_TILE_RULE: tuple[tuple[int | None, str], ...] = (
    (2048, "m16k128"), (2048, "m16"), (None, "m64k128"), (None, "m64"))
#: top-k kernels by logits per lane (n_experts <= 32 * NPL)
_TOPK_NPL = (1, 2, 4, 8, 16)


class RoutingShapeError(StrataError):
    """A model or chunk shape the routing kernels do not support."""


def check_routing_shape(hidden: int, n_experts: int, top_k: int, tokens: int = 1) -> None:
    """Raises RoutingShapeError naming every unsupported value."""
    problems = []
    if hidden <= 0 or hidden % HIDDEN_MULTIPLE:
        problems.append(f"hidden={hidden} (must be a positive multiple of {HIDDEN_MULTIPLE})")
    if not 2 <= n_experts <= MAX_EXPERTS or n_experts % 2:
        problems.append(f"n_experts={n_experts} (must be even, 2..{MAX_EXPERTS})")
    if not 1 <= top_k <= min(MAX_TOP_K, max(n_experts, 1)):
        problems.append(f"top_k={top_k} (must be 1..min({MAX_TOP_K}, n_experts))")
    if tokens < 1:
        problems.append(f"tokens={tokens} (must be at least 1)")
    if problems:
        raise RoutingShapeError("the GPU routing kernels cannot route " + ", ".join(problems))


def n_tiles(tokens: int) -> int:
    return -(-tokens // ROUTE_TILE)


def sort_workspace_bytes(tokens: int, n_experts: int) -> int:
    """Device bytes the sort needs beside its outputs for chunks of up to `tokens` tokens:
    tile masks and tile offsets (uint32/int32 [n_experts, tiles]) and per-expert totals."""
    return (2 * n_experts * n_tiles(tokens) + n_experts) * 4


#: bytes of one entry of the exact routing's re-rank list (route_pick.cuh: struct Rerank)
RERANK_ENTRY_BYTES = 16


def workspace_bytes(tokens: int, n_experts: int, routing: str = "exact") -> int:
    """The route_ws region of a routing: the sort's workspace, and for "exact" the token norms
    and RMSNorm scales (float32 [T] each), the re-rank count and the re-rank list after it
    (exact_workspace); "fp32" needs none."""
    if routing == "fp32":
        return 0
    sort = sort_workspace_bytes(tokens, n_experts)
    if routing == "f16":
        return sort
    return -(-sort // 16) * 16 + 2 * -(-tokens * 4 // 16) * 16 + 16 + RERANK_ENTRY_BYTES * tokens


class ExactWorkspace(NamedTuple):
    """Device addresses inside an exact routing's workspace, after the sort's part: the token
    norms, the tokens' RMSNorm scales (float32 [T], written by the split RMSNorm of the
    presplit tiles), the re-rank count (int32; the next word counts finished re-rank blocks,
    the one after it re-ranked tokens over all launches, for tests and benchmarks) and the
    list."""

    xnorm: int
    rscale: int
    n_rerank: int
    rerank: int

    @property
    def reranked_total(self) -> int:
        return self.n_rerank + 8


def exact_workspace(workspace: int, tokens: int, n_experts: int) -> ExactWorkspace:
    """The exact routing's parts of a workspace of workspace_bytes(>= tokens, n_experts)."""
    xnorm = workspace + -(-sort_workspace_bytes(tokens, n_experts) // 16) * 16
    rscale = xnorm + -(-tokens * 4 // 16) * 16
    count = rscale + -(-tokens * 4 // 16) * 16
    return ExactWorkspace(xnorm, rscale, count, count + 16)


def gemm_tiles_for(hidden: int) -> list[str]:
    """The GEMM tiles whose K step divides `hidden`, in GEMM_TILES order."""
    return [name for name, tile in GEMM_TILES.items() if tile.fits(hidden)]


def gemm_tile(tokens: int, hidden: int,
              rule: tuple[tuple[int | None, str], ...] = GEMM_TILE_RULE) -> str:
    """The GEMM tile shape the launcher picks for a chunk (it changes speed, not bytes): the
    first row of `rule` that covers `tokens` with a tile whose K step divides `hidden`."""
    for max_tokens, name in rule:
        if (max_tokens is None or tokens <= max_tokens) and GEMM_TILES[name].fits(hidden):
            return name
    raise RoutingShapeError(f"no GEMM tile of the rule fits tokens={tokens}, hidden={hidden}")


# ----------------------------------------------------------------------------- numpy twins
def to_f16(a: np.ndarray) -> np.ndarray:
    """float32 -> float16 as the kernels round: nearest even, |v| > 65504 clamped (NaN kept)."""
    a = np.asarray(a, dtype=np.float32)
    clamped = np.where(np.abs(a) > F16_LIMIT, np.copysign(F16_LIMIT, a), a)
    return clamped.astype(np.float16)


def router_f16(router: np.ndarray) -> np.ndarray:
    """The router weights as the device keeps them (float16, any leading shape [..., E, H]);
    upload these bytes instead of the float32 weights."""
    return to_f16(router)


def router_logits_ref(xn: np.ndarray, router16: np.ndarray) -> np.ndarray:
    """float64 [T, E]: the exact product of fp16(xn) and the fp16 router. The kernel's float32
    accumulation stays within about 1e-5 of sum |x_c w_c| of it."""
    a = to_f16(xn).astype(np.float64)
    return a @ np.asarray(router16, dtype=np.float16).astype(np.float64).T


def topk_softmax_ref(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """ids int32 [T, k] (largest logit first, ties to the lower id: the kernel's ids exactly,
    given the same logits) and weights float32 [T, k] (the kernel's within float32 rounding:
    its expf and summation order differ from numpy's)."""
    lg = np.asarray(logits, dtype=np.float32) + np.float32(0.0)  # -0 -> +0, as the kernel
    ids = np.argsort(-lg, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    m = lg.max(axis=1, keepdims=True)
    e = np.exp(lg - m)
    s = e.sum(axis=1, keepdims=True, dtype=np.float32)
    p = (np.take_along_axis(e, ids, axis=1) / s).astype(np.float32)
    w = (p / p.sum(axis=1, keepdims=True, dtype=np.float32)).astype(np.float32)
    return ids, w


def counting_sort_ref(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
    """(bounds int32 [E+1], sorted_token int32 [T*k], row_of int32 [T*k]): the pairs (t, j)
    sorted by expert, tokens ascending inside an expert (a stable sort of the flat ids)."""
    ids = np.asarray(ids)
    top_k = ids.shape[1]
    flat = ids.reshape(-1).astype(np.int64)
    counts = np.bincount(flat, minlength=n_experts)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.argsort(flat, kind="stable")
    row_of = np.empty(flat.size, np.int32)
    row_of[order] = np.arange(flat.size, dtype=np.int32)
    return bounds, (order // top_k).astype(np.int32), row_of


def tile_masks_ref(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """uint32 [E, tiles]: bit t%32 of masks[e, t//32] is set when token t chose expert e."""
    ids = np.asarray(ids)
    tokens = ids.shape[0]
    masks = np.zeros((n_experts, n_tiles(tokens)), np.uint32)
    t = np.repeat(np.arange(tokens), ids.shape[1])
    np.bitwise_or.at(masks, (ids.reshape(-1), t // ROUTE_TILE),
                     (np.uint32(1) << (t % ROUTE_TILE).astype(np.uint32)))
    return masks


def _popcount32(a: np.ndarray) -> np.ndarray:
    return np.unpackbits(a.astype("<u4").view(np.uint8), axis=-1).reshape(
        *a.shape, 32).sum(axis=-1)


def tile_sort_ref(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sort as the kernels compute it (masks, per-expert scan over tiles, popcount rank):
    the same three arrays as counting_sort_ref, which is what it must equal."""
    ids = np.asarray(ids)
    tokens, top_k = ids.shape
    masks = tile_masks_ref(ids, n_experts)
    counts = _popcount32(masks)                                   # [E, tiles]
    tile_off = np.cumsum(counts, axis=1) - counts                 # exclusive, per expert
    totals = counts.sum(axis=1)
    start = np.concatenate([[0], np.cumsum(totals)])
    t = np.repeat(np.arange(tokens), top_k)
    e = ids.reshape(-1).astype(np.int64)
    tile = t // ROUTE_TILE
    below = (np.uint64(1) << (t % ROUTE_TILE).astype(np.uint64)) - np.uint64(1)
    rank = _popcount32((masks[e, tile].astype(np.uint64) & below).astype(np.uint32))
    row_of = (start[e] + tile_off[e, tile] + rank).astype(np.int32)
    sorted_token = np.empty(t.size, np.int32)
    sorted_token[row_of] = t
    return start.astype(np.int32), sorted_token, row_of


def route_ref(xn: np.ndarray, router: np.ndarray, top_k: int) -> dict[str, np.ndarray]:
    """The whole routing twin from float32 xn and float32 router weights: logits (float64, the
    exact fp16 product), ids, weights, bounds, sorted_token, row_of."""
    logits = router_logits_ref(xn, router_f16(router))
    ids, w = topk_softmax_ref(logits.astype(np.float32), top_k)
    bounds, sorted_token, row_of = counting_sort_ref(ids, router.shape[0])
    return {"logits": logits, "ids": ids, "weights": w, "bounds": bounds,
            "sorted_token": sorted_token, "row_of": row_of}


# ----------------------------------------------------------------------------- launchers
class RoutingKernels:
    """Launchers of kernels/common/routing.cu on one runtime. All pointers are device
    addresses (ints); nothing here synchronizes, so a sequence can be captured in a graph."""

    def __init__(self, runtime: Runtime):
        mod = runtime.module(ROUTING_SOURCE)
        self._gemm = {name: mod.kernel(f"router_logits_f16_{name}", "PPPiii")
                      for name in GEMM_TILES}
        self._topk = {npl: mod.kernel(f"topk_softmax_w{npl}", "PiiiPPPi") for npl in _TOPK_NPL}
        self._scan = mod.kernel("route_tile_scan", "PiPP", overlap=True)
        self._scatter = mod.kernel("route_scatter", "PiiiPPPiPPP", overlap=True)

    def logits(self, stream: Stream, xn: int, router16: int, logits: int, tokens: int,
               hidden: int, n_experts: int, tile: str | None = None) -> None:
        """logits float32 [T, E] = fp16(xn float32 [T, H]) x router16 float16 [E, H]^T.
        xn must be 16-byte aligned, router16 too. `tile` names a GEMM_TILES shape (default:
        gemm_tile's pick); one whose K step does not divide hidden is refused."""
        check_routing_shape(hidden, n_experts, 1, tokens)
        if xn % 16 or router16 % 16:
            raise RoutingShapeError(f"router GEMM operands must be 16-byte aligned; got xn=0x"
                                    f"{xn:x}, router16=0x{router16:x}")
        name = tile or gemm_tile(tokens, hidden)
        if name not in GEMM_TILES:
            raise RoutingShapeError(f"GEMM tile {name!r} is unknown; valid: "
                                    f"{', '.join(GEMM_TILES)}")
        t = GEMM_TILES[name]
        if not t.fits(hidden):
            raise RoutingShapeError(f"GEMM tile {name!r} steps K by {t.bk}: hidden={hidden} is "
                                    f"not a multiple of it; tiles for this hidden size: "
                                    f"{', '.join(gemm_tiles_for(hidden))}")
        self._gemm[name].launch(grid=(-(-tokens // t.bm), -(-n_experts // t.bn), 1),
                                block=(t.threads, 1, 1), stream=stream, shared=t.shared,
                                args=(xn, router16, logits, tokens, hidden, n_experts))

    def topk(self, stream: Stream, logits: int, tokens: int, n_experts: int, top_k: int,
             ids: int, weights: int, workspace: int) -> None:
        """ids int32 [T, k], weights float32 [T, k], and the tile masks in the workspace."""
        check_routing_shape(HIDDEN_MULTIPLE, n_experts, top_k, tokens)
        npl = next(n for n in _TOPK_NPL if 32 * n >= n_experts)
        self._topk[npl].launch(grid=(n_tiles(tokens), 1, 1), block=(1024, 1, 1), stream=stream,
                               args=(logits, tokens, n_experts, top_k, ids, weights,
                                     workspace, n_tiles(tokens)))

    def sort(self, stream: Stream, ids: int, tokens: int, n_experts: int, top_k: int,
             workspace: int, bounds: int, sorted_token: int, row_of: int) -> None:
        """bounds int32 [E+1], sorted_token and row_of int32 [T*k] from the ids and the tile
        masks that `topk` left in the workspace."""
        check_routing_shape(HIDDEN_MULTIPLE, n_experts, top_k, tokens)
        nt = n_tiles(tokens)
        masks = workspace
        tile_off = workspace + n_experts * nt * 4
        totals = tile_off + n_experts * nt * 4
        self._scan.launch(grid=(n_experts, 1, 1), block=(SCAN_THREADS, 1, 1), stream=stream,
                          args=(masks, nt, tile_off, totals))
        self._scatter.launch(grid=(nt, 1, 1), block=(ROUTE_TILE * top_k, 1, 1), stream=stream,
                             args=(ids, tokens, top_k, n_experts, masks, tile_off, totals, nt,
                                   bounds, sorted_token, row_of))

    def route(self, stream: Stream, *, xn: int, router16: int, logits: int, ids: int,
              weights: int, bounds: int, sorted_token: int, row_of: int, workspace: int,
              tokens: int, hidden: int, n_experts: int, top_k: int,
              tile: str | None = None) -> None:
        """All four launches: logits, top-k, scan, scatter. Buffers: logits T*E*4 bytes,
        ids/weights/sorted_token/row_of T*k*4 each, bounds (E+1)*4, workspace
        workspace_bytes(T, E)."""
        self.logits(stream, xn, router16, logits, tokens, hidden, n_experts, tile)
        self.topk(stream, logits, tokens, n_experts, top_k, ids, weights, workspace)
        self.sort(stream, ids, tokens, n_experts, top_k, workspace, bounds, sorted_token,
                  row_of)
