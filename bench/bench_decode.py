"""Greedy decode benchmark: tokens/s of a whole Qwen3-MoE config against its PCIe and HBM bounds.

A decode step prefills one token at the end of the KV cache (strata_rt.text.generate): each layer
routes it to top_k experts and only the routed experts are read. Three paths (STRATA_DECODE,
set per run with `--paths`): `routed` keeps the routed set on the device - gathers read routed
experts from their resident slots or straight from pinned host memory over PCIe - and replays
the step as a CUDA graph; `gemv` (what the engine's default, `auto`, takes wherever every
layer's format has the kernels) replays the same way but runs each layer's experts as two
matrix-vector launches over the routed experts, read where they lie (no gathers, no launch per
group of 16 experts; not bit-identical to routed, so its greedy tokens are compared with
routed's); `staging` reads the routed set back to the host every layer and copies the routed
non-resident experts through the staging ring. Regimes of one model (built once, seeded), each
on its own engine (every path runs on it):

- quarter: a quarter of the experts resident. Bound: PCIe, the bytes of the routed
  non-resident experts a step copies (measured) over the pinned host-to-device rate.
- all: every expert resident, nothing copied. Bound: HBM, the bytes a step must read (the
  routed experts' blobs, the dense layer slots, router and norms, the output head, and the KV
  cache up to the step's position) over the device-to-device copy rate.
- budget: as many experts resident as the config's VRAM budget holds (a 16 GiB card's share
  of the 235B shape); both bounds apply, and the PCIe one counts every byte a step streams
  (dense layers too, where they stream). llama.cpp has no such regime here.

Both rates are measured with torch in this process before an engine opens: pinned host ->
device copies of one expert blob (what each staging-ring copy moves) and of 64 MiB, and a
device -> device copy of 1 GiB (read + write bytes over time; the H200 datasheet says 4.8 TB/s).
Without torch or a GPU the bounds are left out and the table says so. The bound of a regime is
the smaller of its tokens/s bounds (copies overlap compute, so neither adds to the other).

Each regime runs `--warmups` short greedy runs first (kernels, cuBLAS heuristics, the prompt's
CUDA-graph trial), then one timed run of `--prompt` tokens and `--steps` greedy steps (EOS
ignored). Step times are host clocks around each step's prefill and argmax (what a user waits
for); host time is the engine's own count of seconds spent issuing work (Stats.host_s), so the
host share says whether the GPU waits on Python. With STRATA_PREFILL_TIMING=1 (or --timing) the
phase table of the last step is printed too: where a one-token step's time goes (instrumented
steps launch plainly and run slower). Results: <out>/decode-<config>-<time>.{json,md}.

    python bench/bench_decode.py                                  # the 30B shape, both regimes
    python bench/bench_decode.py --steps 128 --prompt 2048 --regimes quarter
    STRATA_PREFILL_TIMING=1 python bench/bench_decode.py --steps 16
    python bench/bench_decode.py --config configs/tiny-qwen3moe.yaml --backend reference
    python bench/bench_decode.py --paths gemv --llama-bench PATH   # with the llama.cpp column
    python bench/bench_decode.py --config configs/qwen3-235b-a22b-whole-16g.yaml \
        --regimes budget --paths gemv --steps 16               # the 235B shape under 16 GiB

With `--llama-bench`, llama.cpp decodes the same model first, in this process's run: the
config's synthetic model written once as a GGUF into `--peer-dir` (bench/peer_llama, the file
bench_peer_llama.py calls iq3: IQ3_XXS experts as stored, F16 dense), `llama-bench -p 0 -n
STEPS` per regime (quarter: the experts of 3/4 of the layers in host memory, -ncmoe), and the
table gains its tokens/s and ours/llama.cpp. llama-bench decodes from an empty context, this
benchmark after `--prompt` tokens (a longer KV cache per step), which the table's note says.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer_llama import llama  # noqa: E402
from peer_llama.files import ensure_file, shape_of  # noqa: E402
from torch_clock import cuda_seconds, pinned_h2d_gb_s  # noqa: E402

from strata_rt.cli.common import (  # noqa: E402
    display_path,
    hardware_line,
    markdown_table,
    output_arg,
    write_json,
)
from strata_rt.config.run.prompts import Prompt  # noqa: E402
from strata_rt.config.run.run_config import Config, load_config  # noqa: E402
from strata_rt.config.settings import env  # noqa: E402
from strata_rt.config.settings.engine_config import EngineConfig  # noqa: E402
from strata_rt.engine import Engine, backend_class, load_model  # noqa: E402
from strata_rt.models.qwen3.whole_memory import (  # noqa: E402
    DenseLayout,
    DenseTypes,
    tensor_bytes,
)
from strata_rt.report.stats import Stats  # noqa: E402
from strata_rt.runtime.memory import MIB  # noqa: E402
from strata_rt.text.generate import EngineSession, GenerateResult, greedy  # noqa: E402

#: the regimes: name -> share of the experts resident; None: as many as the config's VRAM
#: budget holds (its expert_cache, or what its budget leaves), which llama.cpp has no
#: counterpart for (its column stays empty there)
REGIMES: dict[str, float | None] = {"quarter": 0.25, "all": 1.0, "budget": None}
#: decode paths (STRATA_DECODE values); gemv's bytes differ from the others' (which agree)
PATHS = ("routed", "staging", "gemv")
EXACT_PATHS = ("routed", "staging")
#: H200 HBM3e bandwidth from the datasheet, bytes/s (quoted beside the measured rate)
H200_HBM_DATASHEET = 4.8e12


# ---------------------------------------------------------------------- ceilings (torch)
def measure_ceilings(blob_bytes: int) -> tuple[dict[str, float], str | None]:
    """Pinned H2D GB/s for copies of one expert blob and of 64 MiB, and the D2D rate of a
    1 GiB copy (read + written bytes), timed with CUDA events. -> (rates, None) or
    ({}, why they are missing)."""
    try:
        import torch
    except ImportError:
        return {}, "torch is not installed: no PCIe or HBM bound"
    if not torch.cuda.is_available():
        return {}, "torch sees no CUDA device: no PCIe or HBM bound"

    def d2d(n: int) -> float:
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        return 2 * n / cuda_seconds(torch, lambda: dst.copy_(src), 20) / 1e9

    out = {f"h2d_{label}_gb_s": v for label, v in
           pinned_h2d_gb_s(torch, {"blob": blob_bytes, "64mib": 64 * MIB}, reps=50).items()}
    out["d2d_gb_s"] = d2d(1 << 30)
    torch.cuda.empty_cache()
    return out, None


# ---------------------------------------------------------------------- what a step reads
def step_read_bytes(engine: Engine, position: float) -> dict[str, float]:
    """Bytes a one-token step at `position` must read from device memory, by part: the top_k
    routed experts' blobs of every layer, the dense layer slots (Wqkv and Wo in their types,
    norms), the router (fp16 hi and lo parts for the exact routing, whose float32 rows a
    re-ranked token reads too; fp16 for the f16 routing; else float32) and the MoE norms, the output head (Wout
    in its type and its norm) and the keys and values of positions 0..position (fp16)."""
    whole = engine.qwen3_spec
    assert whole is not None and engine.whole is not None
    types = DenseTypes.of_model(engine.whole)
    spec, layout = engine.model.spec, engine.model.layout
    L, H = spec.n_layers, spec.hidden
    router_bytes = {"exact": 4, "f16": 2}.get(engine.config.routing or "exact", 4)
    return {
        "experts": float(L * spec.top_k * layout.blob_bytes),
        "dense": float(DenseLayout.of(whole, types).resident_bytes),
        "router_norms": float(L * (spec.n_experts * H * router_bytes + H * 4)),
        "head": float(tensor_bytes(types.head, whole.vocab, H) + H * 4),
        "kv_cache": float(L * 2 * whole.kv_dim * 2 * (position + 1)),
    }


#: what a recorded session call returns beside its Stats (logits, or a greedy token)
T = TypeVar("T")


# ---------------------------------------------------------------------- one regime
class RecordingSession(EngineSession):
    """The engine session, keeping each prefill's Stats (per-step copies and phase tables);
    with `profile` set, each one-token step (not the prompt) runs inside the profiler's
    range."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.calls: list[Stats] = []
        #: whether one-token steps run inside the profiler's range (off for the warm-ups)
        self.profile = False

    def prefill(self, token_ids: Any, all_logits: bool = False
                ) -> tuple[np.ndarray, Stats | None]:
        return self._recorded(token_ids, lambda: super(RecordingSession, self).prefill(
            token_ids, all_logits))

    def prefill_argmax(self, token_ids: Any) -> tuple[int, Stats | None]:
        """A greedy step's token alone (how greedy decodes on an engine): recorded and
        profiled as prefill is, or its steps would be neither."""
        return self._recorded(token_ids, lambda: super(RecordingSession, self).prefill_argmax(
            token_ids))

    def _recorded(self, token_ids: Any, call: Callable[[], tuple[T, Stats | None]]
                  ) -> tuple[T, Stats | None]:
        ranged = self.profile and len(token_ids) == 1
        if ranged:
            profiler_range(True)
        try:
            out, stats = call()
        finally:
            if ranged:
                profiler_range(False)
        if stats is not None:
            self.calls.append(stats)
        return out, stats


