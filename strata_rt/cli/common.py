"""Helpers every `strata` command shares: loading a config with command-line overrides,
checking output paths, opening an engine, timing a prefill, tables, JSON output and the
hardware line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ..backends.nonfinite import NonFiniteError
from ..config.files.input_files import InputFileError, user_path
from ..config.files.numbers import MAX_INT_DIGITS, significant_digits, to_int
from ..config.files.paths import (
    dump_file_problem,
    output_collisions,
    output_file_problem,
    results_file_problem,
    same_file,
    write_text_atomic,
)
from ..config.run.run_config import Config, load_config
from ..config.run.schema import shown_value
from ..errors import ConfigError
from ..report.progress import Progress

GiB = 1 << 30
log = logging.getLogger(__name__)


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


_ASCII_INT = re.compile(r"[+-]?[0-9]+")

def whole_number(text: str) -> int:
    """An argparse type: an integer written with the ASCII digits 0-9 (int() also takes
    `1_000`, fullwidth and Arabic-Indic digits, which a reader of the command does not see
    as the number it becomes), of at most MAX_INT_DIGITS digits."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"got {shown_value(text)}; expected a whole number "
                                         "written with the digits 0-9")
    if significant_digits(text) > MAX_INT_DIGITS:
        raise argparse.ArgumentTypeError(f"got a whole number of {significant_digits(text):,} digits; "
                                         f"none of more than {MAX_INT_DIGITS} is taken")
    return to_int(text)


def parse_prompts(text: str) -> list[int]:
    words = [x for x in text.replace(" ", "").split(",") if x]
    long = next((w for w in words
                 if _ASCII_INT.fullmatch(w) and significant_digits(w) > MAX_INT_DIGITS), None)
    if long is not None:
        raise ConfigError(f"--prompts: a token count of {significant_digits(long):,} digits; no prompt "
                          "is that long (expected comma-separated token counts >= 1, e.g. "
                          "254,1030)", source="command line")
    lengths = [to_int(x) for x in words] if all(_ASCII_INT.fullmatch(x) for x in words) else []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--prompts: got {shown_value(text)}; expected comma-separated "
                          "token counts >= 1, e.g. 254,1030", source="command line")
    return lengths


def load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    # a flag given empty is refused by its parser, not taken as absent
    if getattr(args, "prompts", None) is not None:
        cfg = cfg.with_prompt_lengths(parse_prompts(args.prompts))
    if getattr(args, "backend", None):
        cfg = cfg.with_backend(args.backend)
    if getattr(args, "devices", None) is not None:
        from ..schedule.split import parse_devices

        cfg = cfg.with_devices(parse_devices(args.devices, "--devices"))
    return cfg


def add_devices_flag(p: argparse.ArgumentParser) -> None:
    """`--devices 0,1`: the layers split over these GPUs (the config's `devices`)."""
    p.add_argument("--devices", metavar="I,J", help="override `devices`: split the layers "
                   "over these GPUs (each gets the config's VRAM budget)")


class StreamedTable:
    """A Markdown table printed a row at a time, as each result finishes (a later failure or
    a signal then loses none): columns as wide as their headers or `widths`."""

    def __init__(self, headers: list[str], widths: list[int] | None = None):
        self.headers = headers
        self.widths = [max(len(h), w) for h, w in zip(headers, widths or [0] * len(headers))]
        self.rows = 0
        #: print the header before the next row (the first, or one after other output)
        self.header_due = True

    def add(self, row: list[Any]) -> None:
        if self.header_due:
            self.header_due = False
            print("| " + " | ".join(h.ljust(w) for h, w in zip(self.headers, self.widths))
                  + " |")
            print("|" + "|".join("-" * (w + 2) for w in self.widths) + "|")
        print("| " + " | ".join(_cell(str(c), w) for c, w in zip(row, self.widths)) + " |",
              flush=True)
        self.rows += 1


def _cell(c: str, w: int) -> str:  # numbers right, words left
    return c.rjust(w) if c[:1].isdigit() or c[:1] in "+-" else c.ljust(w)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table (readable as text, pastes into the README)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(_cell(c, w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, rule, *body])


def output_arg(option: str, value: str | Path) -> Path:
    """A file path given on the command line for results, checked before the run."""
    if not str(value):
        raise ConfigError(f"{option}: got ''; expected a file path", source="command line")
    try:
        path = user_path(value)
    except InputFileError as e:
        raise ConfigError(f"{option}: got {str(value)!r}; {e.why}", source="command line") from None
    why = output_file_problem(path)
    if why is not None:
        raise ConfigError(f"{option}: got {str(value)!r}; {why}", source="command line")
    return path


