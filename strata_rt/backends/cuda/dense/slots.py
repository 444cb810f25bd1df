"""A layer's dense slot as the CUDA backend lays it out (strata_rt.models.qwen3.whole_memory): its
host image, uploaded once or streamed per use, and the runs of q, k and v that a one-token
step's matrix-vector launches take."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ....models.qwen3.whole_memory import DenseSlot, tensor_bytes

if TYPE_CHECKING:
    from ....models.qwen3.weights import Qwen3Model


def qkv_runs(slot: DenseSlot, hidden: int, q_dim: int,
             kv_dim: int) -> list[tuple[str, int, int, int]]:
    """(type, byte offset in the slot, first row of Wqkv, rows) of each run of q, k, v that
    shares a type (they lie one after another in the slot): one matrix-vector launch each."""
    runs: list[tuple[str, int, int, int]] = []
    row = 0
    for type_name, offset, rows in ((slot.types.q, slot.q, q_dim), (slot.types.k, slot.k, kv_dim),
                                    (slot.types.v, slot.v, kv_dim)):
        if runs and runs[-1][0] == type_name:
            runs[-1] = (*runs[-1][:3], runs[-1][3] + rows)
        else:
            runs.append((type_name, offset, row, rows))
        row += rows
    assert all(off + tensor_bytes(t, n, hidden) <= slot.o for t, off, _, n in runs)
    return runs


def dense_slot_bytes(whole: Qwen3Model, layer: int, slot: DenseSlot) -> np.ndarray:
    """The host image of one layer's dense slot (uint8 [slot.nbytes]): the projections' own
    bytes, the norms as float32."""
    lw = whole.dense.layers[layer]
    buf = np.zeros(slot.nbytes, np.uint8)

    def put(offset: int, values: np.ndarray) -> None:
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        buf[offset: offset + raw.size] = raw

    for offset, t in ((slot.q, lw.attn_q), (slot.k, lw.attn_k), (slot.v, lw.attn_v),
                      (slot.o, lw.attn_output)):
        put(offset, t.data)
    put(slot.attn_norm, lw.attn_norm.f32().astype(np.float32))
    put(slot.q_norm, lw.attn_q_norm.f32().astype(np.float32))
    put(slot.k_norm, lw.attn_k_norm.f32().astype(np.float32))
    return buf