def open_regime(base: EngineConfig, whole: Any, resident: int | None, timing: bool) -> Engine:
    """An engine on the already built model with `resident` experts in VRAM (None: what the
    config's budget gives)."""
    cfg = dataclasses.replace(base, model=whole,
                              expert_cache=base.expert_cache if resident is None else resident,
                              timing=True if timing else base.timing)
    return Engine.open(cfg)


def profiler_range(on: bool) -> None:
    """Opens (on) or closes the CUDA profiler's capture range (cuProfilerStart / Stop), which
    `ncu --profile-from-start off` and `nsys --capture-range=cudaProfilerApi` honour."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuProfilerStart() if on else lib.cuProfilerStop()
    if rc != 0:
        raise SystemExit(f"cuProfiler{'Start' if on else 'Stop'} failed: CUresult {rc}")


def run_regime(engine: Engine, ids: np.ndarray, steps: int, warmups: int,
               profile: bool = False) -> tuple[GenerateResult, list[Stats]]:
    """Warm-up runs of 4 steps, then the timed run of `steps` steps after the prompt's token
    -> (result, the steps' Stats). With `profile` the profiler's range covers the timed
    run's one-token steps."""
    session = RecordingSession(engine)
    for _ in range(warmups):
        greedy(session, ids, min(steps + 1, 5), eos_id=None)
    session.calls.clear()
    session.profile = profile
    result = greedy(session, ids, steps + 1, eos_id=None)  # the first token is the prompt's
    return result, session.calls[1:]  # calls[0] is the prompt's prefill


def summarise(name: str, engine: Engine, result: GenerateResult, step_stats: list[Stats],
              ceilings: dict[str, float]) -> dict[str, Any]:
    """One regime's record: step times, copies, host share, bounds and ratios."""
    n = len(result.step_wall_s)
    walls = np.asarray(result.step_wall_s)
    hosts = [h for h in result.step_host_s if h is not None]
    positions = result.prompt_tokens + np.arange(n)  # step i writes position prompt + i
    reads = step_read_bytes(engine, float(positions.mean()) if n else result.prompt_tokens)
    read_bytes = sum(reads.values())
    step_bytes = [s.bytes_streamed for s in step_stats]
    step_experts = [s.experts_streamed for s in step_stats]
    # a dense ring (a budget the dense part does not fit) copies every dense layer slot per
    # step as well; the counters count expert blobs only
    dense_streamed = reads["dense"] if getattr(engine.driver.executor, "dense_ring", None) \
        else 0.0
    bytes_per_step = (float(np.mean(step_bytes)) if step_bytes else 0.0) + dense_streamed
    tps = result.decode_tokens_per_s
    rec: dict[str, Any] = {
        "regime": name, "resident": int(engine.residency.count),
        "experts_total": engine.model.spec.n_layers * engine.model.spec.n_experts,
        "prompt_tokens": result.prompt_tokens, "steps": n, "ids": result.ids,
        "ttft_s": result.ttft_s, "prefill_tokens_per_s": result.prefill_tokens_per_s,
        "decode_tokens_per_s": tps,
        "step_wall_s": result.step_wall_s, "step_host_s": result.step_host_s,
        "step_ms_median": float(np.median(walls)) * 1e3 if n else None,
        "step_ms_p90": float(np.percentile(walls, 90)) * 1e3 if n else None,
        "host_ms_median": statistics.median(hosts) * 1e3 if hosts else None,
        "host_share": result.host_fraction,
        # the argmax and the loop around the engine call: host work Stats.host_s leaves out
        "outside_engine_ms_median": float(np.median(
            walls - np.asarray([s.wall_s for s in step_stats]))) * 1e3
        if n and len(step_stats) == n else None,
        "experts_per_step": float(np.mean(step_experts)) if step_experts else 0.0,
        "bytes_per_step": bytes_per_step, "dense_streamed_per_step": dense_streamed,
        "bytes_streamed_steps": int(sum(step_bytes)),
        "step_experts": step_experts, "step_bytes": step_bytes,
        "host_syncs_per_step": float(np.mean([s.host_syncs for s in step_stats]))
        if step_stats else None,
        "read_bytes_per_step": reads, "read_bytes_total_per_step": read_bytes,
        "pcie_gb_s_achieved": bytes_per_step / float(np.median(walls)) / 1e9 if n else None,
    }
    h2d = max((v for k, v in ceilings.items() if k.startswith("h2d_")), default=None)
    h2d_blob = ceilings.get("h2d_blob_gb_s")
    d2d = ceilings.get("d2d_gb_s")
    bounds = {}
    if h2d is not None and bytes_per_step > 0:
        bounds["pcie"] = h2d * 1e9 / bytes_per_step
        rec["pcie_bound_blob_rate_tokens_per_s"] = h2d_blob * 1e9 / bytes_per_step \
            if h2d_blob else None
    if d2d is not None:
        bounds["hbm"] = d2d * 1e9 / read_bytes
    rec["hbm_datasheet_bound_tokens_per_s"] = H200_HBM_DATASHEET / read_bytes
    rec["bounds_tokens_per_s"] = bounds
    rec["bound"] = min(bounds, key=bounds.__getitem__) if bounds else None
    rec["ours_over_bound"] = tps / bounds[rec["bound"]] if bounds and tps else None
    last = step_stats[-1] if step_stats else None
    rec["phase_table"] = None if last is None else last.phase_table
    return rec


def report(rec: dict[str, Any], args: argparse.Namespace) -> None:
    """One line per regime and path as it finishes (and its phase table when timed)."""
    trial = rec["decode_graph"]
    graph = "" if not trial else (f"; decode plan {trial.get('choice', 'plain')} (trial plain "
                                  f"{fmt(trial.get('plain'), '.2f', 1e3)} ms, graph "
                                  f"{fmt(trial.get('graph'), '.2f', 1e3)} ms)")
    print(f"{rec['regime']}: {rec['resident']} resident, opened in {rec['open_s']:.1f} s; "
          f"{fmt(rec['decode_tokens_per_s'], ',.1f')} tokens/s, step "
          f"{fmt(rec['step_ms_median'], ',.2f')} ms (p90 "
          f"{fmt(rec['step_ms_p90'], ',.2f')}), host share "
          f"{fmt(rec['host_share'], '.0%')}; {rec['experts_per_step']:.1f} experts "
          f"streamed per step{graph}", flush=True)
    if rec["phase_table"]:
        print(f"{rec['regime']}: where the last step's time goes (1 token at position "
              f"{args.prompt + args.steps - 1}):\n{rec['phase_table']}", flush=True)


def llama_decode(cfg: Config, args: argparse.Namespace, n_layers: int) -> dict[str, Any]:
    """llama-bench's decode of the config's model, per regime: {regime: {tokens_per_s (None
    when the command failed, whatever it printed before), command, error}} and the file
    (module doc)."""
    written = ensure_file(args.peer_dir, shape_of(cfg, False), "iq3")
    out: dict[str, Any] = {"file": written.path.name, "file_bytes": written.bytes,
                           "reused": written.reused, "regimes": {}}
    for name in args.regime_list:
        if REGIMES[name] is None:
            continue  # no llama.cpp counterpart of a VRAM budget
        cmd = llama.decode_command(args.llama_bench, written.path,
                                   llama.n_cpu_moe(name, n_layers), args.steps, 1)
        inv = llama.run(cmd, args.llama_timeout)
        rate = llama.decode_rate(inv.records)  # a run that failed shows no rate
        out["regimes"][name] = {"tokens_per_s": None if inv.error else rate,
                                "printed_tokens_per_s": rate, "command": llama.shown(cmd),
                                "error": inv.error}
    return out


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def row(rec: dict[str, Any], peer: dict[str, Any] | None = None) -> list[str]:
    """One table row; with `peer` (llama_decode's regimes) its two llama.cpp cells too."""
    b = rec["bounds_tokens_per_s"]
    tps = rec["decode_tokens_per_s"]

    def ratio(key: str) -> str:
        return "-" if key not in b or not tps else f"{tps / b[key]:.0%}"

    return [rec["regime"], f"{rec['resident']}/{rec['experts_total']}", fmt(tps, ",.1f"),
            fmt(rec["step_ms_median"], ",.2f"), fmt(rec["host_ms_median"], ",.2f"),
            fmt(rec["host_share"], ".0%"), f"{rec['experts_per_step']:,.1f}",
            f"{rec['bytes_per_step'] / MIB:,.1f}", fmt(b.get("pcie"), ",.1f"), ratio("pcie"),
            f"{rec['read_bytes_total_per_step'] / MIB:,.1f}", fmt(b.get("hbm"), ",.1f"),
            ratio("hbm"), fmt(rec["ttft_s"], ",.1f", 1e3)] + ([] if peer is None else
                                                              peer_cells(rec, peer))


def peer_cells(rec: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """llama.cpp's tokens/s in the record's regime and ours over it ('failed' if it did)."""
    got = peer.get(rec["regime"].split()[0], {})
    theirs, tps = got.get("tokens_per_s"), rec["decode_tokens_per_s"]
    if theirs is None:
        return ["failed" if got.get("error") else "-", "-"]
    return [f"{theirs:,.1f}", f"{tps / theirs:.2f}x" if tps else "-"]


HEADERS = ["regime and path", "resident", "tokens/s", "step ms", "host ms", "host share",
           "experts/step", "streamed MiB/step", "PCIe bound tok/s", "ours/PCIe",
           "read MiB/step", "HBM bound tok/s", "ours/HBM", "TTFT ms"]
PEER_HEADERS = ["llama.cpp tok/s", "ours/llama.cpp"]


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3-30b-a3b-whole.yaml"))
    ap.add_argument("--backend", help="override the config's backend (e.g. reference)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--steps", type=int, default=64,
                    help="timed greedy steps after the prompt's own token (default 64)")
    ap.add_argument("--regimes", default="quarter,all",
                    help=f"comma-separated, of {', '.join(REGIMES)} (default both)")
    ap.add_argument("--paths", default="gemv,routed",
                    help="comma-separated decode paths (STRATA_DECODE) to run in each regime, "
                         "in that order: routed, staging, gemv (default gemv,routed: what the "
                         "engine's default, auto, runs on a GGML model, then the exact path "
                         "its tokens are compared with)")
    ap.add_argument("--warmups", type=int, default=2,
                    help="untimed greedy runs of 4 steps per regime and path first (default 2)")
    ap.add_argument("--timing", action="store_true",
                    help="phase table of a step (as STRATA_PREFILL_TIMING=1; slows the steps)")
    ap.add_argument("--profile", action="store_true",
                    help="open the CUDA profiler's capture range around the timed one-token steps "
                         "(for ncu --profile-from-start off, or nsys "
                         "--capture-range=cudaProfilerApi)")
    ap.add_argument("--llama-bench", metavar="PATH",
                    help="llama.cpp's llama-bench: decode the same model with it first and add "
                         "its tokens/s to the table")
    ap.add_argument("--peer-dir", type=Path, default=Path.home() / ".cache" / "strata_rt" /
                    "peer-llama", help="where the config's model is written as a GGUF for "
                                       "llama-bench, once (default ~/.cache/strata_rt/peer-llama)")
    ap.add_argument("--llama-timeout", type=float, default=1800.0,
                    help="seconds each llama-bench command may take (default 1800)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="directory of the dated .json/.md results ('' for none)")
    args = ap.parse_args(argv)
    regimes = [r for r in args.regimes.replace(" ", "").split(",") if r]
    bad = [r for r in regimes if r not in REGIMES]
    if bad or not regimes:
        ap.error(f"--regimes: got {args.regimes!r}; allowed: {', '.join(REGIMES)}")
    if args.prompt < 1 or args.steps < 1 or args.warmups < 0:
        ap.error(f"--prompt {args.prompt}, --steps {args.steps}, --warmups {args.warmups}: "
                 "need a prompt of >= 1 token, >= 1 step and >= 0 warm-ups")
    args.regime_list = regimes
    paths = [p for p in args.paths.replace(" ", "").split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: got {args.paths!r}; allowed: {', '.join(PATHS)}")
    args.path_list = paths
    args.json_path = output_arg("--json", args.json) if args.json else None
    return args


def load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    if args.backend:
        cfg = cfg.with_backend(args.backend)
    if cfg.whole is None:
        raise SystemExit(f"{display_path(args.config)}: not a whole model (decoding needs one)")
    context = cfg.context or cfg.whole.context
    if args.prompt + args.steps + 1 > context:
        raise SystemExit(f"--prompt {args.prompt} + --steps {args.steps} + the prompt's token "
                         f"exceed the KV cache of {context} positions")
    return cfg.with_prompt_lengths([args.prompt])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load(args)
    base = cfg.engine_config()
    t0 = time.perf_counter()
    _, whole = load_model(base.model)
    assert whole is not None
    built = time.perf_counter() - t0
    spec, blob = whole.moe.spec, whole.moe.layout.blob_bytes
    total = spec.n_layers * spec.n_experts
    backend, _ = backend_class(base.backend)
    ceilings, missing = ({}, "the reference backend runs on the host: no PCIe or HBM bound") \
        if backend == "reference" else measure_ceilings(blob)
    timing = args.timing or env.flag("STRATA_PREFILL_TIMING")
    ids = Prompt(0, args.prompt).token_ids(whole.spec.vocab, cfg.seed)
    print(f"{hardware_line()}\n{display_path(args.config)}: built the model in {built:.1f} s; "
          f"{spec.n_layers} layers x {spec.n_experts} experts (top-{spec.top_k}), blob "
          f"{blob / MIB:.2f} MiB; prompt {args.prompt} tokens, {args.steps} steps", flush=True)
    if missing:
        print(f"note: {missing}", flush=True)
    else:
        print("ceilings: " + ", ".join(f"{k} {v:,.1f}" for k, v in ceilings.items())
              + f" (HBM datasheet {H200_HBM_DATASHEET / 1e9:,.0f} GB/s)", flush=True)
    if timing:
        print("note: timing on: steps launch with phase events and run slower", flush=True)
    peer = None
    if args.llama_bench:
        peer = llama_decode(cfg, args, spec.n_layers)
        for name, got in peer["regimes"].items():
            print(f"llama.cpp {name}: {fmt(got['tokens_per_s'], ',.1f')} tokens/s"
                  + (f" ({got['error']})" if got["error"] else ""), flush=True)
    records = []
    for name in args.regime_list:
        share = REGIMES[name]
        resident = None if share is None else round(total * share)
        t = time.perf_counter()
        with open_regime(base, whole, resident, timing) as engine:
            opened = time.perf_counter() - t
            for path in args.path_list:
                engine.config.decode = path  # the driver reads it on every step
                result, step_stats = run_regime(engine, ids, args.steps, args.warmups,
                                                     args.profile)
                rec = summarise(f"{name} {path}", engine, result, step_stats, ceilings)
                rec["path"], rec["open_s"] = path, opened
                rec["decode_graph"] = engine.driver.graph_trials.get(engine.driver.decode_key)
                records.append(rec)
                report(rec, args)
    headers = HEADERS + (PEER_HEADERS if peer else [])
    table = markdown_table(headers, [row(r, None if peer is None else peer["regimes"])
                                     for r in records])
    parts = "; ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in
                      records[0]["read_bytes_per_step"].items()) if records else ""
    notes = [f"read per step (HBM bound), at the mean position: {parts}",
             "bound = min(PCIe, HBM) tokens/s; PCIe: copied bytes per step (experts, and the "
             "dense layers where a dense ring streams them) over the best pinned H2D rate; "
             "HBM: read bytes per step over the measured D2D copy rate",
             "host share: engine host seconds (Stats.host_s) / step wall, summed over steps"]
    if missing:
        notes.insert(0, f"no bounds: {missing}")
    if peer is not None:
        cmds = "; ".join(f"`{g['command']}`" for g in peer["regimes"].values())
        notes.append(f"llama.cpp: the same model as {peer['file']} (IQ3_XXS experts as "
                     f"stored, F16 dense), {args.steps} tokens from an empty context (ours "
                     f"after {args.prompt} prompt tokens): {cmds}")
    exact = [r for r in records if r["path"] in EXACT_PATHS]
    same = len({tuple(r["ids"]) for r in exact}) <= 1
    if len(exact) > 1:
        notes.append("greedy tokens identical in every regime and path but gemv (streaming "
                     "changes no byte): " + ("yes" if same else "NO"))
    if any(r["path"] == "gemv" for r in records):
        match = all(tuple(r["ids"]) == tuple(exact[0]["ids"]) for r in records) if exact else None
        notes.append("gemv's greedy tokens equal the other paths': "
                     + ("no other path ran" if match is None else "yes" if match else "NO"))
    print(table + "\n" + "\n".join(f"- {n}" for n in notes))
    doc = {"command": " ".join(sys.argv), "hardware": hardware_line(), "config": display_path(args.config),
           "backend": backend, "prompt_tokens": args.prompt, "steps": args.steps,
           "timing": timing, "blob_bytes": blob, "ceilings": ceilings,
           "ceilings_missing": missing, "hbm_datasheet_gb_s": H200_HBM_DATASHEET / 1e9,
           "model_build_s": built, "ids_match": same, "regimes": records, "llama": peer,
           "table": table, "notes": notes}
    if args.json_path is not None:
        write_json(args.json_path, doc)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"decode-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        write_json(stem.with_suffix(".json"), doc)
        stem.with_suffix(".md").write_text(f"{doc['hardware']}\n\n`{doc['command']}`\n\n"
                                           f"{table}\n\n" + "\n".join(f"- {n}" for n in notes)
                                           + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
