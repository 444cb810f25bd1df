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

import math
import mmap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_checks
from .errors import GGUFError

ARCH = "qwen3moe"
#: (name suffix, spec field) of the integer keys a MoE file must carry
DIM_KEYS = (("block_count", "n_layers"), ("embedding_length", "hidden"),
            ("expert_count", "n_experts"), ("expert_used_count", "top_k"),
            ("expert_feed_forward_length", "ffn"))
EPS_KEY = "attention.layer_norm_rms_epsilon"
DEFAULT_RMS_EPS = 1e-6
EXPERT_PARTS = ("gate", "up", "down")
#: tensors of one truncated file listed one by one; the rest are counted
MAX_LISTED = 10


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


def problems_error(path: Path, problems: list[str]) -> GGUFError:
    """One GGUFError for all of a file's problems (one line each)."""
    if len(problems) == 1:
        return GGUFError(f"{path}: {problems[0]}")
    lines = "\n".join(f"  - {p}" for p in problems)
    return GGUFError(f"{path}: {len(problems)} problems:\n{lines}")


# ---------------------------------------------------------------------------- the reader
class _ShortRead(Exception):
    def __init__(self, end: int):
        self.end = end


class _BadTensors(Exception):
    def __init__(self, problems: list[str]):
        self.problems = problems


def _reader_class() -> type:
    """GGUFReader that checks every range against the file size before numpy sees it: the
    plain reader turns a truncated file into "cannot reshape array of size ..." or "index 0 is
    out of bounds"; this one names the tensor, the bytes it needs and the bytes there are."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if int(count) < 0 or end > len(self.data):
                raise _ShortRead(end)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            size, bad, short = len(self.data), [], []
            for f in fields:
                _, name_data, _, dims, raw_type, offset = f.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qt = GGMLQuantizationType(int(raw_type[0]))
                    block, type_bytes = GGML_QUANT_SIZES[qt]
                except (ValueError, KeyError):
                    bad.append(f"tensor {name} has type id {int(raw_type[0])}, which this gguf "
                               "package does not know")
                    continue
                shape = [int(d) for d in dims]
                if shape and shape[0] % block:
                    bad.append(f"tensor {name}: rows of {shape[0]} values are not a multiple "
                               f"of the {qt.name} block of {block}")
                    continue
                lo = int(start_offs) + int(offset[0])
                hi = lo + math.prod(shape) // block * type_bytes
                if hi > size:
                    short.append((name, lo, hi))
            for name, lo, hi in short[:MAX_LISTED]:
                bad.append(f"the file is truncated: tensor {name} needs bytes {lo:,}..{hi:,} "
                           f"({hi - lo:,} bytes); the file has {size:,} bytes")
            if len(short) > MAX_LISTED:
                bad.append(f"{len(short) - MAX_LISTED} more tensors end past the file's "
                           f"{size:,} bytes")
            if bad:
                raise _BadTensors(bad)
            super()._build_tensors(start_offs, fields)

    return Reader


def open_reader(path: Path) -> Any:
    """The gguf package's reader (memory-mapped) with every failure as a GGUFError."""
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory; expected a GGUF file")
    if not path.exists():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise GGUFError(f"{path}: the file is empty (0 bytes); expected a GGUF file")
        return _reader_class()(str(path))
    except _ShortRead as e:
        raise GGUFError(f"{path}: not a readable GGUF file: its header is cut short (reading "
                        f"its keys and tensor list needs {e.end:,} bytes; the file has "
                        f"{size:,} bytes)") from None
    except _BadTensors as e:
        raise problems_error(path, e.problems) from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read it: {e.strerror or e}") from None
    except Exception as e:  # the gguf package raises bare ValueError/KeyError on bad headers
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: Any, name: str) -> Any:
    f = reader.fields.get(name)
    return None if f is None else f.contents()


