"""`strata inspect`: what a GGUF file holds and what a VRAM budget makes of it."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..errors import ConfigError, StrataError
from ..runtime.memory import MIB
from .common import GiB, markdown_table


def cmd_inspect(args: argparse.Namespace) -> int:
    # _type_name is gguf_io's private helper, imported so the GGML type names have one source
    from ..gguf_io import _type_name, read_header, tensor_names
    from ..model import MoESpec
    from ..registry import registry

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


EPILOG_INSPECT = """examples:
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf --budget-gib 24

shows the MoE geometry, the tensor types, bytes per expert in the file and in every loaded
format, and how many experts a VRAM budget holds."""

def register(command) -> None:
    """Adds this module's subcommands; `command(name, help, epilog)` makes a parser."""
    p = command("inspect", "MoE geometry, tensor formats and expert sizes of a GGUF file", EPILOG_INSPECT)
    p.add_argument("file", help="a GGUF file with blk.N.ffn_*_exps tensors")
    p.add_argument("--budget-gib", type=float, metavar="X",
                   help="also show how many experts X GiB of VRAM holds")
    p.set_defaults(func=cmd_inspect)
