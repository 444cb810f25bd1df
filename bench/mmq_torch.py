"""bench_mmq.py's torch side: the dense ceilings, the two PyTorch peers' products on bf16
weights dequantized from the same IQ3_XXS blocks (torch.bmm padded to the busiest expert;
torch._grouped_mm over the ragged rows), their torch.compile'd dequantization, and whether torch
still runs after a strata_rt Runtime opened its context in the same process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mmq_common import (
    EXPERTS,
    FFN,
    HIDDEN,
    PARTS,
    TOP_K,
    UNIQUE,
    median_ms,
    tflops,
    torch_event_timer,
)

from strata_rt.quants.iq3_xxs import IQ3XXS


def torch_phase(blobs: np.ndarray, counts_by_t: dict[int, np.ndarray], reps: int) -> dict:
    import torch
    from torch_moe import _tables, dequantize_iq3_xxs

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    timer = torch_event_timer(torch)

    def dense(dtype, op) -> float:
        n = 8192
        if dtype == torch.int8:
            a = torch.randint(-128, 127, (n, n), device=dev, dtype=dtype)
            b = torch.randint(-128, 127, (n, n), device=dev, dtype=dtype)
        else:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
        return tflops(n, n, n, median_ms(lambda: op(a, b), reps, timer))

    res["dense_bf16_tflops"] = dense(torch.bfloat16, torch.matmul)
    res["dense_int8_tops"] = dense(torch.int8, torch._int_mm)

    grid, signs = _tables(dev)
    lay = IQ3XXS().layout(HIDDEN, FFN)
    raw = torch.from_numpy(blobs).to(dev)
    gu = dequantize_iq3_xxs(raw[:, : lay.gate_up_bytes].reshape(UNIQUE, 2 * FFN, -1), grid,
                            signs).to(torch.bfloat16)
    dn = dequantize_iq3_xxs(raw[:, lay.down_offset:].reshape(UNIQUE, HIDDEN, -1), grid,
                            signs).to(torch.bfloat16)
    cycle = torch.arange(EXPERTS) % UNIQUE
    # as dequantized: [experts, m, k], one row per output (the grouped arm's K-major operand)
    w_mk = {"gate_up": gu[cycle], "down": dn[cycle]}
    # bmm's operand: [experts, k, m] contiguous
    w = {part: t.transpose(1, 2).contiguous() for part, t in w_mk.items()}
    del gu, dn
    res["dequant"] = dequant_phase(torch, raw[cycle], grid, signs, reps, timer)
    del raw
    res["bmm"] = bmm_phase(torch, w, counts_by_t, reps, timer)
    del w
    res["grouped"] = grouped_phase(torch, w_mk, counts_by_t, reps, timer)
    del w_mk
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def bmm_phase(torch: Any, w: dict, counts_by_t: dict[int, np.ndarray], reps: int,
              timer) -> dict:
    """The bmm peer's products: per prompt length, torch.bmm of every expert's batch padded to
    the busiest expert against w[part] (bf16 [experts, k, m]); {tokens: {part: ms, TFLOPS}}."""
    out: dict = {}
    for t, counts in counts_by_t.items():
        cap = int(counts.max())
        row = {}
        for part, (m, k) in PARTS.items():
            xp = torch.randn(EXPERTS, cap, k, device=w[part].device, dtype=torch.bfloat16)
            ms = median_ms(lambda xp=xp, wp=w[part]: torch.bmm(xp, wp), reps, timer)
            row[part] = {"ms": ms, "tflops": tflops(t * TOP_K, m, k, ms)}
            del xp
        out[t] = row
    return out


def dequant_phase(torch: Any, raw: Any, grid: Any, signs: Any, reps: int, timer) -> dict:
    """The peers' per-layer dequantization: all 128 experts' blocks (uint8 [128, blob]) to
    bf16 gate/up and down, by torch_moe's dequantizer torch.compile'd as the peers run it
    (eager, with the reason, where compiling fails)."""
    from torch_moe import dequantize_iq3_xxs

    lay = IQ3XXS().layout(HIDDEN, FFN)
    n = raw.shape[0]
    gu_raw = raw[:, : lay.gate_up_bytes].reshape(n, 2 * FFN, -1)
    dn_raw = raw[:, lay.down_offset:].reshape(n, HIDDEN, -1)
    mode = "torch.compile"
    deq = torch.compile(dequantize_iq3_xxs, dynamic=False)

    def run() -> None:
        deq(gu_raw, grid, signs, torch.bfloat16)
        deq(dn_raw, grid, signs, torch.bfloat16)

    try:
        run()  # compiles both shapes outside the timing
    except Exception as e:  # noqa: BLE001 - any compiler failure means: time it eager
        mode = f"eager (torch.compile failed: {type(e).__name__}: {e})"
        deq = dequantize_iq3_xxs
    return {"ms": median_ms(run, reps, timer), "mode": mode, "experts": n,
            "read_bytes": int(raw.numel()),
            "written_bytes": 2 * n * 3 * HIDDEN * FFN}


def grouped_phase(torch: Any, w_mk: dict, counts_by_t: dict[int, np.ndarray], reps: int,
                  timer) -> dict:
    """torch._grouped_mm over the ragged per-expert row runs (no padding), one call per part,
    as the grouped peer calls it; {"unavailable": reason} when torch cannot run it here."""
    from torch_grouped import GroupedMMUnavailable, grouped_products, probe

    dev = w_mk["down"].device
    try:
        path = probe(dev, [(k, m) for m, k in PARTS.values()])
    except GroupedMMUnavailable as e:
        return {"unavailable": str(e)}
    out: dict = {"path": path, "rows": {}}
    for t, counts in counts_by_t.items():
        rows = int(counts.sum())
        offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
        row = {}
        for part, (m, k) in PARTS.items():
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            ms = median_ms(lambda x=x, wp=w_mk[part], offs=offs: grouped_products(
                x, wp, offs, torch._grouped_mm), reps, timer)
            row[part] = {"ms": ms, "tflops": tflops(rows, m, k, ms)}
            del x
        out["rows"][t] = row
    return out


# ------------------------------------------------------------------------------ strata side


def interop_check() -> str:
    """Whether torch still runs after a strata_rt Runtime opened its context (same process)."""
    import torch

    from strata_rt.runtime import Runtime

    rt = Runtime.open()
    try:
        v = (torch.ones(1024, device="cuda") * 2).sum().item()
        return f"ok (torch op after Runtime.open gave {v})"
    except Exception as e:  # noqa: BLE001 - reported, not raised: it is what we measure
        return f"failed: {type(e).__name__}: {e}"
    finally:
        rt.close()
