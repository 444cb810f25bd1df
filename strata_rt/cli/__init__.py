"""The `strata` command line: one module per group of subcommands, each adding its parsers
through `register(command)`; this module builds the top-level parser, configures logging
(`-v`, `-q`), checks the environment switches and turns errors into one message and an exit
code: 2 for what the user gave (config, switches, paths, memory), 1 for what failed while
running, 130 for Ctrl-C, 143 for SIGTERM (strata_rt.report.interrupts)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..config.settings import env
from ..errors import ConfigError, StrataError
from ..report import interrupts, log
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
    # text the terminal's encoding lacks (a model's output, a file name) is shown escaped,
    # not a UnicodeEncodeError after the run
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    with log.configured(args.verbose - args.quiet), interrupts.signals_as_interrupts():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.plugins == "":
            raise ConfigError("--plugins: got ''; expected the path of a plugins.yaml",
                              source="command line")
        if args.plugins:
            os.environ["STRATA_PLUGINS"] = os.path.abspath(os.path.expanduser(args.plugins))
            from ..formats.registry import registry

            registry(reload=True)
        env.validate_all()
        return args.func(args)
    except StrataError as e:
        print(f"strata {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except MemoryError as e:  # what a check before the allocation did not foresee
        print(f"strata {args.command}: out of host memory: "
              f"{str(e) or 'an allocation failed (the run needed more than this host had)'}",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed by its reader (`strata run ... | head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's flush goes nowhere, quietly
        return 1
    except OSError as e:  # a full disk, an I/O error (paths are checked before the run)
        where = e.filename if e.filename is not None else args.command
        print(f"strata: {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"strata {args.command}: {interrupts.how()}", file=sys.stderr)
        return interrupts.exit_code()


__all__ = ["build_parser", "cuda_version", "hardware_line", "main"]

