"""One MoE layer's routing as the reference backend keeps it while the layer runs: the (token,
k) pairs sorted by expert, so a gather, a RouteCopies or the products can ask which experts have
rows, and the products write each expert's rows where the combine reads them. The products'
and the combine's float32 arithmetic live here, beside the rows they read and write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...weights.model import silu
from ..nonfinite import check_finite

if TYPE_CHECKING:
    from ...formats.contract import QuantFormat


class LayerState:
    """One layer's routing and buffers, sorted by expert (row r of the sorted order is the
    (token, k) pair order[r]; expert e owns rows bounds[e]..bounds[e+1]-1)."""

    def __init__(self, layer: int, xn: np.ndarray, ids: np.ndarray, w: np.ndarray,
                 n_experts: int, hidden: int):
        self.layer = layer
        self.ids, self.w = ids, w
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        self.order = np.argsort(flat, kind="stable")
        self.bounds = np.zeros(n_experts + 1, dtype=np.int32)
        self.bounds[1:] = np.cumsum(np.bincount(flat, minlength=n_experts))
        self.x_sorted = xn[self.order // top_k]
        self.out_sorted = np.zeros((flat.size, hidden), dtype=np.float32)
        self.routed = np.nonzero(np.diff(self.bounds))[0].tolist()

    def has_rows(self, experts: Sequence[int]) -> bool:
        return any(self.bounds[e + 1] > self.bounds[e] for e in experts)

    def multiply(self, ids: tuple[int, ...], fmt: QuantFormat, gu_buf: np.ndarray,
                 dn_buf: np.ndarray, ffn: int) -> None:
        """A group's products: gate/up, SwiGLU, down through the format's numpy MMQ reference
        over the images in gu_buf / dn_buf (position p: expert ids[p]), into out_sorted."""
        if not self.has_rows(ids):
            return
        n, hidden = len(ids), self.out_sorted.shape[1]
        lo = min(int(self.bounds[e]) for e in ids)
        hi = max(int(self.bounds[e + 1]) for e in ids)
        # the group's rows lie in [lo, hi); activations are quantized per row, so quantizing
        # that slice equals slicing the whole layer's activations
        b = np.clip(self.bounds.astype(np.int64) - lo, 0, hi - lo).astype(np.int32)
        gu = fmt.mmq_reference(gu_buf[:n], ids, fmt.prepare_activations(self.x_sorted[lo:hi]),
                               b, 2 * ffn, hidden)
        mid = np.zeros((hi - lo, ffn), dtype=np.float32)
        for e in ids:
            r0, r1 = int(b[e]), int(b[e + 1])
            mid[r0:r1] = silu(gu[r0:r1, :ffn]) * gu[r0:r1, ffn:]
        dn = fmt.mmq_reference(dn_buf[:n], ids, fmt.prepare_activations(mid), b, hidden, ffn)
        for e in ids:
            r0, r1 = int(b[e]), int(b[e + 1])
            self.out_sorted[lo + r0: lo + r1] = dn[r0:r1]

    def combine(self, h: np.ndarray) -> None:
        """h += the experts' rows weighted by the router, in top-k order (float32)."""
        top_k = self.ids.shape[1]
        flat = np.empty_like(self.out_sorted)
        flat[self.order] = self.out_sorted
        out = flat.reshape(h.shape[0], top_k, -1)
        y = np.zeros_like(h)
        with np.errstate(over="ignore", invalid="ignore"):  # refused just below
            for k in range(top_k):
                y += self.w[:, k, None] * out[:, k]
            h += y
        check_finite(h, "the residual after the MoE", self.layer)
