"""GGUF files of MoE models (qwen3moe tensor names and keys): reading them into model arrays and
writing small ones (tests, `strata inspect` examples).

Every problem with a file is a GGUFError naming the file, the tensor or key, what it holds and
what was expected: a model loaded from the wrong file must fail at load, not produce numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError, GGUFError
from .formats import QuantFormat

ARCH = "qwen3moe"
#: (name suffix, spec field) of the integer keys a MoE file must carry
DIM_KEYS = (("block_count", "n_layers"), ("embedding_length", "hidden"),
            ("expert_count", "n_experts"), ("expert_used_count", "top_k"),
            ("expert_feed_forward_length", "ffn"))
EPS_KEY = "attention.layer_norm_rms_epsilon"
DEFAULT_RMS_EPS = 1e-6


def tensor_names(layer: int) -> dict[str, str]:
    p = f"blk.{layer}."
    return {"router": p + "ffn_gate_inp.weight", "norm": p + "ffn_norm.weight",
            "gate": p + "ffn_gate_exps.weight", "up": p + "ffn_up_exps.weight",
            "down": p + "ffn_down_exps.weight"}


# ---------------------------------------------------------------------------- reading
def _field(reader, name: str):
    f = reader.fields.get(name)
    return None if f is None else f.contents()


def _type_name(t: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(t)).name
    except ValueError:
        return f"type {int(t)}"


def _shape(t) -> tuple[int, ...]:
    """A tensor's logical shape, outermost first (GGUF stores it innermost first)."""
    return tuple(int(x) for x in reversed(list(t.shape)))


def _dequantizable(t) -> bool:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if int(t.tensor_type) in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    try:
        dequantize(t.data[:1], t.tensor_type)
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _as_float(path: Path, t) -> np.ndarray:
    from gguf.quants import dequantize

    if not _dequantizable(t):
        raise GGUFError(f"{path}: tensor {t.name} has type {_type_name(t.tensor_type)}, which "
                        "strata_rt cannot read as float (use F32, F16, BF16 or a type the gguf "
                        "package dequantizes)")
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(_shape(t))


def read_header(path: Path) -> tuple[Any, dict[str, Any]]:
    """Opens the file (memory-mapped) and reads the MoE dims; returns (reader, dims) with dims
    keyed by MoESpec field names."""
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueError/struct errors
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: key general.architecture is missing; expected e.g. {ARCH!r}")
    dims: dict[str, Any] = {"arch": arch}
    for suffix, field in DIM_KEYS:
        key = f"{arch}.{suffix}"
        v = _field(reader, key)
        if v is None:
            raise GGUFError(f"{path}: key {key} is missing (an MoE GGUF needs "
                            f"{', '.join(arch + '.' + s for s, _ in DIM_KEYS)})")
        if isinstance(v, list | str | bool) or int(v) != v or int(v) <= 0:
            raise GGUFError(f"{path}: key {key} = {v!r}; expected a positive integer")
        dims[field] = int(v)
    eps = _field(reader, f"{arch}.{EPS_KEY}")
    # stored as float32: take its shortest decimal form so 1e-6 reads back as 1e-6
    dims["rms_eps"] = DEFAULT_RMS_EPS if eps is None else float(str(np.float32(eps)))
    if dims["top_k"] > dims["n_experts"]:
        raise GGUFError(f"{path}: key {arch}.expert_used_count = {dims['top_k']} exceeds "
                        f"{arch}.expert_count = {dims['n_experts']}")
    return reader, dims


