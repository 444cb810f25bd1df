"""IQ3_XXS MMQ and gather throughput on the Qwen3-30B-A3B expert shapes, with the peers and
ceilings measured in the same process.

    python bench/bench_mmq.py [--tokens 512,2048,8192] [--variants f16_gemm,f16_pipe]
                              [--reps 10] [--no-torch] [--json PATH]

For each prompt length: realistic random top-8 routing over 128 experts (expert popularity
log-normal, so rows per expert vary), rows sorted by expert; our MMQ (each variant, default
all: f16_gemm, the default, beside the exact q8_1 kernels) over all 8 groups of 16 experts for
gate/up (1536 x 2048 fused) and down (2048 x 768), timed with CUDA events around the 8 launches
(median of --reps after 2 warm-ups). Each variant runs through its own format object
(IQ3XXS().for_variant): its gather fills the group buffers (f16_gemm: dequantized fp16 images)
and its activation encoding feeds it. Effective TFLOPS = 2 * rows * m * k / time,
rows = tokens * 8; "layer+gather" adds the variant's batched gather of all 128 experts (the
dequantization is part of f16_gemm's cost). Beside it, the two PyTorch peers (bench/peers) on
bf16 weights dequantized from the same blocks: (a) torch.bmm with per-expert batches padded to
the busiest expert, (b) one torch._grouped_mm per product over the ragged per-expert row runs
(offsets = cumulative row counts, int32 on the device; the arm's row says which implementation
torch runs, or why it cannot run); their "layer+gather" adds the torch.compile'd dequantization
of all 128 experts' blocks to bf16 (what the peers pay per streamed layer). Then (c) dense bf16
torch.matmul and torch._int_mm int8 at 8192^3, (d) llama.cpp's figures from the project's
design notes (constants measured on the same kind of H200, not here). Then gather_batch
bandwidth against a device-to-device copy of the same bytes, for each gather kind (byte copy,
dequantizing). Last, f16_gemm's layer in the engine's issue order (bench/engine_order.py), not
every gather, then 8 gate/up, then 8 down launched one by one: group by group ([its gather,]
gate/up, down, the same rows_hint) on lane g % lanes, captured once as a CUDA graph and
replayed, on one lane and on two, and the lanes the engine picks
(strata_rt.schedule.vram.lanes.chunk_lanes).

torch runs first, in its own (primary) context, and is done before the strata_rt Runtime opens;
the two never share memory, so their contexts cannot interfere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from engine_order import EngineOrder, forms_table, layer_spec  # noqa: E402
from mmq_common import (  # noqa: E402
    EXPERTS,
    FFN,
    HIDDEN,
    PARTS,
    TOP_K,
    UNIQUE,
    median_ms,
    routing,
    runtime_event_timer,
    tflops,
)
from mmq_torch import interop_check, torch_phase  # noqa: E402

from strata_rt.formats.activations import ActivationKernels  # noqa: E402
from strata_rt.formats.contract import MMQ_GROUP  # noqa: E402
from strata_rt.formats.ggml_format import F16_FUSED, F16_GEMM  # noqa: E402
from strata_rt.quants.iq3_xxs import IQ3XXS  # noqa: E402

#: the variants also timed in the engine's issue order (f16_fused's "layer" there is what its
#: products cost when they read resident slots in place, with no gather)
ENGINE_ORDER_VARIANTS = (F16_GEMM, F16_FUSED)
#: every STRATA_MMQ_KERNEL variant of IQ3_XXS (the exact ones, f16_gemm, f16_fused)
VARIANTS = IQ3XXS().mmq_variants()

#: llama.cpp's CUDA MMQ (MUL_MAT_ID, IQ3_XXS) on an H200, as measured on the same kind of H200 (project design notes)
LLAMA_CPP_TFLOPS = {512: (34, 37), 2048: (70, 79), 8192: (74, 95)}
LLAMA_CPP_SOURCE = "llama.cpp ggml CUDA MMQ, IQ3_XXS, measured on the same kind of H200 (design notes)"


def gather_kind(fmt) -> str:
    """What a variant's gather does: f16_gemm dequantizes into fp16 images; the exact kernels
    and f16_fused (which decodes blocks in its main loop) copy blob bytes."""
    lay = fmt.layout(HIDDEN, FFN)
    return "copy" if lay.gate_up_image_bytes == lay.gate_up_bytes else "dequant_f16"


def strata_phase(blobs: np.ndarray, counts_by_t: dict[int, np.ndarray], variants: list[str],
                 reps: int, rng: np.random.Generator) -> dict:
    """Each variant through its own format object (IQ3XXS().for_variant), as the engine runs
    it: its gathers fill the group buffers with its images (byte copies for the exact kernels,
    fp16 images for f16_gemm), its activation encoding, its MMQ."""
    from strata_rt.runtime import Runtime

    base = IQ3XXS()
    fmts = {v: base.for_variant(v) for v in variants}
    lays = {v: f.layout(HIDDEN, FFN) for v, f in fmts.items()}
    lay = base.layout(HIDDEN, FFN)
    rt = Runtime.open()
    res: dict = {"device": rt.name, "arch": rt.arch, "mmq": {}, "gather": {}}
    s = rt.stream("bench")

    timer = runtime_event_timer(rt, s)

    # all 128 expert blobs resident, one slot each; group buffers for the 8 groups, sized for
    # the largest images of the variants run
    slots = rt.alloc(EXPERTS * lay.slot_bytes)
    for e in range(EXPERTS):
        rt.memcpy_htod(slots.ptr + e * lay.slot_bytes, blobs[e % UNIQUE], s)
    n_groups = EXPERTS // MMQ_GROUP
    gu_buf = rt.alloc(EXPERTS * max(v.gate_up_image_bytes for v in lays.values()))
    dn_buf = rt.alloc(EXPERTS * max(v.down_image_bytes for v in lays.values()))
    kerns = {v: f.kernels(rt, lays[v]) for v, f in fmts.items()}

    def gather_groups(v: str, batched: bool, stream=s, groups=range(n_groups)) -> None:
        kern, vl = kerns[v], lays[v]
        for g in groups:
            gu = gu_buf.ptr + g * MMQ_GROUP * vl.gate_up_image_bytes
            dn = dn_buf.ptr + g * MMQ_GROUP * vl.down_image_bytes
            srcs = [slots.ptr + (g * MMQ_GROUP + p) * lay.slot_bytes for p in range(MMQ_GROUP)]
            if batched:
                kern.gather_batch(stream, srcs, 0, gu, dn)
            else:
                for p, src in enumerate(srcs):
                    kern.gather(stream, src, p, gu, dn)

    nbytes = EXPERTS * lay.blob_bytes
    dtod_dst = rt.alloc(nbytes)
    res["dtod_ms"] = median_ms(lambda: rt.memcpy_dtod(dtod_dst.ptr, slots.ptr, nbytes, s), reps,
                               timer)
    res["gather_bytes"] = nbytes
    dtod_dst.free()
    for v, f in fmts.items():
        kind = gather_kind(f)
        if kind not in res["gather"]:
            res["gather"][kind] = {
                "batched_ms": median_ms(lambda v=v: gather_groups(v, True), reps, timer),
                "single_ms": median_ms(lambda v=v: gather_groups(v, False), reps, timer),
                "written_bytes": EXPERTS * (lays[v].gate_up_image_bytes
                                            + lays[v].down_image_bytes),
                "fallbacks": getattr(kerns[v], "fallbacks", 0)}

    # activations: a pool of random float rows, picked through the index list per layer row
    pool_rows = 4096
    acts_k = ActivationKernels(rt)
    max_rows = max(int(c.sum()) for c in counts_by_t.values())
    xbuf = rt.alloc(pool_rows * HIDDEN * 4)
    rt.memcpy_htod(xbuf.ptr, rng.standard_normal((pool_rows, HIDDEN), dtype=np.float32), s)
    idx = rt.alloc(max_rows * 4)
    rt.memcpy_htod(idx.ptr, (np.arange(max_rows) % pool_rows).astype(np.int32), s)
    kinds = {f.activation.name: f.activation for f in fmts.values()}
    abuf = {(a, part): rt.alloc(act.nbytes(max_rows, k))
            for a, act in kinds.items() for part, (m, k) in PARTS.items()}
    out = rt.alloc(max_rows * max(m for m, _ in PARTS.values()) * 4)
    bounds = rt.alloc((EXPERTS + 1) * 4)
    # engine order: down writes an output of its own (the engine's down_out), so two lanes in
    # flight never write the same bytes
    out_down = rt.alloc(max_rows * HIDDEN * 4)
    outs = {"gate_up": out.ptr, "down": out_down.ptr}
    eo, spec = EngineOrder(rt, s, timer), layer_spec(HIDDEN, FFN, EXPERTS, TOP_K)

    for t, counts in counts_by_t.items():
        rows = int(counts.sum())
        b = np.zeros(EXPERTS + 1, np.int32)
        b[1:] = np.cumsum(counts)
        rt.memcpy_htod(bounds.ptr, b, s)
        for (a, part), buf in abuf.items():
            acts_k.launch(kinds[a], s, xbuf.ptr, HIDDEN, idx.ptr, buf.ptr, rows, PARTS[part][1])
        res["mmq"][t] = {"rows": rows, "rows_min": int(counts.min()),
                         "rows_max": int(counts.max())}
        for v, kern in kerns.items():
            gather_groups(v, True)  # this variant's images in the group buffers
            vl, a = lays[v], fmts[v].activation.name
            row = {}
            for part, (m, k) in PARTS.items():
                img = vl.gate_up_image_bytes if part == "gate_up" else vl.down_image_bytes
                buf = gu_buf.ptr if part == "gate_up" else dn_buf.ptr

                def launch_all(kern=kern, m=m, k=k, img=img, buf=buf, part=part, a=a,
                               counts=counts) -> None:
                    for g in range(n_groups):
                        ids = tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP))
                        hint = int(counts[list(ids)].max())
                        kern.mmq(s, buf + g * MMQ_GROUP * img, ids, abuf[(a, part)].ptr,
                                 bounds.ptr, out.ptr, m, k, hint)

                ms = median_ms(launch_all, reps, timer)
                row[part] = {"ms": ms, "tflops": tflops(rows, m, k, ms)}
            tot = row["gate_up"]["ms"] + row["down"]["ms"]
            row["layer"] = {"ms": tot, "tflops": tflops(rows, 1, 3 * HIDDEN * FFN, tot)}
            with_gather = tot + res["gather"][gather_kind(fmts[v])]["batched_ms"]
            row["layer+gather"] = {"ms": with_gather,
                                   "tflops": tflops(rows, 1, 3 * HIDDEN * FFN, with_gather)}
            res["mmq"][t][v] = row
            if v not in ENGINE_ORDER_VARIANTS:
                continue

            def group(stream, g: int, gather: bool, v=v, kern=kern, vl=vl, a=a,
                      counts=counts) -> None:  # group g on its lane: [gather,] gate/up, down
                if gather:
                    gather_groups(v, True, stream, (g,))
                ids = tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP))
                for part, buf, img in (("gate_up", gu_buf, vl.gate_up_image_bytes),
                                       ("down", dn_buf, vl.down_image_bytes)):
                    kern.mmq(stream, buf.ptr + g * MMQ_GROUP * img, ids, abuf[(a, part)].ptr,
                             bounds.ptr, outs[part], *PARTS[part], int(counts[list(ids)].max()))

            # {"layer", "layer+gather"}: {graph_1_lane, graph_2_lanes, engine}
            row["engine_order"] = {
                key: eo.measure(lambda st, g, gather=gather: group(st, g, gather), n_groups,
                                reps, t, spec, 2.0 * rows * 3 * HIDDEN * FFN)
                for key, gather in (("layer", False), ("layer+gather", True))}
    s.synchronize()
    rt.close()
    return res


def peer_cell(parts: dict | None, part: str, rows: int, dequant_ms: float | None) -> str:
    """A peer's 'ms / TFLOPS' for one row of the table: gate_up and down as timed, layer =
    their sum, layer+gather = layer + the dequantization of all 128 experts."""
    if not parts:
        return "-"
    if part in parts:
        return f"{parts[part]['ms']:.3f} / {parts[part]['tflops']:.0f}"
    ms = parts["gate_up"]["ms"] + parts["down"]["ms"]
    if part == "layer+gather":
        if dequant_ms is None:
            return "-"
        ms += dequant_ms
    return f"{ms:.3f} / {tflops(rows, 1, 3 * HIDDEN * FFN, ms):.0f}"


def table(res: dict, variants: list[str]) -> str:
    tq = res.get("torch", {})
    grouped = tq.get("grouped", {})
    dequant_ms = tq.get("dequant", {}).get("ms")
    lines = [f"# {res['strata']['device']} ({res['strata']['arch']}), torch "
             f"{tq.get('torch', '-')}",
             "tokens | rows/expert min-max | part | " + " | ".join(f"{v} ms / TFLOPS"
                                                                  for v in variants)
             + " | torch.bmm bf16 ms / TFLOPS | torch._grouped_mm bf16 ms / TFLOPS"
             " | llama.cpp TFLOPS"]
    for t, r in res["strata"]["mmq"].items():
        for part in ("gate_up", "down", "layer", "layer+gather"):
            cells = [f"{r[v][part]['ms']:.3f} / {r[v][part]['tflops']:.0f}" for v in variants]
            bmm = peer_cell(tq.get("bmm", {}).get(t), part, r["rows"], dequant_ms)
            if "unavailable" in grouped:
                grp = "n/a (see below)"
            else:
                grp = peer_cell(grouped.get("rows", {}).get(t), part, r["rows"], dequant_ms)
            lo, hi = LLAMA_CPP_TFLOPS.get(int(t), ("-", "-"))
            lines.append(f"{t} | {r['rows_min']}-{r['rows_max']} | {part} | "
                         + " | ".join(cells) + f" | {bmm} | {grp} | {lo}-{hi}")
    if "unavailable" in grouped:
        lines.append(f"torch._grouped_mm arm not run: {grouped['unavailable']}")
    elif grouped:
        lines.append(f"torch._grouped_mm arm: {grouped['path']}; operands as the grouped peer "
                     "passes them (rows sorted by expert, weights [experts, m, k] transposed)")
    if dequant_ms is not None:
        dq = tq["dequant"]
        lines.append(f"peers' dequantization of {dq['experts']} experts to bf16 ({dq['mode']}): "
                     f"{dequant_ms:.3f} ms, {dq['read_bytes'] / 1e6:.0f} MB read, "
                     f"{dq['written_bytes'] / 1e6:.0f} MB written "
                     f"({(dq['read_bytes'] + dq['written_bytes']) / dequant_ms / 1e6:.0f} GB/s); "
                     "the peers' layer+gather rows add it")
    if tq:
        lines.append(f"dense bf16 torch.matmul 8192^3: {tq['dense_bf16_tflops']:.0f} TFLOPS; "
                     f"dense int8 torch._int_mm: {tq['dense_int8_tops']:.0f} TOPS")
    lines.append(f"llama.cpp anchors: {LLAMA_CPP_SOURCE}: "
                 + ", ".join(f"{t}: {a}-{b}" for t, (a, b) in LLAMA_CPP_TFLOPS.items()))
    st = res["strata"]
    gb, dtod = st["gather_bytes"] / 1e9, st["dtod_ms"]
    for kind, g in st["gather"].items():
        wb = g["written_bytes"] / 1e9
        lines.append(
            f"gather {kind}, {gb * 1e3:.0f} MB read, {wb * 1e3:.0f} MB written (128 experts, 8 "
            f"groups): batched {g['batched_ms']:.3f} ms = {gb / g['batched_ms'] * 1e3:.0f} GB/s "
            f"read + {wb / g['batched_ms'] * 1e3:.0f} GB/s written, one per expert "
            f"{g['single_ms']:.3f} ms; cuMemcpyDtoD of the blobs {dtod:.3f} ms = "
            f"{gb / dtod * 1e3:.0f} GB/s (bytes copied); batched/DtoD = "
            f"{dtod / g['batched_ms']:.2f}; fallbacks {g['fallbacks']}")
    lines.append(f"torch after Runtime.open: {res.get('interop', '-')}")
    eng = [([v, str(t), part], r[v][part], r[v]["engine_order"][part])
           for v in ENGINE_ORDER_VARIANTS for t, r in res["strata"]["mmq"].items()
           if "engine_order" in r.get(v, {}) for part in ("layer", "layer+gather")]
    if eng:
        lines += forms_table("as the engine issues it (group by group on the group's lane, "
                             "[gather,] gate/up, down; one CUDA graph replayed; engine: the "
                             "lanes chunk_lanes picks), ms / TFLOPS:",
                             ["variant", "tokens", "part"], eng)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; valid: {', '.join(VARIANTS)}")
    rng = np.random.default_rng(a.seed)
    fmt = IQ3XXS()
    blobs = np.stack([fmt.random_expert(rng, HIDDEN, FFN) for _ in range(UNIQUE)])
    counts = {int(t): routing(rng, int(t)) for t in a.tokens.split(",")}
    res: dict = {"command": " ".join(sys.argv), "shapes": PARTS, "experts": EXPERTS,
                 "top_k": TOP_K, "llama_cpp_tflops": LLAMA_CPP_TFLOPS,
                 "llama_cpp_source": LLAMA_CPP_SOURCE}
    if not a.no_torch:
        res["torch"] = torch_phase(blobs, counts, a.reps)
    res["strata"] = strata_phase(blobs, counts, variants, a.reps, rng)
    if not a.no_torch:
        res["interop"] = interop_check()
    print(table(res, variants))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
