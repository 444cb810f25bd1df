"""One MoE layer's routing as the reference backend keeps it while the layer runs: the (token,
k) pairs sorted by expert, so a gather, a RouteCopies or the products can ask which experts have
rows, and the products write each expert's rows where the combine reads them."""

from __future__ import annotations

import numpy as np


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
