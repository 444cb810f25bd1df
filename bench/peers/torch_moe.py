"""The PyTorch peer: strata_rt's MoE layers written the way a strong PyTorch user would.

Same model, same inputs, same process as the engine it is compared with:
- experts are the same IQ3_XXS blocks, dequantized to bf16 on the GPU by a vectorised torch
  function (torch.compile'd when that works) whose float32 result is bit-exact with gguf's
  numpy dequantizer (every step of IQ3_XXS decoding is exact in float32);
- routing in torch: RMSNorm, router logits in float32, softmax, top-k, renormalised weights;
- grouped products with torch.bmm over per-expert batches padded to the busiest expert
  (rows sorted by expert, one scatter in and one index_add out);
- two regimes. `resident`: every layer's bf16 experts live in VRAM. `streamed`: the same
  resident set as the engine stays in VRAM as quantized blocks, the other experts' blocks sit in
  pinned host memory and are copied per layer on a copy stream into one of two device buffers
  (double buffering with events), then dequantized next to the resident ones. Copying
  quantized blocks (231 MB a layer at the Qwen3-30B shape) instead of bf16 (1.2 GB) is what a
  careful user does when PCIe is the limit.

torch is imported here only; strata_rt itself never needs it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

QK = 256  # values per IQ3_XXS super-block
BLOCK_BYTES = 98


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 256-entry magnitude grid (from gguf, the reference implementation) and the 128
    sign masks (bits 0-6 = index, bit 7 = parity of its popcount), as device tensors."""
    from gguf.quants import IQ3_XXS

    if IQ3_XXS.grid is None:
        IQ3_XXS.init_grid()
    grid = torch.tensor(np.asarray(IQ3_XXS.grid).reshape(256, 4), dtype=torch.float32)
    idx = np.arange(128, dtype=np.uint32)
    parity = np.array([bin(i).count("1") & 1 for i in range(128)], dtype=np.uint32)
    masks = idx | (parity << 7)
    bits = (masks[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    signs = torch.tensor(1.0 - 2.0 * bits, dtype=torch.float32)  # [128, 8]: +1 / -1
    return grid.to(device), signs.to(device)


def dequantize_iq3_xxs(blocks: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., n_blocks * 98] (whole rows) -> [..., n_blocks * 256] in `dtype`; the
    float32 values are gguf's bit for bit, other dtypes round them once."""
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, BLOCK_BYTES)
    d = b[:, 0:2].contiguous().view(torch.float16).to(torch.float32)  # [n, 1]
    qs = b[:, 2:66].to(torch.int64)  # [n, 64] grid indices, 8 per 32 values
    aux = b[:, 66:98].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [n, 8]
    scale = d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5  # [n, 8]
    mag = grid[qs].reshape(-1, 8, 32)  # value 8l+j of sub-block ib: grid[qs[8ib+2l+j//4]][j%4]
    sign_idx = (aux[:, :, None] >> torch.tensor([0, 7, 14, 21], device=b.device)) & 127
    sgn = signs[sign_idx].reshape(-1, 8, 32)  # [n, 8, 4 groups * 8]
    w = scale[:, :, None] * mag * sgn
    return w.reshape(*lead, -1).to(dtype)


class TorchMoE:
    """The peer engine. `blobs(layer)` returns the layer's uint8 [n_experts, blob_bytes]
    (strata_rt's IQ3_XXS blob: gate rows, up rows, down rows)."""

    def __init__(self, *, router: np.ndarray, norm: np.ndarray,
                 blobs: Callable[[int], np.ndarray], hidden: int, ffn: int, top_k: int,
                 rms_eps: float, regime: str, resident: np.ndarray | None = None,
                 device: str = "cuda", compile: bool = True, layers: int | None = None):
        if regime not in ("resident", "streamed"):
            raise ValueError(f"regime {regime!r}: expected resident or streamed")
        self.dev = torch.device(device)
        self.L = layers if layers is not None else router.shape[0]
        self.E, self.H, self.F, self.k, self.eps = router.shape[1], hidden, ffn, top_k, rms_eps
        self.regime = regime
        self.router = torch.tensor(router[: self.L], device=self.dev)
        self.norm = torch.tensor(norm[: self.L], device=self.dev)
        self.grid, self.signs = _tables(self.dev)
        self.gu_bytes = 2 * ffn * hidden // QK * BLOCK_BYTES
        self.blob_bytes = self.gu_bytes + hidden * ffn // QK * BLOCK_BYTES
        self.deq = dequantize_iq3_xxs
        if compile and self.dev.type == "cuda":
            try:
                self.deq = torch.compile(dequantize_iq3_xxs, dynamic=False)
                self._weights(torch.zeros(1, self.blob_bytes, dtype=torch.uint8,
                                          device=self.dev))  # compile now, outside timing
            except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
                print(f"torch peer: torch.compile unavailable ({type(e).__name__}: {e}); "
                      "dequantizing eagerly", file=sys.stderr)
                self.deq = dequantize_iq3_xxs
        if regime == "resident":
            self.w = [self._weights(torch.from_numpy(np.ascontiguousarray(blobs(layer)))
                                    .to(self.dev)) for layer in range(self.L)]
            return
        mask = np.zeros((self.L, self.E), bool) if resident is None else resident[: self.L]
        self.order, self.res_blocks, self.host, self.n_res = [], [], [], []
        for layer in range(self.L):
            raw = np.ascontiguousarray(blobs(layer))
            res_ids = np.flatnonzero(mask[layer])
            str_ids = np.flatnonzero(~mask[layer])
            order = np.concatenate([res_ids, str_ids])  # weight row p holds expert order[p]
            self.order.append(torch.tensor(np.argsort(order), device=self.dev))  # expert -> p
            self.n_res.append(len(res_ids))
            self.res_blocks.append(torch.from_numpy(raw[res_ids]).to(self.dev))
            self.host.append(torch.from_numpy(raw[str_ids]).pin_memory())
        most = max(h.shape[0] for h in self.host)
        self.buf = [torch.empty(most, self.blob_bytes, dtype=torch.uint8, device=self.dev)
                    for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(self.dev)
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.used = [torch.cuda.Event() for _ in range(2)]
        self.streamed_bytes_per_chunk = sum(int(h.numel()) for h in self.host)

    def _weights(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blobs [n, blob_bytes] -> (gate/up [n, 2F, H], down [n, H, F]) in bf16."""
        n = raw.shape[0]
        gu = self.deq(raw[:, : self.gu_bytes].reshape(n, 2 * self.F, -1), self.grid,
                      self.signs, torch.bfloat16)
        dn = self.deq(raw[:, self.gu_bytes:].reshape(n, self.H, -1), self.grid, self.signs,
                      torch.bfloat16)
        return gu, dn

    def _issue_copy(self, layer: int) -> None:
        """Copy stream: streamed blocks of `layer` into buffer layer % 2, once the compute
        stream is done with what that buffer held two layers ago."""
        i = layer % 2
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.used[i])
            n = self.host[layer].shape[0]
            self.buf[i][:n].copy_(self.host[layer], non_blocking=True)
            self.copied[i].record(self.copy_stream)

    def _layer_weights(self, layer: int):
        if self.regime == "resident":
            return self.w[layer], None
        i = layer % 2
        torch.cuda.current_stream(self.dev).wait_event(self.copied[i])
        n_str = self.host[layer].shape[0]
        raw = torch.cat([self.res_blocks[layer], self.buf[i][:n_str]])
        w = self._weights(raw)
        self.used[i].record(torch.cuda.current_stream(self.dev))
        return w, self.order[layer]

    def _route(self, h: torch.Tensor, layer: int, pos_of: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RMSNorm, router softmax, top-k renormalised: (normed rows, top-k weights, the
        (token, k) pairs' expert positions flattened)."""
        xn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm[layer]
        p = torch.softmax(xn @ self.router[layer].T, dim=-1)
        top_p, ids = torch.topk(p, self.k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        flat = ids.reshape(-1) if pos_of is None else pos_of[ids.reshape(-1)]
        return xn, top_p, flat

    def _moe(self, h: torch.Tensor, layer: int, w, pos_of: torch.Tensor | None) -> torch.Tensor:
        gu_w, dn_w = w
        xn, top_p, flat = self._route(h, layer, pos_of)
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        token = order // self.k
        counts = torch.bincount(flat, minlength=self.E)
        starts = torch.cumsum(counts, 0) - counts
        row = torch.arange(flat.numel(), device=h.device) - starts[sorted_e]
        m = int(counts.max())
        x = torch.zeros(self.E, m, self.H, dtype=torch.bfloat16, device=h.device)
        x[sorted_e, row] = xn[token].to(torch.bfloat16)
        gu = torch.bmm(x, gu_w.transpose(1, 2))
        act = F.silu(gu[..., : self.F]) * gu[..., self.F:]
        y = torch.bmm(act, dn_w.transpose(1, 2))[sorted_e, row].float()
        y = y * top_p.reshape(-1)[order, None]
        return h.index_add(0, token, y)

    @torch.inference_mode()
    def prefill(self, hidden: np.ndarray | torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """float32 [T, H] -> float32 [T, H] on the device, chunk by chunk (MoE layers are
        token-independent, so chunks do not interact)."""
        h_all = torch.as_tensor(hidden, dtype=torch.float32).to(self.dev)
        outs = []
        for c0 in range(0, h_all.shape[0], chunk):
            h = h_all[c0: c0 + chunk]
            if self.regime == "streamed":
                self._issue_copy(0)
            for layer in range(self.L):
                if self.regime == "streamed" and layer + 1 < self.L:
                    self._issue_copy(layer + 1)
                w, pos_of = self._layer_weights(layer)
                h = self._moe(h, layer, w, pos_of)
            outs.append(h)
        return torch.cat(outs)
