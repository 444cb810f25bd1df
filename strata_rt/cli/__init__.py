"""The `strata` command line: one module per group of subcommands, each adding its parsers
through `register(command)`; this module builds the top-level parser, configures logging
(`-v`, `-q`), checks the environment switches and turns errors into one message and an exit
code: 2 for what the user gave (config, switches, paths, memory), 1 for what failed while
running, 130 for Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import __version__, env, log
from ..errors import StrataError
from . import generate, inspect, perplexity, plugins, run
from .common import cuda_version, hardware_line

COMMAND_MODULES = (run, generate, perplexity, inspect, plugins)


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
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="also print debug messages, with the module that logged them")
    parser.add_argument("-q", "--quiet", action="count", default=0,
                        help="print warnings and errors only, and no progress (-qq: errors "
                             "only)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_: str, epilog: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                              formatter_class=fmt)

    for module in COMMAND_MODULES:
        module.register(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with log.configured(args.verbose - args.quiet):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.plugins:
            os.environ["STRATA_PLUGINS"] = str(Path(args.plugins).resolve())
            from ..registry import registry

            registry(reload=True)
        env.validate_all()
        return args.func(args)
    except StrataError as e:
        print(f"strata {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except MemoryError as e:  # what a check before the allocation did not foresee
        print(f"strata {args.command}: out of host memory: {e or 'allocation failed'}",
              file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an I/O error (paths are checked before the run)
        where = e.filename if e.filename is not None else args.command
        print(f"strata: {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"strata {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "cuda_version", "hardware_line", "main"]