def check_outputs(cfg: Config, outputs: dict[str, Path | None],
                  inputs: dict[str, Path] | None = None) -> None:
    """Refuses (exit 2, before the run) an output that is a file the run reads (the config,
    the model, a prompt or profile file, the plugin list, `inputs` of the command) or that
    another output of the run also writes: writing it would destroy that file; then a JSON
    output over an existing file that is not a JSON document (results_file_problem), or a
    residual dump over one that is no earlier dump (dump_file_problem)."""
    from ..config.settings.engine_config import output_switches

    outs = {label: path for label, path in outputs.items() if path is not None}
    for key in ("json", "dump_r"):
        path = getattr(cfg.output, key)
        if path is not None and not any(same_file(path, p) for p in outs.values()):
            outs.setdefault(f"output.{key}", path)
    for switch, value in output_switches().items():
        outs[f"{switch} (environment)"] = user_path(value)  # checked at the start
    for label, path in list(outs.items()):  # a dump is written as <path>.partial first
        if "dump_r" in label.lower():
            outs[f"{label.split(' ')[0]} (its .partial file)"] = Path(f"{path}.partial")
    problems = output_collisions(outs, {**cfg.input_paths(), **(inputs or {})})
    if not problems:  # then no output is an input: is each a file results may replace?
        problems = [f"{label}: got {str(path)!r}; {why}" for label, path in outs.items()
                    if (why := dump_file_problem(path, cfg.spec.hidden) if "dump_r" in
                        label.lower() else results_file_problem(path)) is not None]
    if problems:
        raise ConfigError(problems, source="command line")


def display_path(path: str | Path) -> str:
    """A path as printed and recorded in results: relative to the working directory when it
    lies under it (recorded figures then name configs/..., not one machine's folders)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_json(path: Path, doc: dict, final: bool = True) -> None:
    """Writes the JSON through a temporary file and a rename: a reader (or a run cut short)
    finds the previous complete version or this one. Rewritten after each prompt with
    final=False, so finished results are on disk whatever happens next."""
    try:
        write_text_atomic(path, json.dumps(doc, indent=2, default=str) + "\n")
    except OSError as e:  # a full disk: the version written before stays whole
        kept = "; the file keeps the results written before" if path.exists() else ""
        raise OSError(e.errno, f"{e.strerror or e}{kept}", str(path)) from None
    if final:
        log.info("wrote %s", path)
    else:
        log.debug("updated %s", path)


def progress_for(args: argparse.Namespace) -> Progress:
    """The progress display: on stderr, off with -q."""
    return Progress(enabled=getattr(args, "quiet", 0) == 0)


def open_engine(cfg: Config, progress: Progress | None = None):
    from ..engine import Engine

    ecfg = cfg.engine_config()
    if progress is not None:
        ecfg.progress = progress
    return Engine.open(ecfg)


def resident_count(engine: Any) -> int:
    return int(engine.residency.count)


def measure(engine: Any, hidden, progress: Progress | None, label: str):
    """One prefill timed with a host clock around the whole call (what a user waits for). A
    whole model starts each prompt from an empty KV cache."""
    engine.reset()
    if progress is not None:
        progress.start(label)
    t0 = time.perf_counter()
    try:
        out, stats = engine.prefill(hidden)
    except NonFiniteError as e:  # named by the prompt it came from
        raise e.shifted(0, source=f"{label}: {e.source}") from None
    finally:
        if progress is not None:
            progress.end()
    return out, stats, time.perf_counter() - t0


def describe(cfg: Config, backend: str) -> str:
    g = cfg.spec
    model = str(cfg.gguf) if cfg.gguf else f"synthetic (seed {cfg.model_seed})"
    w = cfg.whole
    whole = "" if w is None else (
        f" whole model: {w.n_heads} query / {w.n_kv_heads} KV heads of {w.head_dim}, "
        f"vocab {w.vocab}, KV cache {cfg.context or w.context} positions;")
    devices = "" if len(cfg.devices) == 1 else (
        f"; layers split over devices {','.join(map(str, cfg.devices))}")
    return (f"model {model}: {g.n_layers} layers, {g.n_experts} experts, top-{g.top_k}, "
            f"hidden {g.hidden}, ffn {g.ffn};{whole} format {g.format}; backend {backend}; "
            f"prefill {cfg.prefill}{devices}")
