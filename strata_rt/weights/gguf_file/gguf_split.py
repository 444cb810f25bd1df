"""Split GGUFs (`<model>-00001-of-0000N.gguf` ... as llama.cpp's gguf-split and the gguf
package write them) read as one model.

The first shard carries the model's keys and some of its tensors; each later one carries the
split keys (`split.no`, `split.count`, `split.tensors.count`) and more tensors. Given the first
shard, the others are found beside it by name and each is checked before any is used: every
shard present and a regular file, its split keys saying the same count and the number its name
says, no tensor named in two shards, the tensors of all shards together as many as
`split.tensors.count`, and any key a later shard shares with the first holding the same value
(a shard of another model, or of another quantization of it, is refused). The tensors of all
shards then form one table; each keeps the file its bytes lie in (`TensorInfo.file`).

Given a later shard, the message names the first one: that is the file to pass. A problem
with a tensor of a later shard names that shard (`in_shards`); a tensor missing from every
shard names the shards read, and the one holding a tensor of a name close to it (a name
damaged in that shard).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from pathlib import Path

from ...config.files.file_kinds import not_a_file
from ...errors import GGUFError
from .gguf_header import ARRAY, Header, KeyValue, parse
from .gguf_keys import SHARD_NAME, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, split_of
from .gguf_problems import Problems

#: a problem line about one tensor starts with its name
_TENSOR = re.compile(r"tensor ([^\s:;,()]+)")
#: a tensor of one layer: its layer and its part (`blk.3.attn_q.weight`: 3, attn_q.weight)
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
#: keys that describe one file, not the model: they may differ from shard to shard
PER_FILE_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS, "general.alignment")


def shard_names(prefix: str, count: int) -> list[str]:
    """The names gguf-split gives the shards of `<prefix>.gguf` split `count` ways."""
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _differs(a: KeyValue, b: KeyValue) -> bool:
    if a.type != b.type:
        return True
    if a.type == ARRAY:
        return (a.elem_type, a.count) != (b.elem_type, b.count)
    return bool(a.value != b.value)


def _shard_problems(first: Header, shard: Header, no: int, count: int,
                    total: int | None) -> list[str]:
    """What makes `shard` not shard `no` (from 0) of the model `first` begins."""
    name = shard.path.name
    info = split_of(shard)
    if info is None:
        return [f"shard {name} carries no {SPLIT_COUNT} > 1: it is a whole GGUF, not shard "
                f"{no + 1} of {count}"]
    if isinstance(info, str):
        return [f"shard {name}: {info}"]
    its_no, its_count, its_total = info
    out = []
    if its_count != count:
        out.append(f"shard {name} says {SPLIT_COUNT} = {its_count}, the first shard "
                   f"{count}: the shards are of different splits")
    if its_no != no:
        out.append(f"shard {name} says {SPLIT_NO} = {its_no} (shard {its_no + 1}); its name "
                   f"says shard {no + 1}")
    if its_total is not None and total is not None and its_total != total:
        out.append(f"shard {name} says {SPLIT_TENSORS} = {its_total:,}, the first shard "
                   f"{total:,}: shards of different models")
    for key, kv in shard.keys.items():
        mine = first.keys.get(key)
        if key not in PER_FILE_KEYS and mine is not None and _differs(mine, kv):
            out.append(f"shard {name}: key {key} differs from the first shard's: a shard of "
                       "another model")
    out += [f"shard {name}: {p}" for p in shard.problems]
    return out


def merge_split(first: Header) -> Header:
    """`first` itself for a whole file; for the first shard of a split GGUF, one Header of
    every shard's tensors (problems of any shard in `.problems`, naming it); GGUFError for a
    later shard (naming the first), or a first shard whose name cannot lead to the others."""
    path = first.path
    info = split_of(first)
    if info is None:
        return first
    if isinstance(info, str):
        raise GGUFError(f"{path}: {info}")
    no, count, total = info
    m = SHARD_NAME.match(path.name)
    prefix = m["prefix"] if m else path.name.removesuffix(".gguf")
    names = shard_names(prefix, count)
    if no != 0:
        first_path = path.with_name(names[0])
        where = ("strata_rt finds the other shards beside it" if m and first_path.exists()
                 else "it is not beside this one: every shard must be in one folder")
        raise GGUFError(f"{path}: this file is shard {no + 1} of {count} of a split GGUF; give "
                        f"the first shard, {first_path} ({where})")
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise GGUFError(f"{path}: the first shard of a split GGUF of {count} shards (key "
                        f"{SPLIT_COUNT} = {count}) must be named <model>-00001-of-"
                        f"{count:05d}.gguf: the other shards are found by that name (e.g. "
                        f"{names[0]} .. {names[-1]}); rename the shards as gguf-split names "
                        "them")
    problems = Problems()
    problems += [f"shard {path.name}: {p}" for p in first.problems]
    seen = {t.name: path.name for t in first.tensors}
    tensors = list(first.tensors)
    shards = [path]
    missing = []
    for i, name in enumerate(names[1:], start=1):
        shard_path = path.with_name(name)
        why = not_a_file(shard_path)
        if why == "no such file":
            missing.append(name)
            continue
        if why is not None:
            problems.append(f"shard {i + 1} of {count}, {shard_path}: {why}; expected a GGUF "
                            "file")
            continue
        try:
            shard = parse(shard_path)
        except GGUFError as e:
            problems.append(f"shard {i + 1} of {count}: {e}")
            continue
        problems += _shard_problems(first, shard, i, count, total)
        shards.append(shard_path)
        for t in shard.tensors:
            if t.name in seen:
                problems.append(f"tensor {t.name} is in shard {seen[t.name]} and in shard "
                                f"{name} (which one holds is ambiguous)")
                continue
            seen[t.name] = name
            tensors.append(t)
    if missing:
        listed = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                            else "")
        problems.append(f"a split GGUF of {count} shards: {len(missing)} shard"
                        f"{'s are' if len(missing) > 1 else ' is'} missing beside it ({listed}); "
                        f"every shard, {names[0]} .. {names[-1]}, must be in {path.parent}")
    elif total is not None and not problems and len(tensors) != total:
        problems.append(f"key {SPLIT_TENSORS} = {total:,}, but the {count} shards hold "
                        f"{len(tensors):,} tensors: a shard is of another model or damaged")
    return replace(first, tensors=tensors, problems=problems,
                   size=first.size, shards=tuple(shards))


def in_shards(header: Header, problems: list[str]) -> list[str]:
    """`problems` with each tensor that lies in a later shard of a split GGUF named with its
    shard ("tensor X in shard m-00002-of-00003.gguf has ..."): a message names the first
    shard, the model's file, and the damaged file is the one to look at."""
    if not header.shards:
        return problems
    first = header.shards[0].name
    where = {t.name: Path(t.file).name for t in header.tensors
             if t.file and Path(t.file).name != first}
    out = []
    for line in problems:
        m = _TENSOR.match(line)
        shard = where.get(m[1]) if m else None
        if m is not None and shard is None and line[m.end():].startswith(" is missing"):
            line += f"; {not_in_shards(header, m[1])}"
        out.append(line if m is None or shard is None
                   else f"{m[0]} in shard {shard}{line[m.end():]}")
    return out


