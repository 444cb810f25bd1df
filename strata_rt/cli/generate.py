"""`strata generate`: a prompt in, the model's continuation out (greedy, or sampled with the
flags or the config's `generate:` sampling keys), printed as it is produced and followed by the
timing summary (time to first token, prefill and decode tokens/s, experts and bytes streamed).

Also the pieces `strata perplexity` shares: reading a text file given on the command line and
the tokenizer of a config's model, both failing with a message rather than a traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import replace
from typing import Any

from ..config.files.input_files import (
    DATA_LIMIT,
    TEXT_LIMIT,
    InputFileError,
    check_utf8,
    user_path,
)
from ..config.files.input_files import read_text as input_text
from ..errors import ConfigError, GGUFChangedError, GGUFError
from ..report import interrupts
from ..runtime.memory import MIB
from ..text.sampling import MAX_CANDIDATES, NAMES, SamplingParams, describe, sampling_problems
from .common import (
    check_outputs,
    hardware_line,
    load,
    open_engine,
    output_arg,
    progress_for,
    whole_number,
    write_json,
)

log = logging.getLogger(__name__)

#: what reads as a control token in a prompt (Qwen's `<|im_start|>` family)
SPECIAL_LIKE = re.compile(r"<\|[^<>|\s]{1,64}\|>")


def read_text(option: str, value: str, limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a file named on the command line (ConfigError naming the option and
    what the path is when it cannot be: missing, a folder, a FIFO or device, binary, not
    UTF-8, larger than `limit`)."""
    if not value:  # Path("") is the current folder
        raise ConfigError(f"{option}: the path is empty; expected a UTF-8 text file",
                          source="command line")
    try:
        return input_text(user_path(value), limit, "a UTF-8 text file")
    except InputFileError as e:
        why = e.why
        if why.startswith("is a directory"):
            why = "is a folder; expected a UTF-8 text file"
        sep = " " if why.startswith("is ") else ": "
        raise ConfigError(f"{option}: {value}{sep}{why}", source="command line") from None


def command_text(option: str, text: str) -> str:
    """Text given as an argument, refused (exit 2) unless it is valid UTF-8 (bytes the
    locale could not decode reach Python as lone surrogates)."""
    why = check_utf8(text, option)
    if why is not None:
        raise ConfigError(why, source="command line")
    return text


def model_tokenizer(engine: Any):
    """The engine model's tokenizer; a GGUF that carries none (or a broken one) is the user's
    input, so it exits 2 with the file's message."""
    from ..text.tokenizer import TokenizerError

    try:
        return engine.tokenizer()
    except GGUFChangedError:
        raise  # the file, not its tokenizer keys
    except GGUFError as e:
        raise ConfigError(f"{e}; text in and out needs the tokenizer.ggml.* keys (GGUFs "
                          "converted by llama.cpp carry them)", source="tokenizer") from None
    except TokenizerError as e:
        raise ConfigError(str(e), source="tokenizer") from None


def unknown_specials(text: str, tokenizer: Any) -> list[str]:
    """The `<|...|>` pieces of text that are not tokens of the vocabulary, in order, once."""
    known = tokenizer.special_tokens
    found = [m.group(0) for m in SPECIAL_LIKE.finditer(text)]
    return list(dict.fromkeys(t for t in found if t not in known))


def prompt_ids(args: argparse.Namespace, text: str, tokenizer: Any) -> list[int]:
    where = "--prompt-file" if args.prompt_file is not None else "--prompt"
    if not text:
        raise ConfigError(f"{where}: the prompt is empty; give some text to continue",
                          source="command line")
    if not args.no_special:
        unknown = unknown_specials(text, tokenizer)
        if unknown:
            known = ", ".join(sorted(tokenizer.special_tokens)) or "none"
            raise ConfigError(f"{where}: {', '.join(unknown)} is not a special token of this "
                              f"vocabulary (it has: {known}); --no-special reads such text as "
                              "plain text", source="prompt")
    return tokenizer.encode(text, parse_special=not args.no_special)


#: SamplingParams field -> its flag
SAMPLING_FLAGS = {field: "--" + name.replace("_", "-") for field, name in NAMES.items()}


