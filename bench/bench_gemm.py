"""Two-phase IQ3_XXS expert matmul (dequantizing gather into fp16 images, then the grouped fp16
GEMM of strata_rt/gemm/grouped_gemm.py) over a whole MoE layer, with PyTorch's bf16 peers measured
in the same process.

    python bench/bench_gemm.py [--models 30b,235b] [--tokens 512,2048,8192] [--reps 10]
                               [--tiles all|name,...] [--no-torch] [--json PATH]

Models: Qwen3-30B-A3B experts (hidden 2048, ffn 768) and Qwen3-235B-A22B experts (4096, 1536),
128 experts, top-8, the routing of bench_mmq.py (log-normal expert popularity), rows sorted by
expert. Per prompt length, CUDA events around whole phases (median of --reps after 2 warm-ups):
- dequant: the 8 batched dequantizing gathers of a layer (128 experts, 8 group buffers), beside
  one launch per expert and a device-to-device copy of the fp16 bytes written;
- GEMM: the 8 group launches of gate/up (m = 2*ffn, k = hidden) and of down (m = hidden,
  k = ffn), rows_hint = the group's busiest expert (the staging ring's hint) with the kernel
  GroupedGemm picks (own mma.sync tiles, or on sm_90 the CUTLASS tiles from
  grouped_gemm.CUTLASS_MIN_ROWS), the walk's hint (2 x mean rows) too, and every tile of --tiles
  forced (own and CUTLASS);
- effective TFLOPS = 2 * rows * (2*ffn*hidden + hidden*ffn) / time, rows = tokens * 8, for the
  GEMMs alone and with the dequant gather;
- the same GEMMs as the engine issues them (bench/engine_order.py): group by group (gate/up of
  group g, then its down into an output of its own, the walk's hint), captured once as a CUDA
  graph and replayed, on one compute lane and on two (group g on lane g % 2, lane 2 forked off
  the benchmark stream and joined back inside the capture), and the form the engine picks for
  the prompt (strata_rt.schedule.vram.lanes.chunk_lanes, lanes allocated as when every expert is
  resident). The plain figures above launch all 8 gate/up then all 8 down one by one on one stream,
  which pays each launch's host cost and leaves the GPU idle in each launch's last wave; the
  engine's replayed graph and second lane remove much of that (SwiGLU between the two GEMMs is left
  out here as in the plain figures);
- torch (bf16, weights resident): torch.bmm on per-expert batches padded to the busiest expert,
  torch._grouped_mm on the same ragged routing, and a dense torch.matmul of the same FLOPs.
torch runs first in its own context and is done before the strata_rt Runtime opens.
The markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_order import EngineOrder, lanes_text, layer_spec  # noqa: E402
from mmq_common import (  # noqa: E402
    EXPERTS,
    TOP_K,
    median_ms,
    routing,
    runtime_event_timer,
    tflops,
    torch_event_timer,
)

from strata_rt.formats.contract import MMQ_GROUP  # noqa: E402
from strata_rt.gemm.cutlass_gemm import CUTLASS_TILES  # noqa: E402
from strata_rt.gemm.grouped_gemm import TILES, GroupedGemm, fp16_image_layout  # noqa: E402
from strata_rt.quants.iq3_xxs import IQ3XXS  # noqa: E402

MODELS = {"30b": ("Qwen3-30B-A3B", 2048, 768), "235b": ("Qwen3-235B-A22B", 4096, 1536)}
#: distinct expert blobs; the 128 experts cycle through them (content does not change speed)
UNIQUE = 8
#: rows of random activations uploaded once and replicated on the device
POOL_ROWS = 4096
N_GROUPS = EXPERTS // MMQ_GROUP


def parts(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    return {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}


def layer_tflops(rows: int, hidden: int, ffn: int, ms: float) -> float:
    return tflops(rows, 1, 3 * hidden * ffn, ms)


def walk_hint(tokens: int) -> int:
    """The streamed walk's rows_hint (the CUDA executor's walk_rows_hint): twice the mean rows."""
    return max(1, min(tokens, -(-2 * tokens * TOP_K // EXPERTS)))


# ------------------------------------------------------------------------------ torch side
def torch_phase(models: list[str], counts: dict[int, np.ndarray], reps: int) -> dict:
    import torch

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    timer = torch_event_timer(torch)

    for model in models:
        _, hidden, ffn = MODELS[model]
        out: dict = {}
        for t, cnt in counts.items():
            rows, cap = int(cnt.sum()), int(cnt.max())
            offs = torch.tensor(np.cumsum(cnt), dtype=torch.int32, device=dev)
            row: dict = {"bmm": 0.0, "grouped_mm": 0.0, "dense": 0.0}
            for m, k in parts(hidden, ffn).values():
                def grouped(x, wt, offs=offs):
                    return torch._grouped_mm(x, wt, offs=offs, out_dtype=torch.bfloat16)

                w = torch.randn(EXPERTS, m, k, device=dev, dtype=torch.bfloat16)  # [E, n, k]
                xp = torch.randn(EXPERTS, cap, k, device=dev, dtype=torch.bfloat16)
                wt = w.transpose(1, 2)  # [E, k, n], k contiguous
                row["bmm"] += median_ms(lambda xp=xp, wt=wt: torch.bmm(xp, wt), reps, timer)
                del xp
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                try:
                    row["grouped_mm"] += median_ms(lambda x=x, wt=wt: grouped(x, wt), reps,
                                                   timer)
                except (RuntimeError, AttributeError, TypeError) as e:
                    row["grouped_mm"] = float("nan")
                    row["grouped_mm_error"] = f"{type(e).__name__}: {e}"[:200]
                wd = w[0].t()  # [k, m]
                row["dense"] += median_ms(lambda x=x, wd=wd: torch.matmul(x, wd), reps, timer)
                del w, wt, x, wd
                torch.cuda.empty_cache()
            for key in ("bmm", "grouped_mm", "dense"):
                row[f"{key}_tflops"] = layer_tflops(rows, hidden, ffn, row[key])
            out[t] = row
        res[model] = out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------ strata side
class LayerBench:
    """One model's layer on the device: 128 IQ3_XXS expert slots, the 8 groups' fp16 image
    buffers, sorted activations for the largest prompt, the output and the bounds."""

    def __init__(self, rt, stream, gg: GroupedGemm, model: str, max_rows: int,
                 rng: np.random.Generator):
        fmt = IQ3XXS()
        _, self.hidden, self.ffn = MODELS[model]
        self.rt, self.s, self.gg = rt, stream, gg
        self.lay = lay = fp16_image_layout(fmt.layout(self.hidden, self.ffn))
        self.shapes = parts(self.hidden, self.ffn)
        blobs = np.stack([fmt.random_expert(rng, self.hidden, self.ffn) for _ in range(UNIQUE)])
        self.slots = rt.alloc(EXPERTS * lay.slot_bytes)
        for e in range(EXPERTS):
            rt.memcpy_htod(self.slots.ptr + e * lay.slot_bytes, blobs[e % UNIQUE], stream)
        self.srcs = [self.slots.ptr + e * lay.slot_bytes for e in range(EXPERTS)]
        self.img = {"gate_up": lay.gate_up_image_bytes, "down": lay.down_image_bytes}
        self.bufs = {part: rt.alloc(EXPERTS * self.img[part]) for part in self.shapes}
        self.acts = {}
        for part, (_, k) in self.shapes.items():
            pool = rng.standard_normal((POOL_ROWS, k), dtype=np.float32).astype(np.float16)
            buf = self.acts[part] = rt.alloc(max_rows * k * 2)
            rt.memcpy_htod(buf.ptr, pool, stream)
            for r0 in range(POOL_ROWS, max_rows, POOL_ROWS):
                rt.memcpy_dtod(buf.ptr + r0 * k * 2, buf.ptr,
                               min(POOL_ROWS, max_rows - r0) * k * 2, stream)
        self.out = rt.alloc(max_rows * max(m for m, _ in self.shapes.values()) * 4)
        #: the down GEMM's output in engine order (the engine's down_out: two lanes in flight
        #: never write the same bytes)
        self.out_down = rt.alloc(max_rows * self.hidden * 4)
        self.bounds = rt.alloc((EXPERTS + 1) * 4)
        self.counts = np.zeros(EXPERTS, np.int64)

    def group_ptr(self, part: str, g: int) -> int:
        return self.bufs[part].ptr + g * MMQ_GROUP * self.img[part]

    def dequant(self, batched: bool) -> None:
        """The layer's 8 dequantizing gathers (or one launch per expert)."""
        for g in range(N_GROUPS):
            group = self.srcs[g * MMQ_GROUP: (g + 1) * MMQ_GROUP]
            gu, dn = self.group_ptr("gate_up", g), self.group_ptr("down", g)
            if batched:
                self.gg.dequant_gather_iq3(self.s, group, 0, gu, dn, self.lay)
            else:
                for p, src in enumerate(group):
                    self.gg.dequant_gather_iq3(self.s, [src], p, gu, dn, self.lay)

    def copy_fp16_bytes(self, scratch: int) -> None:
        """A device-to-device copy of as many bytes as the dequantizing gathers write."""
        for part in self.shapes:
            self.rt.memcpy_dtod(scratch, self.bufs[part].ptr, EXPERTS * self.img[part], self.s)

    def set_routing(self, counts: np.ndarray) -> None:
        self.counts = counts
        b = np.zeros(EXPERTS + 1, np.int32)
        b[1:] = np.cumsum(counts)
        self.rt.memcpy_htod(self.bounds.ptr, b, self.s)

    def hint(self, g: int, walk_tokens: int | None) -> int:
        """The staging ring's rows_hint (busiest expert of the group) or the walk's."""
        if walk_tokens is not None:
            return walk_hint(walk_tokens)
        return int(self.counts[g * MMQ_GROUP: (g + 1) * MMQ_GROUP].max())

    def launch(self, stream, part: str, g: int, hint: int, tile: str | None = None,
               out: int | None = None) -> None:
        """Group g's grouped GEMM launch of one part."""
        m, k = self.shapes[part]
        ids = tuple(range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP))
        self.gg.gemm(stream, self.group_ptr(part, g), ids, self.acts[part].ptr, self.bounds.ptr,
                     self.out.ptr if out is None else out, m, k, hint, tile=tile)

    def gemm(self, part: str, tile: str | None = None, walk_tokens: int | None = None) -> None:
        """The layer's 8 grouped GEMM launches of one part."""
        for g in range(N_GROUPS):
            self.launch(self.s, part, g, self.hint(g, walk_tokens), tile)

    def engine_group(self, stream, g: int, tokens: int) -> None:
        """Group g's products as the engine's walk issues them on its lane: gate/up, then down
        (into out_down), both sized by the walk's hint."""
        self.launch(stream, "gate_up", g, walk_hint(tokens))
        self.launch(stream, "down", g, walk_hint(tokens), out=self.out_down.ptr)

    def free(self) -> None:
        for buf in (self.slots, self.out, self.out_down, self.bounds, *self.bufs.values(),
                    *self.acts.values()):
            buf.free()


