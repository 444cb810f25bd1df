"""The grouped-GEMM PyTorch peer: the best a PyTorch user can do with the same IQ3_XXS blocks.

The bmm peer (torch_moe.TorchMoE) pads every expert's batch to the busiest expert, so at long
prompts a third or more of its tensor work multiplies zeros. A user who knows torch well does
not pad: rows sorted by expert form one ragged [rows, k] matrix, and ONE `torch._grouped_mm`
call per product multiplies each expert's run of rows by that expert's weights (on sm_90 and
sm_100 torch dispatches bf16 inputs to a CUTLASS grouped GEMM). Everything else is the bmm
peer's, inherited rather than rewritten, so the two arms differ only in the products:
- the same torch.compile'd IQ3_XXS dequantization into bf16 (torch_moe.dequantize_iq3_xxs),
  the same resident and streamed regimes (quantized blocks copied per layer on a copy stream);
- the same routing (RMSNorm, float32 router logits, softmax, top-k, renormalised weights);
- products: rows sorted by expert (stable), offsets = cumulative row counts as int32 on the
  device, gate/up by one grouped call, SwiGLU, down by one grouped call, combine by index_add.

torch._grouped_mm(mat_a [rows, k], mat_b [groups, k, n], offs=int32 [groups]) -> [rows, n];
group g covers rows offs[g-1]:offs[g]. The dequantized weights are [groups, n, k] (one row per
output), so mat_b is their transpose (a K-major view, no copy). The private op is probed once
with the real k and n before the arm is used: when torch lacks it or refuses the shapes, the
device or the dtype, construction raises GroupedMMUnavailable carrying torch's reason, which
the benchmarks print in the arm's row instead of quietly running something else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch_moe import TorchMoE

#: what torch's grouped op looks like: (mat_a, mat_b, *, offs) -> [rows, n]
GroupedMM = Callable[..., torch.Tensor]


class GroupedMMUnavailable(RuntimeError):
    """torch._grouped_mm cannot run this arm here; str() is the reason for the table row."""


def grouped_mm_path(device: torch.device | str) -> str:
    """Which implementation torch runs for bf16 inputs on `device`, as torch's dispatch decides
    it (the fast path needs compute capability 9.0 or 10.0; elsewhere torch loops over the
    groups with one mm each): a label for the benchmark rows, so a slow path is never hidden."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"torch {torch.__version__}: per-group mm loop on {dev.type}"
    major, minor = torch.cuda.get_device_capability(dev)
    if major in (9, 10):
        return f"torch {torch.__version__}: CUTLASS grouped GEMM (sm_{major}{minor})"
    return (f"torch {torch.__version__}: per-group mm loop (no grouped kernel for "
            f"sm_{major}{minor})")


def loop_grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *,
                    offs: torch.Tensor) -> torch.Tensor:
    """What torch._grouped_mm computes, one plain matmul per group: the stand-in where the
    op is missing (tests) and the check its result is compared with."""
    out = torch.zeros(mat_a.shape[0], mat_b.shape[-1], dtype=mat_a.dtype, device=mat_a.device)
    ends = offs.tolist()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = mat_a[start:end] @ mat_b[g]
        start = end
    return out