def sampling_from(args: argparse.Namespace, base: SamplingParams | None) -> SamplingParams:
    """The config's sampling parameters (`base`; None: greedy) with every flag given on the
    command line in place of its key, resolved once: a seed is drawn here when neither gives
    one. A bad flag value exits 2 naming the flag."""
    given = {field: getattr(args, name) for field, name in NAMES.items()
             if getattr(args, name, None) is not None}
    bad = sampling_problems(given)
    if bad:
        raise ConfigError([f"{SAMPLING_FLAGS[k]}: got {v!r}; {why}" for k, v, why in bad],
                          source="command line")
    return replace(base or SamplingParams(), **given).resolved()


def summary_lines(r: Any, path: str | None = None) -> list[str]:
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s * 1e3:,.1f} ms"
    decode = "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:,.1f}"
    via = f" ({path})" if path is not None and r.decode_tokens_per_s is not None else ""
    host = "" if r.host_fraction is None else \
        f"; host {r.host_fraction * 100:.0f}% of each decode step's wall time"
    how = "" if r.sampling is None else f"; {describe(r.sampling)}"
    return [f"prompt tokens: {r.prompt_tokens}; generated: {len(r.ids)} (stop: {r.stop})"
            f"{how}",
            f"time to first token: {ttft}; prefill: {r.prefill_tokens_per_s:,.1f} tokens/s; "
            f"decode: {decode} tokens/s{via}{host}",
            f"experts streamed: {r.experts_streamed:,} ({r.bytes_streamed / MIB:,.1f} MiB)"]


def cmd_generate(args: argparse.Namespace) -> int:
    from ..text.generate import EngineSession, check_request, generate

    if args.tokens < 0:
        raise ConfigError(f"-n: got {args.tokens}; expected a number of new tokens >= 0 (0 "
                          "prefills the prompt only)", source="command line")
    target = output_arg("--json", args.json) if args.json is not None else None
    text = command_text("--prompt", args.prompt) if args.prompt is not None else read_text(
        "--prompt-file", args.prompt_file, DATA_LIMIT)
    cfg = load(args)
    sampling = sampling_from(args, cfg.sampling)
    check_outputs(cfg, {"--json": target}, {} if args.prompt_file is None else {
        "the --prompt-file": user_path(args.prompt_file)})
    progress = progress_for(args)
    out = sys.stdout
    with open_engine(cfg, progress) as engine:
        session = EngineSession(engine)
        tokenizer = model_tokenizer(engine)
        ids = prompt_ids(args, text, tokenizer)
        check_request(session, len(ids), args.tokens)
        eos = None if args.ignore_eos else tokenizer.eos_token_id
        log.info("backend %s; prompt of %d tokens; up to %d new tokens%s; %s",
                 engine.config.backend, len(ids), args.tokens,
                 "" if eos is None else f", stopping at {tokenizer.describe(eos)}",
                 describe(sampling))
        stream = tokenizer.stream(skip_special=True)

        def on_token(token: int) -> None:
            if progress.enabled:  # the prefill's line: decode steps draw none
                progress.end()
                progress.enabled = False
            out.write(f"{token} " if args.ids else stream.push(token))
            out.flush()

        progress.start(f"prefill of {len(ids)} tokens")
        try:
            result = generate(session, ids, args.tokens, eos, on_token, sampling)
        finally:
            progress.end()
        tail = "" if args.ids else stream.flush()
        out.write(tail + ("\n" if result.ids else ""))
        backend, path = engine.config.backend, engine.driver.decode_path
    for line in summary_lines(result, path):
        print(line)
    if target is not None:
        write_json(target, {"command": " ".join(sys.argv), "config": str(cfg.source),
                            "backend": backend, "decode_path": path,
                            "hardware": hardware_line(),
                            "prompt_ids": list(ids), "text": tokenizer.decode(result.ids),
                            "eos_id": eos, "complete": result.stop != "interrupted",
                            **result.as_dict()})
    if result.stop == "interrupted":
        print(f"strata generate: {interrupts.how()} after {len(result.ids)} of {args.tokens} "
              "tokens", file=sys.stderr)
        return interrupts.exit_code()
    return 0


