"""The `strata` command: run, bench, inspect, profile, plugins, check-kernels.

Every StrataError ends as its message on stderr and its exit code (2 for a bad config or
budget, 1 otherwise), never a traceback: the user gave something wrong, and the message says
what and what would be valid. Tables and JSON go to stdout or files, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__
from .config import Config, load_config
from .errors import ConfigError, StrataError
from .progress import Progress
from .runtime.memory import MIB

GiB = 1 << 30
DEFAULT_ARCHS = ("sm_80", "sm_90")


# ------------------------------------------------------------------------------ helpers
def cuda_version(banner: str) -> str | None:
    """The CUDA version in nvidia-smi's header. Its line also carries the driver version
    (`Driver Version: 550.54.15   CUDA Version: 12.4`), so the field is found by its label."""
    found = re.search(r"CUDA Version:\s*([0-9][0-9.]*)", banner)
    return found.group(1) if found else None


def hardware_line() -> str:
    """GPU, driver, CUDA and PCIe link from nvidia-smi (or the CPU when there is no GPU):
    the line every recorded figure carries."""
    smi = shutil.which("nvidia-smi")
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    if smi is None:
        return f"no GPU (nvidia-smi absent); {cpu}; Python {platform.python_version()}"
    query = ("name,driver_version,pcie.link.gen.max,pcie.link.width.max,"
             "pcie.link.gen.current,pcie.link.width.current,memory.total")
    try:
        rows = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True).stdout
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=20).stdout
    except (subprocess.SubprocessError, OSError) as e:
        return f"nvidia-smi failed ({e}); {cpu}"
    cuda = cuda_version(banner) or "?"
    first = rows.strip().splitlines()[0] if rows.strip() else ""
    f = [x.strip() for x in first.split(",")]
    if len(f) < 7:
        return f"{first}; CUDA {cuda}; {cpu}"
    return (f"{f[0]}, driver {f[1]}, CUDA {cuda}, PCIe Gen{f[2]} x{f[3]} (now Gen{f[4]} "
            f"x{f[5]}), {f[6]}; {cpu}")


def _parse_prompts(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--prompts: got {text!r}; expected comma-separated token counts "
                          ">= 1, e.g. 254,1030", source="command line")
    return lengths


def _load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    if getattr(args, "prompts", None):
        cfg = cfg.with_prompt_lengths(_parse_prompts(args.prompts))
    if getattr(args, "backend", None):
        cfg = cfg.with_backend(args.backend)
    return cfg


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (readable as text, pastes into the README)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    def cell(c: str, w: int) -> str:  # numbers right, words left
        return c.rjust(w) if c[:1].isdigit() or c[:1] in "+-" else c.ljust(w)

    body = ["| " + " | ".join(cell(c, w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, rule, *body])


#: the 0/1 switches `bench --ab` may flip, with the engine config field each is resolved into
#: at open: only these are read again per prompt. The others (STRATA_CUDA_GRAPH,
#: STRATA_CHECK_PLAN, STRATA_PREFILL_TIMING) are taken once at open, so flipping them between
#: prompts would time the same code twice.
AB_SWITCHES = {"STRATA_PREFILL_GATHER_ONE": "gather_one"}


def set_switch(engine: Any, name: str, value: str) -> None:
    """Flips an A/B switch between prefills of one open engine: the environment (for code
    that reads it per call) and the engine config field it was resolved into at open."""
    os.environ[name] = value
    setattr(engine.config, AB_SWITCHES[name], value == "1")


def _write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _open_engine(cfg: Config, progress: Progress | None = None):
    from .engine import Engine

    ecfg = cfg.engine_config()
    if progress is not None:
        ecfg.progress = progress
    return Engine.open(ecfg)


def _resident(engine: Any) -> int:
    return int(engine.residency.count)


def _measure(engine: Any, hidden, progress: Progress | None, label: str):
    """One prefill timed with a host clock around the whole call (what a user waits for)."""
    if progress is not None:
        progress.start(label)
    t0 = time.perf_counter()
    try:
        out, stats = engine.prefill(hidden)
    finally:
        if progress is not None:
            progress.end()
    return out, stats, time.perf_counter() - t0


def _describe(cfg: Config, backend: str) -> str:
    g = cfg.spec
    model = str(cfg.gguf) if cfg.gguf else f"synthetic (seed {cfg.model_seed})"
    return (f"model {model}: {g.n_layers} layers, {g.n_experts} experts, top-{g.top_k}, "
            f"hidden {g.hidden}, ffn {g.ffn}; format {g.format}; backend {backend}; "
            f"prefill {cfg.prefill}")


# ------------------------------------------------------------------------------ commands
def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    progress = Progress()
    rows, records = [], []
    with _open_engine(cfg, progress) as engine:
        backend = engine.config.backend
        resident = _resident(engine)
        print(_describe(cfg, backend))
        print(f"resident experts: {resident} of {cfg.spec.total_experts}")
        n = len(cfg.prompts)
        for rep in range(cfg.repeats):
            for prompt in cfg.prompts:
                h = prompt.hidden_states(cfg.spec.hidden, cfg.seed)
                label = f"prompt {prompt.index + 1}/{n} ({prompt.label})"
                _, stats, wall = _measure(engine, h, progress, label)
                s = stats.as_dict()
                gbps = s["bytes_streamed"] / wall / 1e9 if wall > 0 else 0.0
                rows.append([prompt.index + 1, rep + 1, prompt.tokens, f"{wall * 1e3:.1f}",
                             f"{prompt.tokens / wall:,.0f}", s["experts_streamed"],
                             f"{s['bytes_streamed'] / MIB:,.1f}",
                             f"{gbps:.2f}" if backend == "cuda" else "-"])
                records.append({"prompt": prompt.index, "repeat": rep, "tokens": prompt.tokens,
                                "wall_s": wall, "tokens_per_s": prompt.tokens / wall,
                                "pcie_gb_s": gbps, "stats": s})
    print(markdown_table(["prompt", "repeat", "tokens", "time ms", "tokens/s", "experts streamed",
                  "streamed MiB", "PCIe GB/s"], rows))
    print("time: host clock around each prefill call; PCIe GB/s = bytes streamed / that time"
          + ("" if backend == "cuda" else " (cuda backend only)"))
    target = Path(args.json) if args.json else cfg.output.json
    if target is not None:
        _write_json(target, {"command": " ".join(sys.argv), "hardware": hardware_line(),
                             "config": str(cfg.source), "backend": backend,
                             "resident_experts": resident, "runs": records})
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    switch = args.ab
    if args.pairs < 1:
        raise ConfigError(f"--pairs: got {args.pairs}; expected >= 1", source="command line")
    cfg = _load(args)
    saved = os.environ.get(switch)
    runs: dict[int, dict[str, list[float]]] = {}
    try:
        with _open_engine(cfg) as engine:
            backend = engine.config.backend
            print(_describe(cfg, backend))
            print(f"resident experts: {_resident(engine)} of {cfg.spec.total_experts}; "
                  f"A: {switch}=0, B: {switch}=1; order A, B per pair, {args.pairs} pair(s)")
            warm = min(cfg.prompts, key=lambda p: p.tokens)
            launches = {}
            for value in ("0", "1"):  # compile and first allocations, outside the timing
                set_switch(engine, switch, value)
                _, stats = engine.prefill(warm.hidden_states(cfg.spec.hidden, cfg.seed))
                launches[value] = (stats.gathers_launched, stats.mmq_launches)
            same = launches["0"] == launches["1"]
            if same:
                print(f"WARNING: {switch}=0 and =1 launched the same kernels on the warm-up "
                      f"prompt {launches['0']} (gathers, MMQs): this backend did not take the "
                      "switch between prefills, so A and B ran the same code")
            for prompt in cfg.prompts:
                h = prompt.hidden_states(cfg.spec.hidden, cfg.seed)
                times = runs.setdefault(prompt.index, {"A": [], "B": []})
                for _ in range(args.pairs):
                    for arm, value in (("A", "0"), ("B", "1")):
                        set_switch(engine, switch, value)
                        times[arm].append(_measure(engine, h, None, "")[2])
    finally:
        if saved is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = saved
    rows, records = [], []
    for prompt in cfg.prompts:
        a, b = runs[prompt.index]["A"], runs[prompt.index]["B"]
        ma, mb = statistics.median(a), statistics.median(b)
        change = (mb - ma) / ma * 100
        rows.append([prompt.tokens, ", ".join(f"{t * 1e3:.1f}" for t in a),
                     ", ".join(f"{t * 1e3:.1f}" for t in b), f"{change:+.1f}",
                     f"{prompt.tokens / ma:,.0f} / {prompt.tokens / mb:,.0f}"])
        records.append({"tokens": prompt.tokens, "a_s": a, "b_s": b, "a_median_s": ma,
                        "b_median_s": mb, "change_pct": change})
    table = markdown_table(["prompt tokens", "A ms (each run)", "B ms (each run)", "change %",
                    "tokens/s (A / B, median)"], rows)
    print(table)
    print("time: host clock around each prefill call; change % = (median B - median A) / A")
    target = Path(args.json) if args.json else cfg.output.json or Path(
        f"strata-bench-{Path(args.config).stem}.json")
    _write_json(target, {"command": " ".join(sys.argv), "hardware": hardware_line(),
                         "config": str(cfg.source), "backend": backend, "switch": switch,
                         "a": f"{switch}=0", "b": f"{switch}=1", "pairs": args.pairs,
                         "arms_differ": not same,
                         "rows": records, "table": table})
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    # _type_name is gguf_io's private helper, imported so the GGML type names have one source
    from .gguf_io import _type_name, read_header, tensor_names
    from .model import MoESpec
    from .registry import registry

    if args.budget_gib is not None and not (math.isfinite(args.budget_gib)
                                            and args.budget_gib > 0):
        raise ConfigError(f"--budget-gib: got {args.budget_gib:g}; expected a VRAM size in "
                          "GiB > 0, e.g. 24", source="command line")
    reader, dims = read_header(Path(args.file))
    arch = dims.pop("arch")
    g = MoESpec(**dims)
    print(f"{args.file}: architecture {arch}")
    print(f"MoE: {g.n_layers} layers x {g.n_experts} experts = {g.total_experts} experts, "
          f"top-{g.top_k}, hidden {g.hidden}, ffn {g.ffn}, rms_eps {g.rms_eps:g}")

    types: dict[str, int] = {}
    for t in reader.tensors:
        if "_exps." in t.name:
            name = _type_name(t.tensor_type)
            types[name] = types.get(name, 0) + 1
    print("expert tensor types: " + (", ".join(f"{k} x{v}" for k, v in sorted(types.items()))
                                     or "none (no blk.N.ffn_*_exps tensors)"))
    wanted = [tensor_names(0)[p] for p in ("gate", "up", "down")]
    first = [t for t in reader.tensors if t.name in wanted]
    if first:
        print(markdown_table(["layer 0 tensor", "type", "shape", "MiB"],
                     [[t.name, _type_name(t.tensor_type), "x".join(str(int(x)) for x in reversed(t.shape)),
                       f"{int(t.n_bytes) / MIB:.2f}"] for t in first]))
        per_expert = sum(int(t.n_bytes) for t in first) // g.n_experts
        print(f"bytes per expert in the file (layer 0): {per_expert:,} "
              f"({per_expert / MIB:.2f} MiB)")
    budget = None if args.budget_gib is None else int(args.budget_gib * GiB)
    headers = ["format", "blob bytes", "slot bytes", "all experts GiB"]
    if budget is not None:
        headers += [f"experts in {args.budget_gib:g} GiB", "share"]
    rows = []
    for name, loaded in registry().formats.items():
        try:
            lay = loaded.format.layout(g.hidden, g.ffn)
        except StrataError as e:
            rows.append([name, f"n/a: {e}", "", ""] + (["", ""] if budget is not None else []))
            continue
        row = [name, f"{lay.blob_bytes:,}", f"{lay.slot_bytes:,}",
               f"{lay.slot_bytes * g.total_experts / GiB:.2f}"]
        if budget is not None:
            n = min(g.total_experts, budget // lay.slot_bytes)
            row += [f"{n:,}", f"{n / g.total_experts:.0%}"]
        rows.append(row)
    print(markdown_table(headers, rows))
    if budget is not None:
        print("a budget also holds one chunk's buffers and the ring: give it to a run as "
              "`vram_budget_mib` and the config sizes the split as the CUDA backend allocates it")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .residency import RoutingProfile

    cfg = _load(args)
    progress = Progress()
    counts = None
    with _open_engine(cfg, progress) as engine:
        for prompt in cfg.prompts:
            h = prompt.hidden_states(cfg.spec.hidden, cfg.seed)
            progress.start(f"profile prompt {prompt.index + 1} ({prompt.label})")
            try:
                _, stats = engine.prefill(h, record_routing=True)
            finally:
                progress.end()
            counts = stats.routing_counts if counts is None else counts + stats.routing_counts
    profile = RoutingProfile(counts=counts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    routed = int(counts.sum())
    where = out.resolve()  # a config resolves `profile:` against its own folder, not the cwd
    print(f"wrote {where}: routing counts of {sum(p.tokens for p in cfg.prompts)} tokens "
          f"({routed} expert choices) over {cfg.spec.n_layers} layers; use it with "
          f"`profile: {where}` in a config")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from .registry import registry

    rows = []
    for name, loaded in registry().formats.items():
        fmt = loaded.format
        rows.append([name, "yes" if fmt.native else "no", fmt.block_values, fmt.block_bytes,
                     len(fmt.kernel_sources()), ", ".join(fmt.mmq_variants()),
                     f"{loaded.plugin} ({loaded.origin})", fmt.description])
    print(markdown_table(["name", "native", "block values", "bytes per block", "kernels (.cu)",
                          "mmq variants", "origin", "description"], rows))
    return 0


def cmd_check_kernels(args: argparse.Namespace) -> int:
    from .registry import registry
    from .runtime.compile import check_kernels

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or any(not a.startswith("sm_") for a in archs):
        raise ConfigError(f"--arch: got {args.arch!r}; expected e.g. sm_80,sm_90",
                          source="command line")
    results = check_kernels(registry(), archs)
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.owner:10s} {r.arch}  {r.source.name}  "
              f"({r.seconds:.1f} s)")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\n{r.message}", file=sys.stderr)
    print(f"{len(results) - len(failed)} of {len(results)} compiled "
          f"({', '.join(archs)})")
    return 1 if failed else 0


# ------------------------------------------------------------------------------ parser
_EPILOGS = {
    "run": """examples:
  strata run configs/demo.yaml                       # backend from the config (auto)
  strata run configs/demo.yaml --backend reference   # numpy on the CPU, no GPU needed
  strata run configs/qwen3-30b-a3b-stream.yaml --prompts 8179 --json run.json