def probe(device: torch.device | str, shapes: list[tuple[int, int]],
          gmm: GroupedMM | None = None) -> str:
    """Runs the grouped op once per (k, n) on 2 groups of small random bf16 inputs and
    checks it against loop_grouped_mm; returns grouped_mm_path(device). Raises
    GroupedMMUnavailable with the reason when the op is missing, refuses, or disagrees."""
    dev = torch.device(device)
    if gmm is None:
        gmm = getattr(torch, "_grouped_mm", None)
        if gmm is None:
            raise GroupedMMUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    gen = torch.Generator(device="cpu").manual_seed(0)
    for k, n in shapes:
        a = torch.randn(5, k, generator=gen).to(dev, torch.bfloat16)
        w = torch.randn(2, n, k, generator=gen).to(dev, torch.bfloat16)
        offs = torch.tensor([2, 5], dtype=torch.int32, device=dev)
        try:
            got = gmm(a, w.transpose(1, 2), offs=offs)
        except Exception as e:  # noqa: BLE001 - torch's refusal is the reason we report
            raise GroupedMMUnavailable(
                f"torch._grouped_mm refused bf16 [5, {k}] x [2, {k}, {n}] on {dev}: "
                f"{type(e).__name__}: {str(e).strip().splitlines()[0]}") from e
        want = loop_grouped_mm(a.float(), w.transpose(1, 2).float(), offs=offs)
        if tuple(got.shape) != (5, n) or got.dtype != torch.bfloat16:
            raise GroupedMMUnavailable(
                f"torch._grouped_mm gave {got.dtype} {tuple(got.shape)} for k={k}, n={n}; "
                f"expected bfloat16 (5, {n})")
        err = float((got.float() - want).norm() / want.norm())
        if not err < 1e-2:  # bf16 output rounding is ~4e-3 relative
            raise GroupedMMUnavailable(
                f"torch._grouped_mm disagrees with a per-group matmul on {dev} for k={k}, "
                f"n={n}: relative error {err:.2e}")
    return grouped_mm_path(dev)


def sort_by_expert(flat: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed slots (one weight-group index per (token, k) slot) -> (order, offs): `order`
    lists the slots sorted by group (stable, so each group keeps token order), `offs` the
    cumulative row count per group as int32 on the same device (offs[g] = end of group g)."""
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_groups)
    return order, torch.cumsum(counts, 0).to(torch.int32)


def grouped_products(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                     gmm: GroupedMM) -> torch.Tensor:
    """x bf16 [rows, k] sorted by group, w bf16 [groups, n, k] (as dequantized: one row per
    output) -> bf16 [rows, n], one grouped call."""
    return gmm(x, w.transpose(1, 2), offs=offs)


class GroupedMoE(TorchMoE):
    """The grouped arm. Built like TorchMoE (same arguments, same weights and regimes) or from
    an existing bmm peer with `alongside`, which shares its weights instead of holding a second
    copy. Raises GroupedMMUnavailable when torch._grouped_mm cannot serve the shapes here."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._ready(None)

    @classmethod
    def alongside(cls, peer: TorchMoE, gmm: GroupedMM | None = None) -> GroupedMoE:
        """A grouped arm over `peer`'s weights, tables, buffers and streams (its resident bf16
        experts are 58 GB at the Qwen3-30B shape: one copy is all a GPU holds beside the
        engine). The two share the streamed regime's buffers: run one at a time."""
        arm = cls.__new__(cls)
        arm.__dict__.update(peer.__dict__)
        arm._ready(gmm)
        return arm

    def _ready(self, gmm: GroupedMM | None) -> None:
        """Probes the op on this peer's two product shapes; gmm replaces it (tests)."""
        shapes = [(self.H, 2 * self.F), (self.F, self.H)]  # (k, n): gate/up, down
        self.path = probe(self.dev, shapes, gmm)
        self.gmm: GroupedMM = gmm if gmm is not None else torch._grouped_mm

    def _moe(self, h: torch.Tensor, layer: int, w, pos_of: torch.Tensor | None) -> torch.Tensor:
        gu_w, dn_w = w
        xn, top_p, flat = self._route(h, layer, pos_of)  # TorchMoE's routing: both arms alike
        order, offs = sort_by_expert(flat, gu_w.shape[0])
        token = order // self.k
        x = xn[token].to(torch.bfloat16)
        gu = grouped_products(x, gu_w, offs, self.gmm)
        act = F.silu(gu[:, : self.F]) * gu[:, self.F:]
        y = grouped_products(act, dn_w, offs, self.gmm).float()
        y = y * top_p.reshape(-1)[order, None]
        return h.index_add(0, token, y)
