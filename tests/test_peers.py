"""The PyTorch peers of the benchmarks: the grouped-GEMM arm (bench/peers/torch_grouped.py)
computes the bmm arm's MoE (bench/peers/torch_moe.py), and both agree with the float64
reference on the dequantized weights.

The peers are only worth a comparison if they compute the same thing the engine does; these
tests pin that down on tiny random models on the CPU (and on a GPU where torch has one, which
is where torch._grouped_mm takes its CUTLASS path). strata_rt never imports torch, so without
torch the whole module is skipped with that reason.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch peers need torch (bench only; strata_rt never imports it)")
pytest.importorskip("gguf", reason="the peers' IQ3_XXS grid comes from gguf")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "peers"))

import torch_grouped as tg  # noqa: E402
from torch_moe import TorchMoE  # noqa: E402

from strata_rt.formats.numerics import nmse  # noqa: E402
from strata_rt.weights.model import Model, MoESpec, reference_moe_f64  # noqa: E402

SPEC = MoESpec(n_layers=2, hidden=512, ffn=256, n_experts=8, top_k=2)


@pytest.fixture(autouse=True)
def _restore_current_context():
    """torch's CUDA runtime makes its primary context current on this thread (replacing the
    context the session's Runtime pushed), so GPU tests after these would launch the Runtime's
    kernels in a context that does not hold them ("invalid resource handle"). The context
    current before each test is made current again after it."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver: torch runs on the CPU and changes no context
        yield
        return
    before = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(before))
    yield
    if before.value:
        lib.cuCtxSetCurrent(before)


def _devices() -> list:
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.synthetic(SPEC, seed=3)


def _peer(model: Model, device: str) -> TorchMoE:
    s = model.spec
    return TorchMoE(router=model.router, norm=model.norm,
                    blobs=lambda layer: np.stack([model.expert_blob(layer, e)
                                                  for e in range(s.n_experts)]),
                    hidden=s.hidden, ffn=s.ffn, top_k=s.top_k, rms_eps=s.rms_eps,
                    regime="resident", device=device, compile=False)


def _hidden(tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((tokens, SPEC.hidden)).astype(np.float32)


def _update_nmse(got: np.ndarray, want: np.ndarray, h: np.ndarray) -> float:
    """Of the MoE update (output minus input): the residual would hide differences."""
    return nmse(got.astype(np.float64) - h, want.astype(np.float64) - h)


def _grouped_or_skip(peer: TorchMoE) -> tg.GroupedMoE:
    try:
        return tg.GroupedMoE.alongside(peer)
    except tg.GroupedMMUnavailable as e:
        pytest.skip(f"torch._grouped_mm does not run here ({e}); "
                    "test_loop_stand_in_matches_bmm covers the arm's own logic")


# ------------------------------------------------------------------ offsets and permutation
def test_sort_by_expert_offsets_and_products() -> None:
    """0, 1, odd and very uneven rows per group; each output row is its own group's product."""
    rng = np.random.default_rng(5)
    groups, k, n = 6, 32, 16
    counts = np.array([0, 1, 7, 0, 40, 3])
    flat = torch.tensor(rng.permutation(np.repeat(np.arange(groups), counts)))
    order, offs = tg.sort_by_expert(flat, groups)
    assert offs.dtype == torch.int32
    assert offs.tolist() == np.cumsum(counts).tolist()
    assert torch.equal(flat[order], torch.sort(flat).values)
    for g in range(groups):  # stable: each group keeps its slots in increasing order
        slots = order[flat[order] == g]
        assert torch.equal(slots, torch.sort(slots).values)
    x = torch.tensor(rng.standard_normal((len(flat), k)))
    w = torch.tensor(rng.standard_normal((groups, n, k)))
    got = tg.grouped_products(x[order], w, offs, tg.loop_grouped_mm)
    want = torch.stack([w[g] @ x[s] for s, g in zip(order.tolist(), flat[order].tolist())])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_loop_stand_in_matches_bmm(model: Model) -> None:
    """The grouped arm's routing, sort, offsets, SwiGLU and combine, with a plain per-group
    loop in place of torch's op (runs wherever torch does): the bmm arm's result."""
    peer = _peer(model, "cpu")
    arm = tg.GroupedMoE.alongside(peer, gmm=tg.loop_grouped_mm)
    h = _hidden(37, 1)
    want = peer.prefill(h).numpy()
    got = arm.prefill(h).numpy()
    assert got.shape == h.shape
    assert _update_nmse(got, want, h) < 1e-6


def test_weight_order_permutation(model: Model) -> None:
    """The streamed regime keeps weights in another order (resident experts first) and routes
    through pos_of (expert -> weight row): the same layer output as the natural order, up to
    the order in which index_add sums a token's top-k contributions (float32 rounding)."""
    peer = _peer(model, "cpu")
    arm = tg.GroupedMoE.alongside(peer, gmm=tg.loop_grouped_mm)
    h = torch.tensor(_hidden(29, 2))
    perm = torch.tensor(np.random.default_rng(7).permutation(SPEC.n_experts))  # row p: expert
    pos_of = torch.argsort(perm)  # expert -> row
    gu, dn = arm.w[0]
    with torch.inference_mode():
        want = arm._moe(h, 0, (gu, dn), None)
        got = arm._moe(h, 0, (gu[perm], dn[perm]), pos_of)
    assert not torch.equal(gu[perm], gu)
    assert _update_nmse(got.numpy(), want.numpy(), h.numpy()) < 1e-12


# ------------------------------------------------------------------ torch's grouped op
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_grouped_matches_bmm_and_f64(model: Model, device: str, tokens: int) -> None:
    """torch._grouped_mm's arm against the bmm arm (same bf16 operands, same rounding points)
    and against the float64 MoE on the dequantized weights (bf16 operands and products give
    about 4e-5 on these models; the bound leaves 5x)."""
    peer = _peer(model, device)
    arm = _grouped_or_skip(peer)
    h = _hidden(tokens, 10 + tokens)
    bmm = peer.prefill(h).cpu().numpy()
    got = arm.prefill(h).cpu().numpy()
    assert np.isfinite(got).all()
    assert _update_nmse(got, bmm, h) < 1e-5
    ref = reference_moe_f64(model, h)
    assert _update_nmse(got, ref, h) < 2e-4
    assert _update_nmse(bmm, ref, h) < 2e-4


def test_probe_names_the_path_on_cuda_and_cpu() -> None:
    assert "per-group mm loop on cpu" in tg.grouped_mm_path("cpu")
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        assert ("CUTLASS" in tg.grouped_mm_path("cuda")) == (major in (9, 10))


def test_probe_reports_missing_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    with pytest.raises(tg.GroupedMMUnavailable, match="has no torch._grouped_mm"):
        tg.probe("cpu", [(512, 512)])


def test_probe_reports_refused_shapes() -> None:
    """k = 12 bf16 values is a 24-byte row stride: torch's grouped op needs 16-byte strides
    (or has no CPU kernel at all); either way the reason names the shapes and torch's words."""
    if getattr(torch, "_grouped_mm", None) is None:
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    with pytest.raises(tg.GroupedMMUnavailable, match=r"refused bf16 \[5, 12\] x \[2, 12, 16\]"):
        tg.probe("cpu", [(12, 16)])


def test_probe_reports_wrong_results() -> None:
    def wrong(a, b, *, offs):
        return tg.loop_grouped_mm(a, b, offs=offs) * 2
    with pytest.raises(tg.GroupedMMUnavailable, match="disagrees"):
        tg.probe("cpu", [(64, 32)], gmm=wrong)
