"""`strata run`, `strata bench` and `strata profile`: the commands that open an engine and
prefill a config's prompts."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..report import interrupts
from ..runtime.memory import MIB
from .common import (
    StreamedTable,
    add_devices_flag,
    check_outputs,
    describe,
    hardware_line,
    load,
    markdown_table,
    measure,
    open_engine,
    output_arg,
    progress_for,
    resident_count,
    whole_number,
    write_json,
)

log = logging.getLogger(__name__)

#: the 0/1 switches `bench --ab` may flip, with the engine config field each is resolved into
#: at open: only these fields are read again on every chunk, so the bench flips the field.
#: The others (STRATA_CUDA_GRAPH, STRATA_CHECK_PLAN, STRATA_PREFILL_TIMING) are taken once at
#: open, so flipping them between prompts would time the same code twice.
AB_SWITCHES = {"STRATA_PREFILL_GATHER_ONE": "gather_one"}


#: what a run record keeps of a generate_after result (its prefill_s and time to first token
#: cover only the first choice there: the prompt's own time is the record's wall_s)
GENERATE_FIELDS = ("generated", "stop", "sampling", "decode_s", "decode_tokens_per_s",
                   "host_fraction", "step_wall_s", "experts_streamed", "bytes_streamed")


def set_switch(engine: Any, name: str, value: str) -> None:
    """Flips an A/B switch between prefills of one open engine: the engine config field it
    was resolved into at open, which the chunk driver reads on every chunk (nothing below the
    engine config reads the environment, so the environment is left as it is)."""
    setattr(engine.config, AB_SWITCHES[name], value == "1")


RUN_HEADERS = ["prompt", "repeat", "tokens", "time ms", "tokens/s", "experts streamed",
               "streamed MiB", "PCIe GB/s"]
#: A, B pairs per prompt: more is a typo, not a measurement (it would run for days)
MAX_PAIRS = 10_000
BENCH_HEADERS = ["prompt tokens", "A ms (each run)", "B ms (each run)", "change %",
                 "tokens/s (A / B, median)"]
#: room for the figures of long prompts, so the rows printed as they finish line up
RUN_WIDTHS = [6, 6, 7, 10, 9, 16, 12, 9]


def run_row(prompt: Any, rep: int, wall: float, s: dict, gbps: float, backend: str
            ) -> list[Any]:
    return [prompt.index + 1, rep + 1, prompt.tokens, f"{wall * 1e3:.1f}",
            f"{prompt.tokens / wall:,.0f}", s["experts_streamed"],
            f"{s['bytes_streamed'] / MIB:,.1f}", f"{gbps:.2f}" if backend == "cuda" else "-"]


def interrupted_note(command: str, done: int, total: int, what: str) -> int:
    """Says how many finished (after Ctrl-C or SIGTERM); -> the exit code (130, 143)."""
    print(f"strata {command}: {interrupts.how()} after {done} of {total} {what}; the results "
          "above are the finished ones", file=sys.stderr)
    return interrupts.exit_code()


def run_tokenizer(engine: Any) -> Any:
    """The model's tokenizer for printing generated text, or None (ids only) when it cannot be
    built: the GGUF carries no tokenizer keys or the `tokenizers` library is missing."""
    from ..errors import GGUFChangedError, GGUFError
    from ..text.tokenizer import TokenizerError

    try:
        return engine.tokenizer()
    except GGUFChangedError:
        raise  # the run cannot go on with the file
    except (GGUFError, TokenizerError) as e:
        log.warning("generated tokens are printed as ids only, with no EOS stop: %s", e)
        return None


def generate_after(engine: Any, logits: Any, n: int, tokenizer: Any, progress: Any,
                   label: str, sampling: Any = None, prompt_ids: Any = ()) -> dict[str, Any]:
    """The `generate: {tokens: N}` tokens after a prompt the caller prefilled and timed (its
    logits, its ids `prompt_ids`), greedy or drawn with `sampling` (the config's), printed as
    ids and text; -> their part of the prompt's JSON record. The decode steps are not part of
    the prompt's time, and draw no progress line."""
    from ..text.generate import EngineSession
    from ..text.generate import generate_after as decode_after

    eos = None if tokenizer is None else tokenizer.eos_token_id
    enabled, progress.enabled = progress.enabled, False
    try:
        result = decode_after(EngineSession(engine), logits, n, eos, sampling=sampling,
                              prompt_ids=prompt_ids)
    finally:
        progress.enabled = enabled
    rate = result.decode_tokens_per_s
    how = "greedy" if result.sampling is None else f"sampled (seed {result.sampling.seed})"
    print(f"{label}: {len(result.ids)} {how} tokens (stop: {result.stop}"
          + ("" if rate is None else f", decode {rate:,.1f} tokens/s") + "): "
          + " ".join(str(t) for t in result.ids), flush=True)
    text = None if tokenizer is None else tokenizer.decode(result.ids)
    if text is not None:
        print(f"{label}: text {text!r}", flush=True)
    return {"generated_ids": list(result.ids), "generated_text": text,
            "generate": {k: v for k, v in result.as_dict().items() if k in GENERATE_FIELDS}}


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load(args)
    target = output_arg("--json", args.json) if args.json is not None else cfg.output.json
    check_outputs(cfg, {"--json": target if args.json is not None else None})
    progress = progress_for(args)
    table = StreamedTable(RUN_HEADERS, RUN_WIDTHS)
    records: list[dict] = []
    total = cfg.repeats * len(cfg.prompts)
    doc: dict[str, Any] = {"command": " ".join(sys.argv), "config": str(cfg.source)}
    interrupted = False
    try:
        with open_engine(cfg, progress) as engine:
            backend = engine.config.backend
            resident = resident_count(engine)
            print(describe(cfg, backend))
            print(f"resident experts: {resident} of {cfg.spec.total_experts}", flush=True)
            for line in engine.split_lines:
                print(f"  {line}", flush=True)
            if engine.split_lines:
                doc["split"] = engine.split_lines
            doc.update(hardware=hardware_line(), backend=backend, resident_experts=resident)
            n_new = cfg.generate_tokens if engine.qwen3_spec is not None else 0
            tokenizer = run_tokenizer(engine) if n_new else None
            if n_new:
                doc["generate_tokens"] = n_new
            n = len(cfg.prompts)
            for rep in range(cfg.repeats):
                for prompt in cfg.prompts:
                    h = prompt.engine_input(engine, cfg.seed)
                    label = f"prompt {prompt.index + 1}/{n} ({prompt.label})"
                    logits, stats, wall = measure(engine, h, progress, label)
                    s = stats.as_dict()
                    gbps = s["bytes_streamed"] / wall / 1e9 if wall > 0 else 0.0
                    record = {"prompt": prompt.index, "repeat": rep, "tokens": prompt.tokens,
                              "wall_s": wall, "tokens_per_s": prompt.tokens / wall,
                              "pcie_gb_s": gbps, "stats": s, "phase_table": stats.phase_table}
                    if n_new:
                        record.update(generate_after(
                            engine, logits, n_new, tokenizer, progress,
                            f"prompt {prompt.index + 1}, repeat {rep + 1}", cfg.sampling, h))
                    records.append(record)
                    table.add(run_row(prompt, rep, wall, s, gbps, backend))
                    if stats.phase_table:
                        print(f"prompt {prompt.index + 1} ({prompt.tokens} tokens), repeat "
                              f"{rep + 1}:\n{stats.phase_table}", flush=True)
                        table.header_due = True  # the next row starts the table again
                    if target is not None and len(records) < total:
                        write_json(target, {**doc, "complete": False, "runs": records},
                                   final=False)
    except KeyboardInterrupt:
        if "backend" not in doc:  # nothing ran yet: nothing to keep
            raise
        interrupted = True
    if table.rows:
        print("time: host clock around each prefill call; PCIe GB/s = bytes streamed / that "
              "time" + ("" if doc["backend"] == "cuda" else " (cuda backend only)"))
        if cfg.whole is not None:
            print("whole model: each prompt starts from an empty KV cache; its time ends with "
                  "the last position's logits (the time to first token)"
                  + ("; the greedy tokens after it are not timed in" if cfg.generate_tokens
                     else ""))
    if target is not None:
        write_json(target, {**doc, "complete": not interrupted, "runs": records})
    if interrupted:
        return interrupted_note("run", len(records), total, "prompt runs")
    return 0


def bench_results(cfg: Any, runs: dict[int, dict[str, list[float]]]
                  ) -> tuple[list[list[Any]], list[dict]]:
    """Table rows and JSON records of the prompts with at least one finished A, B pair."""
    rows, records = [], []
    for prompt in cfg.prompts:
        times = runs.get(prompt.index, {"A": [], "B": []})
        pairs = min(len(times["A"]), len(times["B"]))
        if pairs == 0:
            continue
        a, b = times["A"][:pairs], times["B"][:pairs]
        ma, mb = statistics.median(a), statistics.median(b)
        change = (mb - ma) / ma * 100
        rows.append([prompt.tokens, ", ".join(f"{t * 1e3:.1f}" for t in a),
                     ", ".join(f"{t * 1e3:.1f}" for t in b), f"{change:+.1f}",
                     f"{prompt.tokens / ma:,.0f} / {prompt.tokens / mb:,.0f}"])
        records.append({"tokens": prompt.tokens, "a_s": a, "b_s": b, "a_median_s": ma,
                        "b_median_s": mb, "change_pct": change})
    return rows, records


def cmd_bench(args: argparse.Namespace) -> int:
    switch = args.ab
    if not 1 <= args.pairs <= MAX_PAIRS:
        raise ConfigError(f"--pairs: got {args.pairs}; expected 1..{MAX_PAIRS:,}",
                          source="command line")
    cfg = load(args)
    if args.json is not None:
        target = output_arg("--json", args.json)
    else:
        target = cfg.output.json or output_arg(
            "--json (default)", f"strata-bench-{Path(args.config).stem}.json")
    check_outputs(cfg, {"--json": target})
    streamed = StreamedTable(BENCH_HEADERS)
    runs: dict[int, dict[str, list[float]]] = {}
    doc: dict[str, Any] = {"command": " ".join(sys.argv), "config": str(cfg.source),
                           "switch": switch, "a": f"{switch}=0", "b": f"{switch}=1",
                           "pairs": args.pairs, "order": args.order}
    arms = (("A", "0"), ("B", "1")) if args.order == "ab" else (("B", "1"), ("A", "0"))
    interrupted = False
    try:
        with open_engine(cfg) as engine:
            backend = engine.config.backend
            print(describe(cfg, backend))
            print(f"resident experts: {resident_count(engine)} of {cfg.spec.total_experts}; "
                  f"A: {switch}=0, B: {switch}=1; order {', '.join(a for a, _ in arms)} "
                  f"per pair, {args.pairs} pair(s)",
                  flush=True)
            warm = min(cfg.prompts, key=lambda p: p.tokens)
            launches = {}
            for _, value in arms:  # compile and first allocations, outside the timing
                set_switch(engine, switch, value)
                engine.reset()
                _, stats = engine.prefill(warm.engine_input(engine, cfg.seed))
                launches[value] = (stats.gathers_launched, stats.mmq_launches)
            same = launches["0"] == launches["1"]
            if same:
                log.warning("%s=0 and =1 launched the same kernels on the warm-up prompt %s "
                            "(gathers, MMQs): this backend did not take the switch between "
                            "prefills, so A and B ran the same code", switch, launches["0"])
            doc.update(hardware=hardware_line(), backend=backend, arms_differ=not same)
            for prompt in cfg.prompts:
                h = prompt.engine_input(engine, cfg.seed)
                times = runs.setdefault(prompt.index, {"A": [], "B": []})
                for _ in range(args.pairs):
                    for arm, value in arms:
                        set_switch(engine, switch, value)
                        times[arm].append(measure(engine, h, None, "")[2])
                streamed.add(bench_results(cfg, {prompt.index: times})[0][0])
                if prompt is not cfg.prompts[-1]:
                    write_json(target, {**doc, "complete": False,
                                        "rows": bench_results(cfg, runs)[1]}, final=False)
    except KeyboardInterrupt:
        if "backend" not in doc:
            raise
        interrupted = True
    rows, records = bench_results(cfg, runs)
    for row in rows[streamed.rows:]:  # a prompt cut short after a finished pair
        streamed.add(row)
    table = markdown_table(BENCH_HEADERS, rows)
    if rows:
        print("time: host clock around each prefill call; change % = (median B - median A) / A")
    write_json(target, {**doc, "complete": not interrupted, "rows": records, "table": table})
    if interrupted:
        return interrupted_note("bench", len(records), len(cfg.prompts), "prompts")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ..schedule.vram.residency import RoutingProfile

    cfg = load(args)
    out = output_arg("--out", args.out)
    check_outputs(cfg, {"--out": out})
    progress = progress_for(args)
    counts, done = None, []
    try:
        with open_engine(cfg, progress) as engine:
            for prompt in cfg.prompts:
                h = prompt.engine_input(engine, cfg.seed)
                engine.reset()
                progress.start(f"profile prompt {prompt.index + 1} ({prompt.label})")
                try:
                    _, stats = engine.prefill(h, record_routing=True)
                finally:
                    progress.end()
                counts = stats.routing_counts if counts is None else counts + stats.routing_counts
                done.append(prompt)
    except KeyboardInterrupt:
        if counts is None:
            raise
    if counts is None:  # the config's validation requires a prompt; an empty list ran none
        raise ConfigError("no prompt ran: nothing to profile", source="profile")
    out.parent.mkdir(parents=True, exist_ok=True)
    RoutingProfile(counts=counts).save(out)
    routed = int(counts.sum())
    where = out.resolve()  # a config resolves `profile:` against its own folder, not the cwd
    print(f"wrote {where}: routing counts of {sum(p.tokens for p in done)} tokens "
          f"({routed} expert choices) over {cfg.spec.n_layers} layers; use it with "
          f"`profile: {where}` in a config")
    if len(done) < len(cfg.prompts):
        return interrupted_note("profile", len(done), len(cfg.prompts), "prompts")
    return 0


EPILOG_RUN = """examples:
  strata run configs/demo.yaml                       # backend from the config (auto)
  strata run configs/demo.yaml --backend reference   # numpy on the CPU, no GPU needed
  strata run configs/qwen3-30b-a3b-stream.yaml --prompts 8179 --json run.json

prints the model, the resident experts, then per prompt: tokens, time, tokens/s, experts and
bytes streamed, achieved PCIe GB/s. A whole-model config with `generate: {tokens: N}` also
prints the N greedy tokens after each prompt (ids, and text when the model has a tokenizer;
not part of the prompt's time) and its JSON runs carry `generated_ids`. Progress goes to stderr
on long prompts. Each prompt's row is printed as it finishes and the JSON rewritten; Ctrl-C
keeps the finished prompts (exit 130), as SIGTERM does (exit 143)."""

EPILOG_BENCH = """examples:
  strata bench configs/qwen3-30b-a3b-stream.yaml
  strata bench configs/demo.yaml --ab STRATA_PREFILL_GATHER_ONE --pairs 3 --json ab.json
  strata bench configs/qwen3-30b-a3b-whole.yaml --order ba   # one, batch, one, batch

A = the switch at 0, B = at 1, toggled in this process; each prompt runs A, B, A, B (one pair
per --pairs; --order ba: B, A, B, A) after a warm-up of both arms in the same order. The table
gives every run and the change of the medians; the JSON carries the hardware line and the
command."""

EPILOG_PROFILE = """examples:
  strata profile configs/qwen3-30b-a3b-stream.yaml --out qwen3-30b.profile.json

runs the config's prompts, counts how often each (layer, expert) is routed and writes a routing
profile; a config's `profile:` key then makes the most routed experts resident."""

def register(command) -> None:
    """Adds this module's subcommands; `command(name, help, epilog)` makes a parser."""
    p = command("run", "prefill the prompts of a config and summarise the run", EPILOG_RUN)
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    add_devices_flag(p)
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.add_argument("--json", metavar="PATH", help="write the runs as JSON here")
    p.set_defaults(func=cmd_run)
    p = command("bench", "A/B an environment switch in one process over the prompts", EPILOG_BENCH)
    p.add_argument("config", help="YAML run config")
    p.add_argument("--ab", default="STRATA_PREFILL_GATHER_ONE", choices=tuple(AB_SWITCHES),
                   metavar="SWITCH",
                   help="the 0/1 switch to compare: %(choices)s (default: %(default)s); only "
                        "switches the engine reads per prompt can change between A and B, "
                        "those it reads once at open cannot")
    p.add_argument("--pairs", type=whole_number, default=2, help="A, B pairs per prompt (default 2)")
    p.add_argument("--order", choices=("ab", "ba"), default="ab",
                   help="which arm runs first in each pair: ab (A then B, the default) or ba "
                        "(B then A: with STRATA_PREFILL_GATHER_ONE, one gather launch per "
                        "expert first, then batched)")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    add_devices_flag(p)
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.add_argument("--json", metavar="PATH",
                   help="JSON output (default: output.json of the config, else "
                        "strata-bench-CONFIG.json)")
    p.set_defaults(func=cmd_bench)
    p = command("profile", "record routing counts into a residency profile", EPILOG_PROFILE)
    p.add_argument("config", help="YAML run config whose prompts calibrate the routing")
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="profile to write")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    add_devices_flag(p)
    p.add_argument("--prompts", metavar="N,N", help="override `prompts` with these lengths")
    p.set_defaults(func=cmd_profile)
