"""The runs of q, k and v a one-token step's matrix-vector launches take (whole.qkv_runs): one
launch per run of one type, rows and byte offsets where the slot holds them."""

from __future__ import annotations

from strata_rt.backends.cuda.dense.slots import qkv_runs
from strata_rt.models.qwen3.spec import QWEN3_30B_A3B as QWEN3_30B_SPEC
from strata_rt.models.qwen3.whole_memory import DenseSlot, LayerTypes, tensor_bytes


def _slot(q: str, k: str, v: str) -> DenseSlot:
    return DenseSlot.of(QWEN3_30B_SPEC, LayerTypes(q, k, v, "Q8_0"))


def test_one_type_is_one_launch_over_every_row() -> None:
    s, sp = _slot("F16", "F16", "F16"), QWEN3_30B_SPEC
    assert qkv_runs(s, sp.hidden, sp.q_dim, sp.kv_dim) == [
        ("F16", 0, 0, sp.q_dim + 2 * sp.kv_dim)]


def test_runs_of_types_keep_their_rows_and_offsets() -> None:
    sp = QWEN3_30B_SPEC
    s = _slot("Q4_K", "Q6_K", "Q6_K")
    assert qkv_runs(s, sp.hidden, sp.q_dim, sp.kv_dim) == [
        ("Q4_K", 0, 0, sp.q_dim),
        ("Q6_K", tensor_bytes("Q4_K", sp.q_dim, sp.hidden), sp.q_dim, 2 * sp.kv_dim)]
    s = _slot("Q4_K", "Q6_K", "Q4_K")
    runs = qkv_runs(s, sp.hidden, sp.q_dim, sp.kv_dim)
    assert [(t, r, n) for t, _, r, n in runs] == [
        ("Q4_K", 0, sp.q_dim), ("Q6_K", sp.q_dim, sp.kv_dim),
        ("Q4_K", sp.q_dim + sp.kv_dim, sp.kv_dim)]
    assert [off for _, off, _, _ in runs] == [s.q, s.k, s.v]
