"""GGUF files of MoE models (qwen3moe tensor names and keys): opening and checking them, where
their tensors lie in the file, and writing small ones (tests, `strata inspect` examples).

Every problem with a file is a GGUFError naming the file, the tensor or key, what it holds and
what was expected: a model loaded from the wrong file must fail at load, not produce numbers.
`scan_moe` collects every problem of a file instead of stopping at the first, so `strata
inspect` can list them all and `run` (through `open_moe`) rejects the same files.

Expert tensors are not read here: `TensorRef` says where one lies and `FileMap` maps the file,
so the loader copies bytes from the map straight into the expert store, a layer at a time.
This module depends on nothing above it (not on the model): the model imports it.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...config.files.file_kinds import open_regular
from ...errors import GGUFError
from . import gguf_checks
from .gguf_header import Header, parse
from .gguf_keys import check_keys, number, unsupported
from .gguf_problems import MAX_PROBLEMS, Problems
from .gguf_split import in_shards, merge_split

ARCH = "qwen3moe"
#: (name suffix, spec field) of the integer keys a MoE file must carry
DIM_KEYS = (("block_count", "n_layers"), ("embedding_length", "hidden"),
            ("expert_count", "n_experts"), ("expert_used_count", "top_k"),
            ("expert_feed_forward_length", "ffn"))
EPS_KEY = "attention.layer_norm_rms_epsilon"
DEFAULT_RMS_EPS = 1e-6
EXPERT_PARTS = ("gate", "up", "down")


def tensor_names(layer: int) -> dict[str, str]:
    p = f"blk.{layer}."
    return {"router": p + "ffn_gate_inp.weight", "norm": p + "ffn_norm.weight",
            "gate": p + "ffn_gate_exps.weight", "up": p + "ffn_up_exps.weight",
            "down": p + "ffn_down_exps.weight"}


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(t)).name
    except ValueError:
        return f"type {int(t)}"


def problems_error(path: Path, problems: Problems | list[str]) -> GGUFError:
    """One GGUFError for all of a file's problems (one line each; the first MAX_PROBLEMS and
    a count of the rest: a broken count must not print a million lines)."""
    total = len(problems)
    shown = list(problems)[:MAX_PROBLEMS]
    key = _identity(Path(path))
    if key in _OPENED:  # a split model: a tensor of a later shard is named with its shard
        shown = in_shards(_OPENED[key][0], shown)
    if total == 1:
        return GGUFError(f"{path}: {shown[0]}")
    lines = "\n".join(f"  - {p}" for p in shown)
    more = f"\n  ... and {total - MAX_PROBLEMS:,} more" if total > MAX_PROBLEMS else ""
    first = f" (the first {MAX_PROBLEMS})" if more else ""
    return GGUFError(f"{path}: {total:,} problems{first}:\n{lines}{more}")


# ---------------------------------------------------------------------------- the reader
def open_reader(path: Path) -> Header:
    """The file's header (memory-mapped), refused with one GGUFError listing every problem
    of its structure, its tensor list and its keys (gguf_header, gguf_tensors, gguf_keys).
    The first shard of a split GGUF opens every shard as one model (gguf_split).

    A checked header is kept for the next open of the same file (same device, inode, size,
    modification and change times of every shard): the model, its MoE layers and its
    tokenizer open from one parse."""
    path = Path(path)
    key = _identity(path)
    kept = _OPENED.get(key) if key is not None else None
    if kept is not None and all(_identity(s) == k for s, k in zip(kept[0].shards, kept[1])):
        return kept[0]
    header = merge_split(parse(path))
    problems = check_keys(header) + header.problems
    if problems:
        raise problems_error(path, problems)
    if key is not None:
        _OPENED.pop(key, None)
        while len(_OPENED) >= KEPT_HEADERS:
            _OPENED.pop(next(iter(_OPENED)))
        _OPENED[key] = (header, tuple(_identity(s) for s in header.shards))
    return header


#: checked headers kept (by file identity) for the next open of the same file
KEPT_HEADERS = 4
_OPENED: dict[tuple, tuple[Header, tuple]] = {}


def _identity(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _layers_present(header: Header) -> list[int]:
    """Sorted layer numbers N of the file's blk.N.* tensors."""
    found = set()
    for t in header.tensors:
        parts = t.name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isascii() and \
                parts[1].isdigit():
            found.add(int(parts[1]))
    return sorted(found)