def read_header(path: Path) -> tuple[Any, dict[str, Any]]:
    """Opens the file (memory-mapped) and reads the MoE dims; returns (reader, dims) with dims
    keyed by MoESpec field names plus "arch"."""
    path = Path(path)
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: key general.architecture is missing; expected e.g. {ARCH!r}")
    dims: dict[str, Any] = {"arch": arch}
    problems, missing = [], []
    for suffix, name in DIM_KEYS:
        key = f"{arch}.{suffix}"
        v = _field(reader, key)
        if v is None:
            missing.append(key)
        elif isinstance(v, list | str | bool) or int(v) != v or int(v) <= 0:
            problems.append(f"key {key} = {v!r}; expected a positive integer")
        else:
            dims[name] = int(v)
    if missing:
        problems.insert(0, f"key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        f"{'are' if len(missing) > 1 else 'is'} missing (an MoE GGUF of "
                        f"architecture {arch!r} needs "
                        f"{', '.join(arch + '.' + s for s, _ in DIM_KEYS)})")
    if problems:
        raise problems_error(path, problems)
    eps = _field(reader, f"{arch}.{EPS_KEY}")
    # stored as float32: take its shortest decimal form so 1e-6 reads back as 1e-6
    dims["rms_eps"] = DEFAULT_RMS_EPS if eps is None else float(str(np.float32(eps)))
    if not dims["rms_eps"] > 0 or not math.isfinite(dims["rms_eps"]):
        raise GGUFError(f"{path}: key {arch}.{EPS_KEY} = {dims['rms_eps']}; expected a "
                        "number > 0")
    if dims["top_k"] > dims["n_experts"]:
        raise GGUFError(f"{path}: key {arch}.expert_used_count = {dims['top_k']} exceeds "
                        f"{arch}.expert_count = {dims['n_experts']}")
    return reader, dims


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

    @classmethod
    def of(cls, t: Any) -> TensorRef:
        return cls(t.name, int(t.tensor_type), tuple(int(x) for x in reversed(list(t.shape))),
                   int(t.data_offset), int(t.n_bytes))

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


class FileMap:
    """A read-only memory map of one file. `bytes(ref)` views a tensor without copying;
    `release(ref)` drops its pages from this process (they stay in the page cache), so a
    layer-by-layer copy holds about one layer of the file at a time."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.path = path

    def bytes(self, ref: TensorRef) -> np.ndarray:
        return np.frombuffer(self._map, np.uint8, ref.nbytes, ref.offset)

    def release(self, ref: TensorRef) -> None:
        self.release_range(ref.offset, ref.nbytes)

    def release_range(self, offset: int, nbytes: int) -> None:
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or nbytes <= 0:
            return
        lo = offset - offset % mmap.PAGESIZE
        self._map.madvise(advice, lo, offset + nbytes - lo)


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
    problems: list[str] = field(default_factory=list)

    def raise_problems(self) -> None:
        if self.problems:
            raise problems_error(self.path, self.problems)


def _read_float(t: Any, out: np.ndarray, problems: list[str]) -> bool:
    from gguf.quants import dequantize

    if not gguf_checks.dequantizable(int(t.tensor_type)):
        problems.append(f"tensor {t.name} has type {_type_name(t.tensor_type)}, which "
                        "strata_rt cannot read as float (use F32, F16, BF16 or a type the gguf "
                        "package dequantizes)")
        return False
    out[...] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(out.shape)
    return True


def _shape_problem(name: str, part: str, shape: tuple[int, ...], want: tuple[int, ...],
                   arch: str, dims: dict[str, Any]) -> str | None:
    if shape == want:
        return None
    E = dims["n_experts"]
    if len(shape) == len(want) and part != "norm" and shape[0] != E and shape[1:] == want[1:]:
        return f"tensor {name} holds {shape[0]} experts but key {arch}.expert_count = {E}"
    return (f"tensor {name} has shape {list(shape)}; expected {list(want)} from the keys "
            f"(n_experts={E}, ffn={dims['ffn']}, hidden={dims['hidden']})")


def scan_moe(path: Path) -> MoEFile:
    """Reads the header and the router and norm weights and checks every tensor the engine
    reads for presence, shape and type, and router and norm for NaN/Inf. A file that cannot
    be read at all raises GGUFError; problems with tensors are collected in `.problems`.
    Expert values are checked separately (`gguf_checks.check_experts`): that reads the whole
    file."""
    path = Path(path)
    reader, dims = read_header(path)
    arch = dims.pop("arch")
    L, H, F, E = dims["n_layers"], dims["hidden"], dims["ffn"], dims["n_experts"]
    want = {"router": (E, H), "norm": (H,), "gate": (E, F, H), "up": (E, F, H),
            "down": (E, H, F)}
    tensors = {t.name: t for t in reader.tensors}
    router = np.zeros((L, E, H), np.float32)
    norm = np.zeros((L, H), np.float32)
    moe = MoEFile(path, arch, dims, router, norm, [])
    for t in reader.tensors:
        moe.tensors[t.name] = TensorRef.of(t)
        if "_exps." in t.name:
            k = _type_name(t.tensor_type)
            moe.types[k] = moe.types.get(k, 0) + 1
    for layer in range(L):
        names = tensor_names(layer)
        refs: dict[str, TensorRef] = {}
        for part, name in names.items():
            t = tensors.get(name)
            if t is None:
                moe.problems.append(f"tensor {name} is missing ({arch}.block_count = {L} says "
                                    f"layer {layer} exists)")
                continue
            ref = moe.tensors[name]
            bad = _shape_problem(name, part, ref.shape, want[part], arch, dims)
            if bad is not None:
                moe.problems.append(bad)
            elif part == "router":
                if _read_float(t, router[layer], moe.problems):
                    moe.problems += gguf_checks.check_router(name, layer, router[layer])
            elif part == "norm":
                if _read_float(t, norm[layer], moe.problems):
                    moe.problems += gguf_checks.check_norm(name, layer, norm[layer])
            else:
                refs[part] = ref
        moe.experts.append(refs if len(refs) == len(EXPERT_PARTS) else None)
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


def add_keys(writer: Any, keys: Mapping[str, Any]) -> None:
    """Adds keys to a gguf.GGUFWriter typed from their values, as llama.cpp's converter types
    them: bool, float32, string, arrays (tokenizer tokens, merges, token types) and uint32 for
    whole numbers; None leaves a key out (tests of files without it)."""
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, bool):
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
                   tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None) -> Path:
    """Writes `model` (anything with .spec, .fmt, .layout, .router, .norm, .expert_blob and
    .dequantized) as a qwen3moe-style GGUF. For tests of bad files: `omit` leaves tensors
    out, `keys` overrides keys by full name (None drops one; ints are written as uint32),
    `tensors` replaces tensors by name with (array, GGMLQuantizationType or None)."""
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
    w = GGUFWriter(str(path), arch)
    add_keys(w, kv)
    skip = set(omit)
    for name, (arr, qt) in all_t.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