def read_moe_gguf(path: Path, fmt: QuantFormat):
    """-> (MoESpec, router [L, E, H], norm [L, H], blobs uint8 [L, E, blob_bytes])."""
    from .model import MoESpec

    reader, d = read_header(path)
    arch = d.pop("arch")
    L, H, F, E = d["n_layers"], d["hidden"], d["ffn"], d["n_experts"]
    try:
        spec = MoESpec(format=fmt.name, **d)
        lay = fmt.layout(H, F)
    except Exception as e:
        raise GGUFError(f"{path}: dims from the keys do not fit format {fmt.name}: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    want = {"router": (E, H), "norm": (H,), "gate": (E, F, H), "up": (E, F, H),
            "down": (E, H, F)}
    router = np.empty((L, E, H), np.float32)
    norm = np.empty((L, H), np.float32)
    blobs = np.empty((L, E, lay.blob_bytes), np.uint8)
    converted: set[str] = set()  # GGUF types that go through float weights
    for layer in range(L):
        names = tensor_names(layer)
        got = {}
        for part, name in names.items():
            t = tensors.get(name)
            if t is None:
                raise GGUFError(f"{path}: tensor {name} is missing ({arch}.block_count = {L} "
                                f"says layer {layer} exists)")
            shape = _shape(t)
            if shape != want[part]:
                if len(shape) == len(want[part]) and part != "norm" and shape[0] != E \
                        and shape[1:] == want[part][1:]:
                    raise GGUFError(f"{path}: tensor {name} holds {shape[0]} experts but key "
                                    f"{arch}.expert_count = {E}")
                raise GGUFError(
                    f"{path}: tensor {name} has shape {list(shape)}; expected {list(want[part])}"
                    f" from the keys (n_experts={E}, ffn={F}, hidden={H})")
            got[part] = t
        router[layer] = _as_float(path, got["router"])
        norm[layer] = _as_float(path, got["norm"])
        for part in ("gate", "up", "down"):
            t = got[part]
            if fmt.ggml_type is None or int(t.tensor_type) != fmt.ggml_type:
                converted.add(_type_name(t.tensor_type))
                if not _dequantizable(t):
                    raise GGUFError(
                        f"{path}: tensor {t.name} has type {_type_name(t.tensor_type)}: format "
                        f"{fmt.name} does not take it raw and the gguf package cannot "
                        f"dequantize it")
        try:
            blobs[layer] = fmt.pack_gguf_experts(got["gate"], got["up"], got["down"])
        except FormatError as e:
            raise GGUFError(f"{path}: layer {layer} experts ({names['gate']}, {names['up']}, "
                            f"{names['down']}) do not convert to {fmt.name}: {e}") from None
    if converted:  # nothing falls back silently: one line per file, not one per layer
        print(f"strata: {path}: expert tensors of type {', '.join(sorted(converted))} are not "
              f"{fmt.name}; converted through float weights (dequantized by the gguf package, "
              f"then quantized)", file=sys.stderr)
    return spec, router, norm, blobs


# ---------------------------------------------------------------------------- writing
def _expert_tensors(model) -> dict[str, tuple[np.ndarray, Any]]:
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
            raw = model.blobs[layer]
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
            for i, p in enumerate(("gate", "up", "down")):
                out[names[p]] = (np.stack([m[i] for m in mats]).astype(np.float32), None)
    return out


def write_moe_gguf(path: str | Path, model, *, arch: str = ARCH, omit: Iterable[str] = (),
                   keys: Mapping[str, Any] | None = None,
                   tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None) -> Path:
    """Writes `model` as a qwen3moe-style GGUF. For tests of bad files: `omit` leaves tensors
    out, `keys` overrides keys by full name (None drops one; ints are written as uint32),
    `tensors` replaces tensors by name with (array, GGMLQuantizationType or None)."""
    from gguf import GGUFWriter

    path = Path(path)
    spec = model.spec
    kv: dict[str, Any] = {f"{arch}.{suffix}": getattr(spec, field) for suffix, field in DIM_KEYS}
    kv[f"{arch}.{EPS_KEY}"] = float(spec.rms_eps)
    kv.update(keys or {})
    all_t: dict[str, tuple[np.ndarray, Any]] = {}
    for layer in range(spec.n_layers):
        names = tensor_names(layer)
        all_t[names["router"]] = (model.router[layer], None)
        all_t[names["norm"]] = (model.norm[layer], None)
    all_t.update(_expert_tensors(model))
    all_t.update(tensors or {})
    w = GGUFWriter(str(path), arch)
    for k, v in kv.items():
        if v is None:
            continue
        if isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_uint32(k, int(v))
    skip = set(omit)
    for name, (arr, qt) in all_t.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
