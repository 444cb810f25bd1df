"""Type and range rules for every GGUF key strata_rt reads, checked when a file opens.

A key's GGUF type is part of its meaning: a block count stored as a float NaN, an epsilon stored
as a string or an array, a count of 2^63, a rope theta of +inf all come out of a reader as
Python values that fail far away (a traceback in int(), an allocation of 2^63 rows) or, worse,
quietly turn every logit into NaN. Each key present in the file is checked here against its
rule (integers of an integer type within a range, floats finite within a range, strings,
bools, arrays of the right element type) before anything uses it, and every broken key is
named with its value, its type and what is allowed. Keys the file leaves out are not problems
here: the loaders say which they need.

Float ranges are plausible ones, not merely positive: an RMS epsilon of 5e-324 (a subnormal)
is finite and above zero, yet no model was trained with it, and it stands for a damaged byte.
float32 values are compared in their shortest decimal form, so 1e-12 stored as float32 is
1e-12, not 9.9999998e-13 below the bound.

A shard of a split GGUF (`split.count` > 1, as llama.cpp's gguf-split writes them) holds a
part of a model's tensors; `split_of` reads its split keys, before any other key is looked at
(the later shards carry no architecture), and strata_rt.weights.gguf_file.gguf_split merges the shards.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .gguf_header import ARRAY, FLOAT_TYPES, INTEGER_TYPES, STRING, Header, KeyValue

TOKENIZER = "tokenizer.ggml."
#: llama.cpp's split keys (uint16 shard number from 0, uint16 shard count, int32 tensors in
#: all shards together)
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
#: how gguf-split names shard N of M: <prefix>-0000N-of-0000M.gguf
SHARD_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class Rule:
    """kind: 'int', 'float', 'string', 'bool', 'strings' (array of string) or 'ints' (array
    of an integer type). Numbers lie in lo..hi (inclusive; floats with `open_lo`/`open_hi`
    exclusive ends). `note` follows the allowed range in a message."""

    kind: str
    lo: float = 0
    hi: float = 0
    open_lo: bool = False
    open_hi: bool = False
    note: str = ""

    def allowed(self) -> str:
        if self.kind == "int":
            what = (f"the integer {self.lo:,}" if self.lo == self.hi
                    else f"an integer {self.lo:,}..{self.hi:,}")
        elif self.kind == "float":
            what = (f"a finite number {'(' if self.open_lo else '['}{self.lo:g}, "
                    f"{self.hi:g}{')' if self.open_hi else ']'}")
        else:
            what = {"string": "a string", "bool": "a bool", "strings": "an array of strings",
                    "ints": "an array of integers"}[self.kind]
        return what + (f" ({self.note})" if self.note else "")


def _int(lo: int, hi: int, note: str = "") -> Rule:
    return Rule("int", lo, hi, note=note)


def rules(arch: str) -> dict[str, Rule]:
    """Every key strata_rt reads (or that changes what a model computes), by full name."""
    a, big = arch, 1 << 24
    return {
        "general.architecture": Rule("string"),
        f"{a}.block_count": _int(1, 1 << 16),
        f"{a}.context_length": _int(1, big),
        f"{a}.embedding_length": _int(1, 1 << 20),
        f"{a}.feed_forward_length": _int(0, big),
        f"{a}.expert_feed_forward_length": _int(1, 1 << 20),
        f"{a}.expert_count": _int(1, 1 << 16),
        f"{a}.expert_used_count": _int(1, 1 << 16),
        f"{a}.expert_shared_count": _int(0, 0, "strata_rt runs no shared expert"),
        f"{a}.vocab_size": _int(1, big),
        f"{a}.attention.head_count": _int(1, 1 << 12),
        f"{a}.attention.head_count_kv": _int(1, 1 << 12),
        f"{a}.attention.key_length": _int(1, 1 << 12),
        f"{a}.attention.value_length": _int(1, 1 << 12),
        f"{a}.rope.dimension_count": _int(1, 1 << 12),
        f"{a}.attention.layer_norm_rms_epsilon": Rule("float", 1e-12, 0.1, note="Qwen3: 1e-6"),
        f"{a}.rope.freq_base": Rule("float", 1, 1e12, True, False, "Qwen3: 1e+06"),
        f"{a}.rope.scaling.type": Rule("string"),
        f"{a}.rope.scaling.factor": Rule("float", 1e-3, 1e6),
        f"{a}.rope.scale_linear": Rule("float", 1e-3, 1e6),
        f"{a}.expert_weights_norm": Rule("bool"),
        f"{a}.expert_gating_func": _int(1, 1, "1 = softmax, the routing strata_rt runs"),
        TOKENIZER + "model": Rule("string"),
        TOKENIZER + "pre": Rule("string"),
        TOKENIZER + "tokens": Rule("strings"),
        TOKENIZER + "token_type": Rule("ints"),
        TOKENIZER + "merges": Rule("strings"),
        TOKENIZER + "bos_token_id": _int(0, big),
        TOKENIZER + "eos_token_id": _int(0, big),
        TOKENIZER + "padding_token_id": _int(0, big),
        TOKENIZER + "unknown_token_id": _int(0, big),
        TOKENIZER + "seperator_token_id": _int(0, big),
        TOKENIZER + "add_bos_token": Rule("bool"),
        TOKENIZER + "add_eos_token": Rule("bool"),
        "tokenizer.chat_template": Rule("string"),
        SPLIT_COUNT: _int(1, 65_535),
        SPLIT_NO: _int(0, 65_534),
        SPLIT_TENSORS: _int(0, 1 << 31),
    }


def shown(kv: KeyValue) -> str:
    """A key's value as a message shows it, with its GGUF type: "nan (float32)"."""
    if kv.type == ARRAY:
        return f"an {kv.type_name} ({kv.count:,} value{'' if kv.count == 1 else 's'})"
    v = kv.value
    if kv.type == 6:
        v = float(str(np.float32(v)))  # float32's shortest decimal form: 1e-06, not 9.99e-07
    if kv.type == STRING and len(v) > 60:
        v = v[:60] + "..."
    return f"{v!r} ({kv.type_name})"


