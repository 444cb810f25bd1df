"""`strata perplexity`: the perplexity of a text file under a config's whole model, over
non-overlapping windows (strata_rt.text.perplexity), with a per-window table and JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config.files.input_files import user_path
from ..errors import ConfigError
from ..report import interrupts
from .common import (
    StreamedTable,
    add_devices_flag,
    check_outputs,
    hardware_line,
    load,
    open_engine,
    output_arg,
    progress_for,
    whole_number,
    write_json,
)
from .generate import model_tokenizer, read_text

#: the window when --ctx is not given (llama.cpp's perplexity default), capped at the context
DEFAULT_CTX = 512
#: windows up to this many are printed as a table; more are summarised (the JSON has them all)
TABLE_WINDOWS = 32


WINDOW_HEADERS = ["window", "first token", "tokens", "mean NLL", "perplexity", "seconds"]


def window_row(i: int, w: Any) -> list[Any]:
    return [i + 1, w.start, w.tokens, f"{w.nll / w.predicted:.4f}", f"{w.perplexity:,.4f}",
            f"{w.seconds:.2f}"]



def cmd_perplexity(args: argparse.Namespace) -> int:
    from ..text.generate import EngineSession
    from ..text.perplexity import ScoreError, check_ctx, perplexity, windows_of

    if args.ctx is not None and args.ctx < 2:
        raise ConfigError(f"--ctx: got {args.ctx}; a window needs at least 2 tokens",
                          source="command line")
    target = output_arg("--json", args.json) if args.json is not None else None
    text = read_text("--file", args.file)
    if not text:
        raise ConfigError(f"--file: {args.file} is empty; perplexity needs text",
                          source="command line")
    cfg = load(args)
    check_outputs(cfg, {"--json": target}, {"the --file": user_path(args.file)})
    progress = progress_for(args)
    with open_engine(cfg, progress) as engine:
        session = EngineSession(engine)
        tokenizer = model_tokenizer(engine)
        ctx = args.ctx if args.ctx is not None else min(DEFAULT_CTX, session.context)
        if ctx > session.context:
            raise ConfigError(f"--ctx: got {ctx}; the model's context holds "
                              f"{session.context} tokens", source="command line")
        # a corpus is text: control-token markup in it is scored as the characters it is
        ids = tokenizer.encode(text, parse_special=False)
        check_ctx(ctx, session.context, len(ids))
        # each window's row as it finishes: a later failure or a signal loses none
        table = StreamedTable(WINDOW_HEADERS, [6, 11, 6, 8, 10, 7]) \
            if len(windows_of(len(ids), ctx)) <= TABLE_WINDOWS else None
        try:
            result = perplexity(session, ids, ctx, progress, on_window=None if table is None
                                else lambda i, w: table.add(window_row(i, w)))
        except ScoreError as e:  # the weights are the likely cause: the model is named
            raise ScoreError(f"{cfg.gguf}: {e}" if cfg.gguf else str(e)) from None
        backend = engine.config.backend
    if table is None and result.windows:
        each = sorted(w.perplexity for w in result.windows)
        print(f"{len(each)} windows: perplexity from {each[0]:,.4f} to {each[-1]:,.4f} "
              f"(median {each[len(each) // 2]:,.4f}); --json keeps every window's values")
    ppl = result.perplexity
    print(f"perplexity: {ppl:,.4f} over {result.predicted:,} predicted tokens of "
          f"{result.tokens:,} in {len(result.windows)} window(s) of up to {ctx} tokens "
          f"({result.tokens_per_s:,.0f} tokens/s, backend {backend})")
    if target is not None:
        write_json(target, {"command": " ".join(sys.argv), "config": str(cfg.source),
                            "file": str(args.file), "backend": backend,
                            "hardware": hardware_line(), **result.as_dict()})
    if result.interrupted:
        print(f"strata perplexity: {interrupts.how()} after {len(result.windows)} window(s); "
              "the perplexity above covers those", file=sys.stderr)
        return interrupts.exit_code()
    return 0


EPILOG = """examples:
  strata perplexity configs/tiny-qwen3moe.yaml --file README.md --ctx 128
  strata perplexity model.yaml --file wiki.test.raw --ctx 512 --json ppl.json

cuts the file's tokens into non-overlapping windows of --ctx tokens (default 512, at most the
model's context); each window starts from an empty KV cache and scores tokens 2..n of the
window from all positions' logits (log-softmax in float64). A last window shorter than --ctx
is kept when it has 2 tokens or more. Prints each window's mean NLL and perplexity and the
total, exp(total NLL / predicted tokens). The text is read as plain text: <|...|> markup is
scored as characters. llama.cpp's perplexity scores only the second half of each window, so
its figures are not comparable one to one. Ctrl-C keeps the finished windows (exit 130;
SIGTERM the same, exit 143)."""


def register(command) -> None:
    """Adds `perplexity`; `command(name, help, epilog)` makes a parser."""
    p = command("perplexity", "perplexity of a text file over non-overlapping windows", EPILOG)
    p.add_argument("config", help="YAML run config of a whole model (see configs/)")
    p.add_argument("--file", required=True, metavar="TEXT", help="UTF-8 text file to score")
    p.add_argument("--ctx", type=whole_number, metavar="N",
                   help=f"tokens per window (default {DEFAULT_CTX} or the model's context if "
                        "smaller; 2 to the context)")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    add_devices_flag(p)
    p.add_argument("--json", metavar="PATH", help="write the per-window values and the total")
    p.set_defaults(func=cmd_perplexity)
