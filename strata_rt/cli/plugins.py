"""`strata plugins` and `strata check-kernels`: which formats are loaded and whether their
kernels compile."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .common import markdown_table

DEFAULT_ARCHS = ("sm_80", "sm_90")


def cmd_plugins(args: argparse.Namespace) -> int:
    from ..registry import registry

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
    from ..registry import registry
    from ..runtime.compile import check_kernels

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


EPILOG_PLUGINS = """examples:
  strata plugins
  strata --plugins my/plugins.yaml plugins

lists every loaded quantization format: native (batched gathers), block geometry, kernel
sources, MMQ variants (STRATA_MMQ_KERNEL picks one), where it came from (the plugins.yaml
that listed it, or an installed entry point) and its description."""

EPILOG_CHECK_KERNELS = """examples:
  strata check-kernels
  strata check-kernels --arch sm_90

compiles the shared kernels and every loaded format's kernels with nvcc (cached); exits 1 with
the compiler's message when one fails. No GPU needed."""

def register(command) -> None:
    """Adds this module's subcommands; `command(name, help, epilog)` makes a parser."""
    p = command("plugins", "list the loaded quantization formats", EPILOG_PLUGINS)
    p.set_defaults(func=cmd_plugins)
    p = command("check-kernels", "compile every loaded kernel with nvcc", EPILOG_CHECK_KERNELS)
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                   help="comma-separated targets (default: %(default)s)")
    p.set_defaults(func=cmd_check_kernels)