def bench_model(lb: LayerBench, counts: dict[int, np.ndarray], tiles: list[str], reps: int,
                timer, eo: EngineOrder) -> dict:
    lay, img = lb.lay, lb.img
    spec = layer_spec(lb.hidden, lb.ffn, EXPERTS, TOP_K)
    scratch = lb.rt.alloc(EXPERTS * img["gate_up"])
    res: dict = {"dequant": {
        "read_bytes": EXPERTS * lay.blob_bytes,
        "written_bytes": EXPERTS * (img["gate_up"] + img["down"]),
        "batched_ms": median_ms(lambda: lb.dequant(True), reps, timer),
        "one_per_expert_ms": median_ms(lambda: lb.dequant(False), reps, timer),
        "dtod_ms": median_ms(lambda: lb.copy_fp16_bytes(scratch.ptr), reps, timer),
    }, "tokens": {}}
    scratch.free()
    lb.dequant(True)
    for t, cnt in counts.items():
        lb.set_routing(cnt)
        rows = int(cnt.sum())
        row: dict = {"rows": rows, "rows_min": int(cnt.min()), "rows_max": int(cnt.max()),
                     "parts": {}}
        for part, (m, k) in lb.shapes.items():
            cell = {"auto_ms": median_ms(lambda part=part: lb.gemm(part), reps, timer),
                    "auto_tiles": sorted({lb.gg.tile_name(lb.hint(g, None))
                                          for g in range(N_GROUPS)}),
                    "walk_ms": median_ms(lambda part=part, t=t: lb.gemm(part, walk_tokens=t),
                                         reps, timer),
                    "walk_tile": lb.gg.tile_name(walk_hint(t)),
                    "tiles": {name: median_ms(lambda part=part, name=name: lb.gemm(part, name),
                                              reps, timer) for name in tiles}}
            cell["tflops"] = tflops(rows, m, k, cell["auto_ms"])
            row["parts"][part] = cell
        gemm_ms = sum(c["auto_ms"] for c in row["parts"].values())
        walk_ms = sum(c["walk_ms"] for c in row["parts"].values())
        row.update(gemm_ms=gemm_ms, gemm_tflops=layer_tflops(rows, lb.hidden, lb.ffn, gemm_ms),
                   walk_tflops=layer_tflops(rows, lb.hidden, lb.ffn, walk_ms),
                   layer_ms=gemm_ms + res["dequant"]["batched_ms"])
        row["layer_tflops"] = layer_tflops(rows, lb.hidden, lb.ffn, row["layer_ms"])
        # {graph_1_lane, graph_2_lanes, engine}: {"ms", "tflops"} (+ "lanes" for engine)
        row["engine_order"] = eo.measure(lambda s, g, t=t: lb.engine_group(s, g, t), N_GROUPS,
                                         reps, t, spec, 2.0 * rows * 3 * lb.hidden * lb.ffn)
        res["tokens"][t] = row
    return res


