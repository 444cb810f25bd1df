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

from ..config import Config, load_config
from ..errors import ConfigError
from ..nonfinite import NonFiniteError
from ..paths import output_file_problem, write_text_atomic
from ..progress import Progress

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


def parse_prompts(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--prompts: got {text!r}; expected comma-separated token counts "
                          ">= 1, e.g. 254,1030", source="command line")
    return lengths


def load(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    if getattr(args, "prompts", None):
        cfg = cfg.with_prompt_lengths(parse_prompts(args.prompts))
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


def output_arg(option: str, value: str | Path) -> Path:
    """A file path given on the command line for results, checked before the run."""
    path = Path(value).expanduser()
    why = output_file_problem(path)
    if why is not None:
        raise ConfigError(f"{option}: got {str(value)!r}; {why}", source="command line")
    return path


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
    write_text_atomic(path, json.dumps(doc, indent=2, default=str) + "\n")
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
    return (f"model {model}: {g.n_layers} layers, {g.n_experts} experts, top-{g.top_k}, "
            f"hidden {g.hidden}, ffn {g.ffn};{whole} format {g.format}; backend {backend}; "
            f"prefill {cfg.prefill}")
