"""`strata plugins` and `strata check-kernels`: which formats are loaded and whether their
kernels compile."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ConfigError
from .common import markdown_table

DEFAULT_ARCHS = ("sm_80", "sm_90")


def _plugin_rows(reg) -> list[dict]:
    rows = []
    for name, loaded in reg.formats.items():
        fmt = loaded.format
        rows.append({
            "format": name, "native": bool(fmt.native), "block_values": fmt.block_values,
            "block_bytes": fmt.block_bytes,
            "activation": str(getattr(fmt.activation, "name", fmt.activation)),
            "kernel_sources": [str(p) for p in fmt.kernel_sources()],
            "mmq_variants": list(fmt.mmq_variants()), "plugin": loaded.plugin,
            "module": loaded.module, "origin": loaded.origin,
            "distribution": loaded.distribution, "version": loaded.version,
            "description": fmt.description})
    return rows


def cmd_plugins(args: argparse.Namespace) -> int:
    from ..formats.registry import registry

    reg = registry()
    rows = _plugin_rows(reg)
    disabled = [{"plugin": name, "by": why} for name, why in reg.disabled.items()]
    if args.json:
        print(json.dumps({"formats": rows, "disabled": disabled}, indent=2))
        return 0
    print(markdown_table(
        ["name", "native", "block values", "bytes per block", "kernels (.cu)", "mmq variants",
         "plugin", "distribution", "origin", "description"],
        [[r["format"], "yes" if r["native"] else "no", r["block_values"], r["block_bytes"],
          len(r["kernel_sources"]), ", ".join(r["mmq_variants"]), r["plugin"],
          f"{r['distribution']} {r['version']}" if r["distribution"] else "(not installed)",
          r["origin"], r["description"]] for r in rows]))
    for d in disabled:
        print(f"disabled: {d['plugin']} (by {d['by']})")
    return 0


def cmd_check_kernels(args: argparse.Namespace) -> int:
    from ..formats.registry import registry
    from ..runtime.compile import check_kernels

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or any(not a.startswith("sm_") for a in archs):
        raise ConfigError(f"--arch: got {args.arch!r}; expected e.g. sm_80,sm_90",
                          source="command line")
    # every variant's object: a variant may compile sources the default does not
    owners = [loaded.format.for_variant(v) for loaded in registry().formats.values()
              for v in loaded.format.mmq_variants()]
    results = check_kernels(owners, archs)
    if "sm_90" in archs:
        from ..gemm.cutlass_gemm import check_library, find_headers

        built = check_library()
        if built is None:
            print(f"skip cutlass    sm_90a  grouped_gemm_sm90.cu ({find_headers()[1]})")
        else:
            results.append(built)
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
  strata plugins --json
  strata --plugins my/plugins.yaml plugins
  STRATA_DISABLE_PLUGINS=test_i8 strata plugins

lists every loaded quantization format: native (batched gathers), block geometry, kernel
sources, MMQ variants (STRATA_MMQ_KERNEL picks one), the plugin that provides it (the name
STRATA_DISABLE_PLUGINS takes), the installed distribution and version it came from, where it
was listed (a plugins.yaml, or an entry point) and its description; then the disabled plugins."""

EPILOG_CHECK_KERNELS = """examples:
  strata check-kernels
  strata check-kernels --arch sm_90

compiles the shared kernels and every loaded format's kernels with nvcc (cached); with sm_90,
also the CUTLASS grouped GEMM library for sm_90a (a minute or two the first time; skipped, with
the reason, when the nvidia-cutlass headers are not installed). Exits 1 with the compiler's
message when one fails, and when the shared kernels are missing (an install without its
package data). No GPU needed."""

def register(command) -> None:
    """Adds this module's subcommands; `command(name, help, epilog)` makes a parser."""
    p = command("plugins", "list the loaded quantization formats", EPILOG_PLUGINS)
    p.add_argument("--json", action="store_true",
                   help="print the formats and disabled plugins as JSON instead of a table")
    p.set_defaults(func=cmd_plugins)
    p = command("check-kernels", "compile every loaded kernel with nvcc", EPILOG_CHECK_KERNELS)
    p.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                   help="comma-separated targets (default: %(default)s)")
    p.set_defaults(func=cmd_check_kernels)