def strata_phase(models: list[str], counts: dict[int, np.ndarray], tiles: list[str], reps: int,
                 rng: np.random.Generator) -> dict:
    from strata_rt.runtime import Runtime

    rt = Runtime.open()
    res: dict = {"device": rt.name, "arch": rt.arch}
    s = rt.stream("bench")

    timer = runtime_event_timer(rt, s)

    t_compile = time.perf_counter()
    gg = GroupedGemm(rt)
    res["compile_s"] = time.perf_counter() - t_compile
    res["cutlass"] = gg._cutlass is not None
    if not res["cutlass"]:
        tiles[:] = [t for t in tiles if not t.startswith("cutlass_")]
    max_rows = max(int(c.sum()) for c in counts.values())
    eo = EngineOrder(rt, s, timer)
    for model in models:
        lb = LayerBench(rt, s, gg, model, max_rows, rng)
        try:
            res[model] = bench_model(lb, counts, tiles, reps, timer, eo)
        finally:
            s.synchronize()
            lb.free()
    rt.close()
    return res


# ------------------------------------------------------------------------------ report
def _short(name: str) -> str:
    return name.removeprefix("gemm_f16_").replace("cutlass_", "cl_")


def _cell(ms: float, rows: int, m: int, k: int) -> str:
    return f"{ms:.3f} / {tflops(rows, m, k, ms):.0f}"