def not_in_shards(header: Header, name: str) -> str:
    """Where a split model's missing tensor `name` was looked for: every shard read, and the
    shard holding the tensor whose name is nearest it when one is close (a name damaged in a
    shard: `...weighX`). Names a layer pattern accounts for (`blk.N.<part>` present in every
    layer) and of `name`'s own part in other layers are no candidates: they are the model's."""
    shards = [p.name for p in header.shards]
    read = (", ".join(shards) if len(shards) <= 4 else f"{shards[0]} .. {shards[-1]}")
    said = f"the {len(shards)} shards read ({read}) hold no tensor of that name"
    parts: dict[str, set[str]] = {}
    for t in header.tensors:
        if (m := _LAYER.fullmatch(t.name)) is not None:
            parts.setdefault(m[2], set()).add(m[1])
    layers = max((len(v) for v in parts.values()), default=0)
    own = m[2] if (m := _LAYER.fullmatch(name)) is not None else None

    def candidate(other: str) -> bool:
        m = _LAYER.fullmatch(other)
        return m is None or (m[2] != own and len(parts[m[2]]) < layers)

    files = {t.name: Path(t.file).name if t.file else shards[0] for t in header.tensors}
    near = difflib.get_close_matches(name, [n for n in files if candidate(n)], n=1,
                                     cutoff=0.85)
    if not near:
        return said
    return (f"{said}; shard {files[near[0]]} holds a tensor named {near[0]}: is that its "
            "name, damaged?")