EPILOG = """examples:
  strata generate configs/tiny-qwen3moe.yaml --prompt "The experts stream" -n 24
  strata generate configs/tiny-qwen3moe.yaml --prompt-file prompt.txt --ids --json gen.json
  strata generate model.yaml -n 64 --temperature 0.6 --top-p 0.95 --top-k 20 --seed 1 \\
      --prompt "Once upon a time"
  strata generate model.yaml -n 64 --prompt "<|im_start|>user
Why is the sky blue?<|im_end|>
<|im_start|>assistant
"

prints the continuation as it is produced (control tokens left out; --ids prints token ids),
then the prompt tokens, time to first token, prefill and decode tokens/s and the experts and
bytes streamed. Greedy by default: the most likely token at each step, one step per token on
the KV cache the prompt left. A --temperature above 0 (or the config's `generate:` keys
temperature, top_k, top_p, min_p, repeat_penalty, seed) samples instead: penalty, temperature,
top-k, top-p, min-p, then a draw seeded by --seed (absent: a fresh seed, printed in the summary
and the JSON, so the run can be repeated); on the GPU the draw runs on the device. Stops at the model's EOS token (--ignore-eos: always -n tokens). -n 0 prefills
the prompt only and prints its timing. Prompt + -n tokens must fit the model's context.
Special tokens written in the prompt (<|im_start|>) become their ids; a <|...|> the vocabulary
lacks is an error (--no-special reads them as plain text). Ctrl-C keeps what was produced and
prints the summary (exit 130; SIGTERM the same, exit 143)."""


def register(command) -> None:
    """Adds `generate`; `command(name, help, epilog)` makes a parser."""
    p = command("generate", "text generation after a prompt (greedy or sampled), with timing",
                EPILOG)
    p.add_argument("config", help="YAML run config of a whole model (see configs/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 file "
                     "(as is, final newline included)")
    p.add_argument("-n", "--tokens", type=whole_number, default=24, metavar="N",
                   help="new tokens to generate (default 24; 0: prefill only)")
    p.add_argument("--ids", action="store_true", help="print token ids instead of text")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the EOS token: always generate N tokens")
    p.add_argument("--no-special", action="store_true",
                   help="read <|...|> in the prompt as plain text, not as special tokens")
    p.add_argument("--backend", choices=("cuda", "reference"), help="override `backend`")
    from .common import add_devices_flag  # the layer split's flag, shared with `run`

    add_devices_flag(p)
    s = p.add_argument_group("sampling (each overrides the config's `generate:` key of the same "
                             "name; all absent: greedy)")
    s.add_argument("--temperature", type=float, metavar="T",
                   help="divide the logits by T before drawing (default 0: greedy, the most "
                   "likely token); e.g. 0.7")
    s.add_argument("--top-k", type=int, metavar="K", help="draw among the K most likely tokens "
                   f"(default 0: off, which keeps at most {MAX_CANDIDATES})")
    s.add_argument("--top-p", type=float, metavar="P", help="keep the most likely tokens until "
                   "their probability reaches P, 0 < P <= 1 (default 1: off)")
    s.add_argument("--min-p", type=float, metavar="P", help="keep tokens at least P times as "
                   "likely as the best one, 0 <= P < 1 (default 0: off)")
    s.add_argument("--repeat-penalty", type=float, metavar="R", help="divide the positive "
                   "logits (multiply the negative ones) of every token in the prompt and the "
                   "output so far by R > 0 (default 1: off; with temperature 0 it changes the "
                   "greedy choice)")
    s.add_argument("--seed", type=int, metavar="N", help="the draw's seed, 0..2**64-1: the same "
                   "seed, prompt and flags give the same tokens (default: a fresh seed, "
                   "printed)")
    p.add_argument("--json", metavar="PATH",
                   help="write the prompt and generated ids, the text and the timing here")
    p.set_defaults(func=cmd_generate)


__all__ = ["command_text", "model_tokenizer", "read_text", "register"]