def _engine_cells(eo: dict | None) -> list[str]:
    """graph 1 lane, graph 2 lanes, engine: 'TFLOPS (ms)', the engine's 'TFLOPS (lanes)'."""
    if eo is None:
        return ["-"] * 3
    e = eo["engine"]
    return ([f"{eo[key]['tflops']:.0f} ({eo[key]['ms']:.3f} ms)"
             for key in ("graph_1_lane", "graph_2_lanes")]
            + [f"{e['tflops']:.0f} ({lanes_text(e)})"])


def tables(res: dict, models: list[str], tiles: list[str]) -> str:
    st, tq = res["strata"], res.get("torch", {})
    lines = [f"# {st['device']} ({st['arch']}), torch {tq.get('torch', '-')}; kernels compiled "
             f"or loaded in {st['compile_s']:.1f} s", ""]
    for model in models:
        name, hidden, ffn = MODELS[model]
        d = st[model]["dequant"]
        gb = (d["read_bytes"] + d["written_bytes"]) / 1e9
        lines.append(
            f"{name} dequantizing gather, 128 experts: batched {d['batched_ms']:.3f} ms "
            f"({gb / d['batched_ms'] * 1e3:.0f} GB/s read+written), one launch per expert "
            f"{d['one_per_expert_ms']:.3f} ms, DtoD copy of the fp16 bytes {d['dtod_ms']:.3f} ms")
    if tiles:
        lines += ["", "Tile sweep (ms / TFLOPS of the part; rows_hint = the group's busiest "
                  "expert):", "",
                  "| model | tokens | part | auto (tiles) | "
                  + " | ".join(_short(n) for n in tiles) + " |",
                  "|---|---|---|---|" + "---|" * len(tiles)]
        for model in models:
            _, hidden, ffn = MODELS[model]
            for t, r in st[model]["tokens"].items():
                for part, (m, k) in parts(hidden, ffn).items():
                    c = r["parts"][part]
                    best = min(c["tiles"], key=c["tiles"].get)
                    cells = [("**" if n == best else "") + _cell(c["tiles"][n], r["rows"], m, k)
                             + ("**" if n == best else "") for n in tiles]
                    lines.append(f"| {model} | {t} | {part} | "
                                 f"{_cell(c['auto_ms'], r['rows'], m, k)} "
                                 f"({','.join(_short(a) for a in c['auto_tiles'])}) | "
                                 + " | ".join(cells) + " |")
    lines += ["", "Whole MoE layer, effective TFLOPS = 2 * rows * 3 * hidden * ffn / time "
              "(torch: bf16, weights resident). graph 1 lane / 2 lanes: the walk-hint GEMMs in "
              "engine order (group by group, gate/up then down), one CUDA graph replayed (the "
              "replay's ms beside); engine (lanes): the form chunk_lanes picks:", "",
              "| model | tokens | rows/expert min-max | dequant ms | GEMM gate/up ms | GEMM down ms "
              "| GEMM TFLOPS | walk-hint GEMM TFLOPS | graph 1 lane TFLOPS | graph 2 lanes TFLOPS "
              "| engine (lanes) TFLOPS | dequant + GEMM TFLOPS | torch.bmm padded "
              "| torch._grouped_mm | dense bf16 matmul |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        name = MODELS[model][0]
        d = st[model]["dequant"]
        for t, r in st[model]["tokens"].items():
            p = tq.get(model, {}).get(t, {})

            def peer(key: str, p=p) -> str:
                v = p.get(f"{key}_tflops")
                return "-" if v is None or v != v else f"{v:.0f}"

            cells = [f"{r['rows_min']}-{r['rows_max']}", f"{d['batched_ms']:.3f}",
                     f"{r['parts']['gate_up']['auto_ms']:.3f}",
                     f"{r['parts']['down']['auto_ms']:.3f}", f"{r['gemm_tflops']:.0f}",
                     f"{r['walk_tflops']:.0f}", *_engine_cells(r.get("engine_order")),
                     f"{r['layer_tflops']:.0f}", peer("bmm"), peer("grouped_mm"), peer("dense")]
            lines.append(f"| {name} | {t} | " + " | ".join(cells) + " |")
    errors = {f"{m}/{t}": p["grouped_mm_error"] for m in models
              for t, p in tq.get(m, {}).items() if "grouped_mm_error" in p}
    if errors:
        lines.append(f"torch._grouped_mm failed: {errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="30b,235b")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiles", default="all", help="tiles to force in the sweep: all, none or "
                    "comma-separated names")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown models {bad}; valid: {', '.join(MODELS)}")
    names = [t.name for t in TILES] + [t.name for t in CUTLASS_TILES]
    tiles = names if a.tiles == "all" else [] if a.tiles == "none" else a.tiles.split(",")
    if set(tiles) - set(names):
        ap.error(f"unknown tiles {sorted(set(tiles) - set(names))}; valid: {', '.join(names)}")
    rng = np.random.default_rng(a.seed)
    counts = {int(t): routing(rng, int(t)) for t in a.tokens.split(",")}
    start = time.perf_counter()
    res: dict = {"command": " ".join(sys.argv), "models": {m: MODELS[m] for m in models},
                 "experts": EXPERTS, "top_k": TOP_K,
                 "rows_per_expert": {t: c.tolist() for t, c in counts.items()}}
    if not a.no_torch:
        try:
            res["torch"] = torch_phase(models, counts, a.reps)
        except ImportError as e:
            res["torch_skipped"] = str(e)
    res["strata"] = strata_phase(models, counts, tiles, a.reps, rng)
    res["seconds"] = time.perf_counter() - start
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    print(tables(res, models, tiles))
    print(f"\n(run took {res['seconds']:.0f} s; median of {a.reps} after 2 warm-ups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

