"""`strata inspect`: what a GGUF file holds and what a VRAM budget makes of it."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..errors import ConfigError, GGUFError, StrataError
from ..runtime.memory import MIB
from .common import GiB, markdown_table

#: a budget beyond any device (1 PiB): larger ones overflowed the byte counts
MAX_BUDGET_GIB = 1 << 20


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..formats.registry import registry
    from ..report.eta import Eta
    from ..weights.gguf_file import gguf_io
    from ..weights.gguf_file.gguf_checks import check_experts
    from ..weights.model import MoESpec

    if args.budget_gib is not None and not (math.isfinite(args.budget_gib)
                                            and 0 < args.budget_gib <= MAX_BUDGET_GIB):
        raise ConfigError(f"--budget-gib: got {args.budget_gib:g}; expected a VRAM size in "
                          f"GiB > 0 and at most {MAX_BUDGET_GIB:,} (1 PiB), e.g. 24",
                          source="command line")
    if not args.file:  # Path("") is the current folder
        raise ConfigError("FILE: the path is empty; give a GGUF file", source="command line")
    path = Path(args.file)
    # a file it cannot read at all raises here; a FIFO, device or symlink loop is named before
    # anything opens it (gguf_header)
    moe = gguf_io.scan_moe(path)
    g = MoESpec(**moe.dims)
    print(f"{args.file}: architecture {moe.arch}")
    shards = _shards(gguf_io.open_reader(path))
    if shards:
        print(shards)
    print(f"MoE: {g.n_layers} layers x {g.n_experts} experts = {g.total_experts} experts, "
          f"top-{g.top_k}, hidden {g.hidden}, ffn {g.ffn}, rms_eps {g.rms_eps:g}")
    print("expert tensor types: " + (", ".join(f"{k} x{v}" for k, v in sorted(moe.types.items()))
                                     or "none (no blk.N.ffn_*_exps tensors)"))
    names = gguf_io.tensor_names(0)
    first = [moe.tensors[names[p]] for p in gguf_io.EXPERT_PARTS if names[p] in moe.tensors]
    if first:
        print(markdown_table(["layer 0 tensor", "type", "shape", "MiB"],
                             [[t.name, t.type_name, "x".join(str(x) for x in t.shape[::-1]),
                               f"{t.nbytes / MIB:.2f}"] for t in first]))
        per_expert = sum(t.nbytes for t in first) // g.n_experts
        print(f"bytes per expert in the file (layer 0): {per_expert:,} "
              f"({per_expert / MIB:.2f} MiB)")
    whole = _whole_model(path, moe.tensors, args.budget_gib)
    tokenizer_problems: list[str] = []
    if whole is not None:
        print(whole[0])
        line, tokenizer_problems = _tokenizer(path)
        print(line)
    print(_as_stored(path, g, args.budget_gib, whole[1] if whole else 0))
    print("converted to a loaded format (`format:` in a config):")
    print(_formats_table(g, registry(), args.budget_gib, whole[1] if whole else 0))
    if args.budget_gib is not None:
        print("a budget also holds one chunk's buffers and the ring: give it to a run as "
              "`vram_budget_mib` and the config sizes the split as the CUDA backend allocates it")
    # the same checks `run` makes at load, over every expert tensor, all problems listed
    problems = moe.problems + _unreadable_types(moe, registry()) + tokenizer_problems
    if whole is not None:  # dense weights: NaN/Inf, as the whole-model loader checks them
        from ..models.qwen3.gguf_full import dense_problems, read_qwen3_dense

        problems += dense_problems(read_qwen3_dense(path)[1])
    eta = Eta(f"{path.name}: checking expert tensors", g.n_layers, "layers")
    try:
        problems += check_experts(moe, gguf_io.FileMap(path), on_layer=lambda _: eta.advance(1))
    finally:
        eta.close()
    if problems:
        raise gguf_io.problems_error(path, problems)
    print("checked: every tensor the engine reads is present, has the keys' shape and holds "
          "no NaN/Inf (router, norms, expert values or block scales)")
    return 0


def _shards(header) -> str | None:
    """The shards of a split GGUF (None for one file): each file, its tensors and bytes."""
    if not header.shards:
        return None
    rows = []
    for shard in header.shards:
        mine = [t for t in header.tensors if t.file == str(shard)]
        rows.append([shard.name, len(mine), f"{sum(t.n_bytes for t in mine) / MIB:,.2f}"])
    return (f"split GGUF: {len(header.shards)} shards, {len(header.tensors):,} tensors, read "
            "as one model\n" + markdown_table(["shard", "tensors", "MiB"], rows))


def _whole_model(path: Path, tensors: dict, budget_gib: float | None
                 ) -> tuple[str, int] | None:
    """Dense weights and KV cache of a whole-model GGUF (one with token_embd.weight): what a
    budget holds for them before any expert, and those bytes. None for MoE layers alone."""
    if "token_embd.weight" not in tensors:
        return None
    from ..config.hostmem import format_bytes
    from ..config.settings.engine_config import embedding_switch
    from ..models.qwen3.gguf_full import read_qwen3_spec
    from ..models.qwen3.whole_memory import DenseTypes, WholeSizing, whole_fixed_regions
    from ..weights.gguf_file.gguf_io import problems_error

    spec, tied = read_qwen3_spec(path)
    by_type: dict[str, list[int]] = {}
    for name, ref in tensors.items():
        if "_exps." not in name:
            count_bytes = by_type.setdefault(ref.type_name, [0, 0])
            count_bytes[0] += 1
            count_bytes[1] += ref.nbytes
    try:
        types = DenseTypes.lookup(spec.n_layers,
                                  lambda name: tensors[name].type_name if name in tensors
                                  else None)
    except KeyError as e:  # the whole-model checks would name it too; nothing to size without
        raise problems_error(path, [f"tensor {e.args[0]} is missing"]) from None
    sizing = WholeSizing(spec, types, spec.context,
                         embedding=embedding_switch() != "host",
                         embedding_mode=embedding_switch())
    on_gpu = whole_fixed_regions(sizing)
    embd = (f"token embedding {format_bytes(on_gpu['embd'])}" if on_gpu["embd"] else
            "token embedding in the head's bytes" if sizing.embd_in_head else
            "token embedding rows decoded on the host")
    kv_1k = spec.kv_bytes_per_token(2) * 1024
    lines = [f"whole model: vocabulary {spec.vocab:,}, {spec.n_heads} query heads / "
             f"{spec.n_kv_heads} KV heads x {spec.head_dim}, rope theta {spec.rope_theta:g}, "
             f"context {spec.context:,}, output head "
             + ("tied to the embedding" if tied else "of its own"),
             markdown_table(["dense tensor type", "tensors", "MiB in the file"],
                            [[t, n, f"{b / MIB:,.1f}"] for t, (n, b) in sorted(by_type.items())]),
             f"on the GPU, as stored: attention weights and norms "
             f"{format_bytes(on_gpu['dense'])}, output head {format_bytes(on_gpu['head'])}, "
             f"fp16 decode scratch {format_bytes(on_gpu['dense_scratch'])}, {embd}; KV cache "
             f"(fp16) per 1K tokens: {format_bytes(kv_1k)}, at the {spec.context:,}-token "
             f"context {format_bytes(kv_1k * spec.context // 1024)}"]
    if budget_gib is None:
        return "\n".join(lines), 0
    budget = int(budget_gib * GiB)
    resident = sum(on_gpu.values())
    streamed = sum(whole_fixed_regions(sizing.streamed()).values())
    if resident <= budget:
        held, how = resident, "the dense weights resident"
    else:
        held, how = streamed, "the dense weights streaming per layer (they do not fit)"
    lines.append(f"a {budget_gib:g} GiB budget holds {how}, the output head, the token "
                 f"embedding, RoPE tables and the KV cache at the full context in "
                 f"{format_bytes(held)}; "
                 f"{format_bytes(max(0, budget - held))} left for experts, a chunk and the "
                 "ring (a smaller `context` leaves more)")
    return "\n".join(lines), held


def _tokenizer(path: Path) -> tuple[str, list[str]]:
    """The whole model's tokenizer line and its problems. `generate` builds the tokenizer
    from the file's keys (and `run` does, to print generated text), refusing what it cannot
    read: a token that is not UTF-8, an unknown model or pre-tokenizer, bad token types or ids,
    a token twice, merges that do not fit the tokens. The same checks run here, so a file that
    passes inspect does not fail there. A file with no tokenizer keys is not a problem: it is
    prefilled from token ids."""
    import importlib.util

    from ..text.tokenizer import Tokenizer, TokenizerError
    from ..text.tokenizer_vocab import ADDED_TYPES, KEY, TokenizerVocab
    from ..weights.gguf_file import gguf_io

    def problem(e: Exception) -> list[str]:
        msg = str(e)
        return [msg.removeprefix(f"{path}: ")]

    if not any(k.startswith(KEY) for k in gguf_io.open_reader(path).keys):
        return "tokenizer: none (no tokenizer.ggml.* keys: prompts are token ids only)", []
    try:
        vocab = TokenizerVocab.from_gguf(path)
    except GGUFError as e:
        return "tokenizer: unreadable (below)", problem(e)
    line = (f"tokenizer: {vocab.model} (pre {vocab.pre}), {len(vocab):,} tokens, "
            f"{len(vocab.merges):,} merges, {len(vocab.ids_of_type(*ADDED_TYPES)):,} added")
    if importlib.util.find_spec("tokenizers") is None:
        return line + " (keys checked; not built: the `tokenizers` library is missing)", []
    try:
        Tokenizer(vocab, source=str(path))
    except TokenizerError as e:
        return "tokenizer: cannot be built (below)", problem(e)
    return line, []


def _unreadable_types(moe, reg) -> list[str]:
    """Expert tensors no loaded format can use: not its own GGUF type, and not a type the
    gguf package dequantizes (run refuses them at load, naming the format)."""
    from ..weights.gguf_file.gguf_checks import dequantizable

    raw = {loaded.format.ggml_type for loaded in reg.formats.values()}
    return [f"tensor {ref.name} has type {ref.type_name}: no loaded format takes it raw and "
            "the gguf package cannot dequantize it"
            for refs in moe.experts for ref in (refs or {}).values()
            if ref.ggml_type not in raw and not dequantizable(ref.ggml_type)]


def _as_stored(path: Path, g, budget_gib: float | None, reserved: int = 0) -> str:
    """How the experts run with no `format` named: each run of layers with the format of its
    tensors' types (the mix), the slot every layer's expert takes, and what a budget holds."""
    from ..formats.registry import registry
    from ..weights.gguf_file import gguf_io
    from ..weights.gguf_file.gguf_format import file_layer_formats

    formats, why = file_layer_formats(gguf_io.open_reader(path), registry(), g.hidden, g.ffn)
    if formats is None:
        return f"as stored (no `format`): cannot run: {why}"
    slot = formats.slot_bytes
    lines = ["as stored (no `format`): " + "; ".join(formats.describe()),
             f"a VRAM slot takes {slot:,} bytes (the largest layer's expert); all "
             f"{g.total_experts:,} experts {slot * g.total_experts / GiB:.2f} GiB, "
             f"{sum(lay.blob_bytes for lay in formats.layouts) * g.n_experts / GiB:.2f} GiB "
             "of them in the file"]
    if budget_gib is not None:
        budget = max(0, int(budget_gib * GiB) - reserved)
        n = min(g.total_experts, budget // slot)
        lines.append(f"a {budget_gib:g} GiB budget holds {n:,} of them resident "
                     f"({n / g.total_experts:.0%})")
    return "\n".join(lines)


def _formats_table(g, reg, budget_gib: float | None, reserved: int = 0) -> str:
    """Each format's expert sizes, and how many experts the budget holds after `reserved`
    bytes (a whole model's dense part)."""
    budget = None if budget_gib is None else max(0, int(budget_gib * GiB) - reserved)
    headers = ["format", "blob bytes", "slot bytes", "all experts GiB"]
    if budget is not None:
        headers += [f"experts in {budget_gib:g} GiB", "share"]
    rows = []
    for name, loaded in reg.formats.items():
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
    return markdown_table(headers, rows)


EPILOG_INSPECT = """examples:
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf
  strata inspect Qwen3-30B-A3B-IQ3_XXS.gguf --budget-gib 24

shows the MoE geometry (and, for a split GGUF given by its first shard, every shard), the
tensor types, bytes per expert in the file and in every loaded
format, and how many experts a VRAM budget holds; for a whole-model file (token_embd.weight
present) also the dense weights by type, their bf16 size and the KV cache per 1K tokens; then
runs the checks `strata run` makes at load (every tensor present and shaped to the keys; no
NaN/Inf in router, norms or experts; a whole model's tokenizer builds) and lists every
problem, with the exit code `run` gives for a bad GGUF."""

def register(command) -> None:
    """Adds this module's subcommands; `command(name, help, epilog)` makes a parser."""
    p = command("inspect", "MoE geometry, tensor formats and expert sizes of a GGUF file", EPILOG_INSPECT)
    p.add_argument("file", help="a GGUF file with blk.N.ffn_*_exps tensors")
    p.add_argument("--budget-gib", type=float, metavar="X",
                   help="also show how many experts X GiB of VRAM holds")
    p.set_defaults(func=cmd_inspect)
