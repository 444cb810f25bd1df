"""The exact routing's split GEMM tiles (kernels/common/routing_exact.cu on mma.sync,
routing_split_sm90.cu on wgmma): their shapes and shared memory, read from the sources' tile
lines, and the rule that picks one by chunk length.

Every tile gives the same logits, bit for bit (each logit is the same chain of products), so
the choice changes speed only. The presplit tiles take x as the split RMSNorm wrote it (fp16
hi parts and scaled residuals) instead of float32 xn: the same bytes of input and the same
logits, without the split inside the GEMM; a caller that can give them says so.
"""

from __future__ import annotations

from ....resources import KERNELS_ROOT, kernel_lines
from ....runtime.compile import ARCH_SPECIFIC_RUNS_ON as SM90_RUNS_ON
from .kernels import GemmTile, RoutingShapeError

EXACT_SOURCE = KERNELS_ROOT / "common" / "routing_exact.cu"
#: the split GEMM on wgmma (sm_90 devices, compiled for sm_90a)
SM90_SOURCE = KERNELS_ROOT / "common" / "routing_split_sm90.cu"


class SplitTile(GemmTile):
    """One instantiation router_gemm_split<BM, BN, WARPS_M, WARPS_N, BK, STAGES>: the fp16
    router GEMM's tile fields, with the split's shared memory."""

    #: whether the tile takes x's fp16 parts from the split RMSNorm (rmsnorm_split_rows)
    #: instead of float32 xn
    presplit = False

    @property
    def shared(self) -> int:
        """Dynamic shared memory: the ring of float32 x and fp16 hi/lo router tiles, and two
        buffers of a K step's x split into fp16 hi and lo tiles; rows padded by 8 values."""
        row = self.bk + 8
        return self.stages * (self.bm * row * 4 + 2 * self.bn * row * 2) + 4 * self.bm * row * 2


class WgmmaSplitTile(SplitTile):
    """One instantiation router_gemm_split_sm90<STAGES> (routing_split_sm90.cu): two
    warpgroups on 64 tokens x 128 experts, operands in wgmma's 128-byte swizzle."""

    @property
    def shared(self) -> int:
        """Dynamic shared memory: the ring of float32 x and fp16 hi/lo router tiles, two
        buffers of a K step's x split into fp16 hi and lo tiles (swizzled, unpadded), and 1024
        bytes to align the swizzle atoms."""
        return (self.stages * (self.bm * self.bk * 4 + 2 * self.bn * self.bk * 2)
                + 4 * self.bm * self.bk * 2 + 1024)


class WgmmaProducerTile(WgmmaSplitTile):
    """One instantiation split_sm90_producer<STAGES, WARPS>: two multiplying warpgroups of 64
    experts (12 warps) or one of 128 (8 warps), and a producer warpgroup that copies and
    splits into a ring of finished stages."""

    @property
    def shared(self) -> int:
        """Dynamic shared memory: STAGES stages of fp16 hi/lo router and x tiles (x reaches
        the producer's registers, not shared memory), and 1024 bytes of alignment."""
        return self.stages * (2 * self.bn * self.bk * 2 + 2 * self.bm * self.bk * 2) + 1024


class WgmmaPresplitTile(WgmmaProducerTile):
    """One instantiation presplit_sm90<STAGES>: two warpgroups that copy x's finished fp16
    parts (the split RMSNorm's output) and the router tiles, and multiply; no split. Its
    ring holds the producer tile's finished stages, so its shared memory is the same."""

    presplit = True


#: the schedules of routing_split_sm90.cu's tile lines, by function name
_SM90_SCHEDULES: dict[str, type[WgmmaSplitTile]] = {
    "router_gemm_split_sm90": WgmmaSplitTile,
    "split_sm90_producer": WgmmaProducerTile,
    "presplit_sm90": WgmmaPresplitTile,
}


def _tiles_of_source() -> dict[str, SplitTile]:
    """The tiles the two sources instantiate (their SPLIT_KERNEL / SPLIT_SM90_KERNEL lines:
    the one source of the table)."""
    tiles: dict[str, SplitTile] = {}
    for name, *args in kernel_lines(EXACT_SOURCE, "SPLIT_KERNEL"):
        tiles[name] = SplitTile(*(int(v) for v in args[:6]))
    for name, bm, bn, warps, bk, stages, schedule in kernel_lines(SM90_SOURCE,
                                                                  "SPLIT_SM90_KERNEL"):
        tiles[name] = _SM90_SCHEDULES[schedule](int(bm), int(bn), int(warps), 1, int(bk),
                                                int(stages))
    return tiles


def runs_on(tile: SplitTile, arch: str) -> bool:
    """Whether a tile's kernel runs on a device of `arch` (the wgmma tiles: sm_90 only)."""
    return not isinstance(tile, WgmmaSplitTile) or arch == SM90_RUNS_ON


#: the split GEMM's tiles by name (same bytes from all: each logit is the same chain)
SPLIT_TILES: dict[str, SplitTile] = _tiles_of_source()
#: the tile by chunk length: the first row whose max_tokens (None: any) covers the chunk and
#: whose K step divides hidden; the last row's tile must fit every HIDDEN_MULTIPLE. From
#: bench/bench_routing.py's tile table on an H200: many 16-token blocks up to 2,048 tokens (one
#: wave), 64-token blocks beyond; m16k128 was within 2% of m16 everywhere
SPLIT_TILE_RULE: tuple[tuple[int | None, str], ...] = ((2048, "m16"), (None, "m64"))
#: the rule on sm_90 devices (bench/results/routing-h200-tiles.md and routing-h200-presplit.md,
#: both router shapes): m16k128 up to 1,024 tokens (m16 where the hidden size is no multiple of
#: its K step of 128); beyond, where the chunk's x can come split from its RMSNorm (the experts
#: take fp16 activations), the presplit tiles, three stages up to 4,096 tokens and four beyond
#: (a third faster than any tile that splits x itself); else the producer-warpgroup tile wg128p
#: up to 4,096 (from 1,536 tokens on it beats m16 by 10-16%, whose blocks no longer fit one
#: wave) and the three-stage wgmma tile beyond, where neither producer tile keeps up
SPLIT_TILE_RULE_SM90: tuple[tuple[int | None, str], ...] = (
    (1024, "m16k128"), (1024, "m16"), (4096, "wg64h3"), (None, "wg64h4"), (4096, "wg128p"),
    (None, "wg64s3"))


def tile_rule(arch: str) -> tuple[tuple[int | None, str], ...]:
    """The tile rule of a device's arch."""
    return SPLIT_TILE_RULE_SM90 if arch == SM90_RUNS_ON else SPLIT_TILE_RULE


def split_tile(tokens: int, hidden: int,
               rule: tuple[tuple[int | None, str], ...] = SPLIT_TILE_RULE,
               presplit: bool = False) -> str:
    """The first tile of `rule` that covers `tokens` and whose K step divides `hidden`; a
    presplit tile only where `presplit` (the caller can give x as the split RMSNorm's parts)."""
    for max_tokens, name in rule:
        t = SPLIT_TILES[name]
        if ((max_tokens is None or tokens <= max_tokens) and t.fits(hidden)
                and (presplit or not t.presplit)):
            return name
    raise RoutingShapeError(f"no split GEMM tile fits tokens={tokens}, hidden={hidden}")