def problem(kv: KeyValue, rule: Rule) -> str | None:
    """What is wrong with one key under its rule, or None."""
    bad = f"key {kv.name} = {shown(kv)}; expected {rule.allowed()}"
    if rule.kind == "int":
        if kv.type not in INTEGER_TYPES or not rule.lo <= kv.value <= rule.hi:
            return bad
    elif rule.kind == "float":
        if kv.type not in FLOAT_TYPES | INTEGER_TYPES:
            return bad
        v = float(str(np.float32(kv.value))) if kv.type == 6 else float(kv.value)
        if not math.isfinite(v) or (v <= rule.lo if rule.open_lo else v < rule.lo) or \
                (v >= rule.hi if rule.open_hi else v > rule.hi):
            return bad
    elif rule.kind == "string":
        if kv.type != STRING:
            return bad
    elif rule.kind == "bool":
        if kv.type != 7:
            return bad
    elif rule.kind == "strings":
        if kv.type != ARRAY or kv.elem_type != STRING:
            return bad
    elif kv.type != ARRAY or kv.elem_type not in INTEGER_TYPES:
        return bad
    return None


def check_keys(header: Header) -> list[str]:
    """Every present key with a rule that breaks it (architecture first: the other names
    depend on it)."""
    arch_kv = header.keys.get("general.architecture")
    arch = arch_kv.value if arch_kv is not None and arch_kv.type == STRING else None
    out = []
    for name, rule in rules(arch or "qwen3moe").items():
        kv = header.keys.get(name)
        if kv is not None:
            bad = problem(kv, rule)
            if bad is not None:
                out.append(bad)
    return out


def split_of(header: Header) -> tuple[int, int, int | None] | str | None:
    """(shard number from 0, shard count, `split.tensors.count` or None) of a shard of a
    split GGUF; None for a whole file (no `split.count`, or a count of 1); the problem line
    when a split key has the wrong type or range."""
    count_kv = header.keys.get(SPLIT_COUNT)
    if count_kv is None:
        return None
    kvs = [header.keys.get(k) for k in (SPLIT_NO, SPLIT_TENSORS)]
    for kv in (count_kv, *kvs):
        bad = None if kv is None else problem(kv, rules("")[kv.name])
        if bad is not None:
            return bad
    count = int(count_kv.value)
    if count == 1:
        return None
    no_kv, tensors_kv = kvs
    if no_kv is None:
        return (f"key {SPLIT_COUNT} = {count} says this file is a shard of a split GGUF, but "
                f"key {SPLIT_NO} (which shard) is missing")
    no = int(no_kv.value)
    if no >= count:
        return (f"key {SPLIT_NO} = {no} but {SPLIT_COUNT} = {count}: shard numbers run "
                f"0..{count - 1}")
    return no, count, None if tensors_kv is None else int(tensors_kv.value)


def unsupported(header: Header, arch: str) -> list[str]:
    """Keys of the right type whose value asks for math strata_rt does not do: running the
    file anyway would give other logits than llama.cpp, with no error."""
    out = []
    scaling = header.keys.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling.value not in ("none", ""):
        out.append(f"key {arch}.rope.scaling.type = {scaling.value!r}; strata_rt runs plain "
                   "RoPE (no scaling), so this file's logits would differ from the model's")
    linear = number(header, f"{arch}.rope.scale_linear")
    if linear is not None and linear != 1:
        out.append(f"key {arch}.rope.scale_linear = {linear}; strata_rt runs plain RoPE "
                   "(scale 1)")
    norm = header.keys.get(f"{arch}.expert_weights_norm")
    if norm is not None and norm.value is False:
        out.append(f"key {arch}.expert_weights_norm = False; strata_rt renormalises the top-k "
                   "expert weights (Qwen3-MoE), so this file would route differently")
    return out


def number(header: Header, name: str) -> Any:
    """A key checked by `check_keys`, as int (integer types) or float (float32 read back in
    its shortest decimal form, so 1e-6 stays 1e-6); None when absent."""
    kv = header.keys.get(name)
    if kv is None:
        return None
    if kv.type in INTEGER_TYPES:
        return int(kv.value)
    if kv.type == 6:
        return float(str(np.float32(kv.value)))
    return float(kv.value)