def read_header(path: Path) -> tuple[Header, dict[str, Any]]:
    """Opens the file (memory-mapped) and reads the MoE dims; returns (header, dims) with
    dims keyed by MoESpec field names plus "arch". Every key is type- and range-checked and
    the layer count is checked against the layers the tensors hold."""
    path = Path(path)
    header = open_reader(path)
    kv = header.keys.get("general.architecture")
    if kv is None:
        raise GGUFError(f"{path}: key general.architecture is missing; expected e.g. {ARCH!r}")
    arch = kv.value
    if not (0 < len(arch) <= 64 and arch.isprintable()):
        raise GGUFError(f"{path}: key general.architecture = {arch[:40]!r}"
                        f"{'...' if len(arch) > 40 else ''} ({len(arch):,} characters); "
                        f"expected an architecture name such as {ARCH!r}")
    dims: dict[str, Any] = {"arch": arch}
    missing = [f"{arch}.{s}" for s, _ in DIM_KEYS if f"{arch}.{s}" not in header.keys]
    if missing:
        raise GGUFError(f"{path}: key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"{'are' if len(missing) > 1 else 'is'} missing (an MoE GGUF of "
                        f"architecture {arch!r} needs "
                        f"{', '.join(arch + '.' + s for s, _ in DIM_KEYS)})")
    for suffix, name in DIM_KEYS:
        dims[name] = number(header, f"{arch}.{suffix}")
    eps = number(header, f"{arch}.{EPS_KEY}")
    dims["rms_eps"] = DEFAULT_RMS_EPS if eps is None else eps
    problems = unsupported(header, arch) + gguf_checks.dims_against_tensors(header.tensors,
                                                                          arch, dims)
    if dims["top_k"] > dims["n_experts"]:
        problems.append(f"key {arch}.expert_used_count = {dims['top_k']} exceeds "
                        f"{arch}.expert_count = {dims['n_experts']}")
    layers = _layers_present(header)
    if layers and layers[-1] + 1 != dims["n_layers"] or not layers:
        held = (f"tensors of layers blk.{layers[0]} .. blk.{layers[-1]} ({len(layers):,} "
                "layers)" if layers else "no blk.N tensors")
        problems.append(f"key {arch}.block_count = {dims['n_layers']:,}, but the file holds "
                        f"{held}: the count must match the layers present")
    if problems:
        raise problems_error(path, problems)
    return header, dims


# ---------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class TensorRef:
    """Where a tensor lies in its file; small and picklable, so conversion workers map the
    file themselves and read only their part."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # logical, outermost first (GGUF lists it innermost first)
    offset: int             # absolute byte offset in the file
    nbytes: int
    file: str = ""          # the shard it lies in ("": the model's first file)

    @classmethod
    def of(cls, t: Any) -> TensorRef:
        return cls(t.name, int(t.tensor_type), tuple(int(x) for x in reversed(list(t.shape))),
                   int(t.data_offset), int(t.n_bytes), getattr(t, "file", ""))

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


class FileMap:
    """Read-only memory maps of a model's file (and its other shards, mapped when a tensor of
    one is first read). `bytes(ref)` views a tensor without copying; `release(ref)` drops its
    pages from this process (they stay in the page cache), so a layer-by-layer copy holds
    about one layer of the file at a time."""

    def __init__(self, path: Path):
        self.path = path
        self._maps: dict[str, mmap.mmap] = {}
        #: layers are copied on several threads (convert.py): a shard is mapped once
        self._lock = threading.Lock()
        self._map = self._open(str(path))

    def _open(self, file: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(file)
            return self._open_new(file) if m is None else m

    def _open_new(self, file: str) -> mmap.mmap:
        try:
            fd, _ = open_regular(Path(file))  # never blocks: a FIFO swapped in is refused
        except ValueError as e:
            raise GGUFError(f"{file}: {e}; expected a GGUF file") from None
        try:
            m = self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return m

    def _of(self, file: str) -> mmap.mmap:
        return self._map if not file or file == str(self.path) else self._open(file)

    def bytes(self, ref: TensorRef) -> np.ndarray:
        return np.frombuffer(self._of(ref.file), np.uint8, ref.nbytes, ref.offset)

    def release(self, ref: TensorRef) -> None:
        self.release_range(ref.offset, ref.nbytes, ref.file)

    def release_range(self, offset: int, nbytes: int, file: str = "") -> None:
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or nbytes <= 0:
            return
        lo = offset - offset % mmap.PAGESIZE
        self._of(file).madvise(advice, lo, offset + nbytes - lo)


# ---------------------------------------------------------------------------- MoE files
@dataclass
class MoEFile:
    """What `scan_moe` found: the dims, the router and norm weights, the expert tensors of each
    layer (None where a layer has a missing or misshapen one) and every problem."""

    path: Path
    arch: str
    dims: dict[str, Any]
    router: np.ndarray                      # float32 [L, E, H]
    norm: np.ndarray                        # float32 [L, H]
    experts: list[dict[str, TensorRef] | None]
    tensors: dict[str, TensorRef] = field(default_factory=dict)  # every tensor of the file
    types: dict[str, int] = field(default_factory=dict)  # expert tensor type -> count
    problems: Problems = field(default_factory=Problems)

    def raise_problems(self) -> None:
        if self.problems:
            raise problems_error(self.path, self.problems)


def _read_float(t: Any, out: np.ndarray, problems: Problems) -> bool:
    from gguf.quants import dequantize

    if not gguf_checks.dequantizable(int(t.tensor_type)):
        problems.append(f"tensor {t.name} has type {_type_name(t.tensor_type)}, which "
                        "strata_rt cannot read as float (use F32, F16, BF16 or a type the gguf "
                        "package dequantizes)")
        return False
    with np.errstate(all="ignore"):  # NaN or Inf decoded here is named by the finite check
        vals = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    out[...] = vals.reshape(out.shape)
    return True


def scan_moe(path: Path) -> MoEFile:
    """Reads the header and the router and norm weights and checks every tensor the engine
    reads for presence, shape and type, and router and norm for NaN/Inf. A file that cannot
    be read at all raises GGUFError; problems with tensors are collected in `.problems`.
    Expert values are checked separately (`gguf_checks.check_experts`): that reads the whole
    file."""
    path = Path(path)
    header, dims = read_header(path)
    arch = dims.pop("arch")
    L, H, F, E = dims["n_layers"], dims["hidden"], dims["ffn"], dims["n_experts"]
    want = {"router": (E, H), "norm": (H,), "gate": (E, F, H), "up": (E, F, H),
            "down": (E, H, F)}
    tensors = {t.name: t for t in header.tensors}
    # router and norm arrays are allocated per layer, from tensors whose shape matched the
    # keys (so their size is bounded by the file's), never from the keys alone
    routers: list[np.ndarray] = []
    norms: list[np.ndarray] = []
    moe = MoEFile(path, arch, dims, np.zeros((0, E, H), np.float32),
                  np.zeros((0, H), np.float32), [])
    for t in header.tensors:
        moe.tensors[t.name] = TensorRef.of(t)
        if "_exps." in t.name:
            k = _type_name(t.tensor_type)
            moe.types[k] = moe.types.get(k, 0) + 1
    for layer in range(L):
        names = tensor_names(layer)
        refs: dict[str, TensorRef] = {}
        for part, name in names.items():
            info = tensors.get(name)
            if info is None:
                moe.problems.append(f"tensor {name} is missing ({arch}.block_count = {L} says "
                                    f"layer {layer} exists)")
                continue
            ref = moe.tensors[name]
            bad = gguf_checks.shape_problem(name, part, ref.shape, want[part], arch, dims)
            if bad is not None:
                moe.problems.append(bad)
            elif part in ("router", "norm"):
                out = np.empty(want[part], np.float32)
                if _read_float(info, out, moe.problems):
                    check = gguf_checks.check_router if part == "router" else \
                        gguf_checks.check_norm
                    moe.problems += check(name, layer, out)
                    (routers if part == "router" else norms).append(out)
            else:
                refs[part] = ref
        moe.experts.append(refs if len(refs) == len(EXPERT_PARTS) else None)
    if len(routers) == L and len(norms) == L:
        moe.router, moe.norm = np.stack(routers), np.stack(norms)
    return moe


def open_moe(path: Path) -> MoEFile:
    """scan_moe, raising one GGUFError that lists every problem found."""
    moe = scan_moe(path)
    moe.raise_problems()
    return moe


# ---------------------------------------------------------------------------- writing
def _expert_tensors(model: Any) -> dict[str, tuple[np.ndarray, Any]]:
    """Per layer (gate, up, down) arrays and their GGUF type: the format's raw rows when it has
    a GGUF type (its blob is then gate rows, up rows, down rows in that encoding), else
    float32 dequantized weights."""
    from gguf import GGMLQuantizationType

    spec, fmt, lay = model.spec, model.fmt, model.layout
    out: dict[str, tuple[np.ndarray, Any]] = {}
    for layer in range(spec.n_layers):
        names = tensor_names(layer)
        if fmt.ggml_type is not None:
            qt = GGMLQuantizationType(fmt.ggml_type)
            raw = np.stack([model.expert_blob(layer, e) for e in range(spec.n_experts)])
            half = lay.gate_up_bytes // 2
            gu = raw[:, lay.gate_up_offset: lay.gate_up_offset + lay.gate_up_bytes]
            parts = {"gate": gu[:, :half].reshape(spec.n_experts, spec.ffn, -1),
                     "up": gu[:, half:].reshape(spec.n_experts, spec.ffn, -1),
                     "down": raw[:, lay.down_offset: lay.down_offset + lay.down_bytes]
                     .reshape(spec.n_experts, spec.hidden, -1)}
            for p, a in parts.items():
                out[names[p]] = (np.ascontiguousarray(a), qt)
        else:
            mats = [model.dequantized(layer, e) for e in range(spec.n_experts)]
            for i, p in enumerate(EXPERT_PARTS):
                out[names[p]] = (np.stack([m[i] for m in mats]).astype(np.float32), None)
    return out


@dataclass(frozen=True)
class Typed:
    """A key's value with its GGUF type (and element type, for arrays): copied from one file
    to another as it was, a uint16 staying a uint16."""

    type: int
    elem: int | None
    value: Any


def typed_keys(header: Header, prefixes: tuple[str, ...] = ("",),
               skip: tuple[str, ...] = ()) -> dict[str, Typed]:
    """The header's keys whose names start with one of `prefixes` (all by default), less
    `skip` and empty arrays (which GGUF writers cannot write), with their types."""
    return {name: Typed(kv.type, kv.elem_type, header.value(name))
            for name, kv in header.keys.items()
            if name.startswith(prefixes) and name not in skip
            and not (kv.elem_type is not None and kv.count == 0)}


def add_keys(writer: Any, keys: Mapping[str, Any]) -> None:
    """Adds keys to a gguf.GGUFWriter typed from their values, as llama.cpp's converter types
    them: bool, float32, string, arrays (tokenizer tokens, merges, token types) and uint32 for
    whole numbers; a `Typed` value as its type says; None leaves a key out (tests of files
    without it)."""
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, Typed):
            from gguf import GGUFValueType

            writer.add_key_value(k, v.value, GGUFValueType(v.type),
                                 None if v.elem is None else GGUFValueType(v.elem))
        elif isinstance(v, bool):
            writer.add_bool(k, v)
        elif isinstance(v, float):
            writer.add_float32(k, v)
        elif isinstance(v, str):
            writer.add_string(k, v)
        elif isinstance(v, list | tuple):
            writer.add_array(k, list(v))
        else:
            writer.add_uint32(k, int(v))


def write_moe_gguf(path: str | Path, model: Any, *, arch: str = ARCH, omit: Iterable[str] = (),
                   keys: Mapping[str, Any] | None = None,
                   tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None,
                  split_max_tensors: int = 0) -> Path:
    """Writes `model` (anything with .spec, .fmt, .layout, .router, .norm, .expert_blob and
    .dequantized) as a qwen3moe-style GGUF. For tests of bad files: `omit` leaves tensors
    out, `keys` overrides keys by full name (None drops one; ints are written as uint32),
    `tensors` replaces tensors by name with (array, GGMLQuantizationType or None).
    split_max_tensors > 0 writes a split GGUF of at most that many tensors a shard, named as
    gguf-split names them (<stem>-00001-of-0000N.gguf, ...); the first shard's path is
    returned."""
    from gguf import GGUFWriter

    path = Path(path)
    spec = model.spec
    kv: dict[str, Any] = {f"{arch}.{suffix}": getattr(spec, name) for suffix, name in DIM_KEYS}
    kv[f"{arch}.{EPS_KEY}"] = float(spec.rms_eps)
    kv.update(keys or {})
    all_t: dict[str, tuple[np.ndarray, Any]] = {}
    for layer in range(spec.n_layers):
        names = tensor_names(layer)
        all_t[names["router"]] = (model.router[layer], None)
        all_t[names["norm"]] = (model.norm[layer], None)
    replaced = dict(tensors or {})
    if not all(n in replaced or n in set(omit) for layer in range(spec.n_layers)
               for p, n in tensor_names(layer).items() if p in EXPERT_PARTS):
        all_t.update(_expert_tensors(model))
    all_t.update(replaced)
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    add_keys(w, kv)
    skip = set(omit)
    for name, (arr, qt) in all_t.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    shards = len(w.fout or ())
    w.close()
    if shards > 1:
        return path.with_name(f"{path.stem}-00001-of-{shards:05d}{path.suffix}")
    return path