prints the model, the resident experts, then per prompt: tokens, time, tokens/s, experts and
bytes streamed, achieved PCIe GB/s. Progress goes to stderr on long prompts.""",
    "bench": """examples:
  strata bench configs/qwen3-30b-a3b-stream.yaml
  strata bench configs/demo.yaml --ab STRATA_PREFILL_GATHER_ONE --pairs 3 --json ab.json

A = the switch at 0, B = at 1, toggled in this process; each prompt runs A, B, A, B (one pair
per --pairs) after a warm-up of both arms. The table gives every run and the change of the
medians; the JSON carries the hardware line and the command.""",
    "inspect": """examples:
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf --budget-gib 24

shows the MoE geometry, the tensor types, bytes per expert in the file and in every loaded
format, and how many experts a VRAM budget holds.""",
    "profile": """examples:
  strata profile configs/qwen3-30b-a3b-stream.yaml --out qwen3-30b.profile.json

runs the config's prompts, counts how often each (layer, expert) is routed and writes a routing
profile; a config's `profile:` key then makes the most routed experts resident.""",
    "plugins": """examples:
  strata plugins
  strata --plugins my/plugins.yaml plugins

lists every loaded quantization format: native (batched gathers), block geometry, kernel
sources, MMQ variants (STRATA_MMQ_KERNEL picks one), where it came from (the plugins.yaml
that listed it, or an installed entry point) and its description.""",
    "check-kernels": """examples:
  strata check-kernels
  strata check-kernels --arch sm_90

compiles the shared kernels and every loaded format's kernels with nvcc (cached); exits 1 with
the compiler's message when one fails. No GPU needed.""",
}


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="strata", formatter_class=fmt,
        description="MoE prefill with quantized experts streamed through a VRAM slot cache.",
        epilog="start with:  strata run configs/demo.yaml\n"
               "each command explains itself:  strata run --help")
    parser.add_argument("--version", action="version", version=f"strata_rt {__version__}")
    parser.add_argument("--plugins", metavar="PATH",
                        help="the plugins.yaml to load instead of the one next to the package "
                             "(sets STRATA_PLUGINS)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=_EPILOGS[name],
                              formatter_class=fmt)

    p = command("run", "prefill the prompts of a config and summarise the run")
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.add_argument("--json", metavar="PATH", help="write the runs as JSON here")
    p.set_defaults(func=cmd_run)

    p = command("bench", "A/B an environment switch in one process over the prompts")
    p.add_argument("config", help="YAML run config")
    p.add_argument("--ab", default="STRATA_PREFILL_GATHER_ONE", choices=tuple(AB_SWITCHES),
                   metavar="SWITCH",
                   help="the 0/1 switch to compare: %(choices)s (default: %(default)s); only "
                        "switches the engine reads per prompt can change between A and B, "
                        "those it reads once at open cannot")
    p.add_argument("--pairs", type=int, default=2, help="A, B pairs per prompt (default 2)")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.add_argument("--json", metavar="PATH",
                   help="JSON output (default: output.json of the config, else "
                        "strata-bench-CONFIG.json)")
    p.set_defaults(func=cmd_bench)

    p = command("inspect", "MoE geometry, tensor formats and expert sizes of a GGUF file")
    p.add_argument("file", help="a GGUF file with blk.N.ffn_*_exps tensors")
    p.add_argument("--budget-gib", type=float, metavar="X",
                   help="also show how many experts X GiB of VRAM holds")
    p.set_defaults(func=cmd_inspect)

    p = command("profile", "record routing counts into a residency profile")
    p.add_argument("config", help="YAML run config whose prompts calibrate the routing")
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="profile to write")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.set_defaults(func=cmd_profile)

    p = command("plugins", "list the loaded quantization formats")
    p.set_defaults(func=cmd_plugins)

    p = command("check-kernels", "compile every loaded kernel with nvcc")
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                   help="comma-separated targets (default: %(default)s)")
    p.set_defaults(func=cmd_check_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.plugins:
            os.environ["STRATA_PLUGINS"] = str(Path(args.plugins).resolve())
            from .registry import registry

            registry(reload=True)
        return args.func(args)
    except StrataError as e:
        print(f"strata {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an output path that is a directory, a full disk, no permission
        where = e.filename if e.filename is not None else args.command
        print(f"strata: {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"strata {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "hardware_line", "main"]


if __name__ == "__main__":
    sys.exit(main())
