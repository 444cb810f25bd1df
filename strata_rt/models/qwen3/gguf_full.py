"""Whole qwen3moe GGUF files: every tensor and key, read into a Qwen3Model or written from one.

Names and keys are llama.cpp's (the gguf package's tables for MODEL_ARCH.QWEN3MOE):
token_embd, output_norm, output (absent = tied to token_embd); per layer blk.N.attn_norm,
attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate_inp and the
three expert tensors. The MoE part (ffn_norm, ffn_gate_inp, experts and their conversion to the
run's format) goes through strata_rt.weights.gguf_file.gguf_io, so both loaders report a broken file alike.
Dense tensors may be of any type the gguf package dequantizes (F32, F16, BF16, Q8_0, the
K-quants, IQ4_XS, ...); they are kept as stored (DenseTensor) and dequantized where used,
read from the file's descriptor once the model is open (weights.gguf_file.opened_file).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, GGUFError
from ...formats.contract import QuantFormat
from ...weights.gguf_file.gguf_checks import check_dense
from ...weights.gguf_file.gguf_header import Header
from ...weights.gguf_file.gguf_io import (
    open_reader,
    problems_error,
    read_header,
    typed_keys,
    write_moe_gguf,
)
from ...weights.gguf_file.gguf_keys import TOKENIZER, number
from ...weights.gguf_file.opened_file import TensorBytes
from ...weights.model import Model
from .spec import Qwen3Spec
from .weights import (
    GLOBAL_ROLES,
    LAYER_ROLES,
    DenseTensor,
    DenseWeights,
    LayerWeights,
    Qwen3Model,
    expected_shapes,
    ggml_type,
    resolve_format,
    tensor_name,
)
from .whole_memory import DenseTypes

log = logging.getLogger(__name__)

ARCH = "qwen3moe"
#: llama.cpp's defaults for keys a file may leave out
DEFAULT_ROPE_THETA = 10_000.0


def spec_keys(spec: Qwen3Spec, arch: str = ARCH) -> dict[str, Any]:
    """The `<arch>.*` keys that describe `spec` (ints are written as uint32, floats as
    float32)."""
    a = arch
    return {f"{a}.block_count": spec.n_layers, f"{a}.context_length": spec.context,
            f"{a}.embedding_length": spec.hidden, f"{a}.vocab_size": spec.vocab,
            f"{a}.attention.head_count": spec.n_heads,
            f"{a}.attention.head_count_kv": spec.n_kv_heads,
            f"{a}.attention.key_length": spec.head_dim,
            f"{a}.attention.value_length": spec.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(spec.rms_eps),
            f"{a}.rope.freq_base": float(spec.rope_theta),
            f"{a}.expert_count": spec.n_experts, f"{a}.expert_used_count": spec.top_k,
            f"{a}.expert_feed_forward_length": spec.ffn}


# ---------------------------------------------------------------------------- reading
def _open(path: Path) -> tuple[Header, dict[str, Any], dict[str, Any]]:
    header, dims = read_header(path)
    if dims["arch"] != ARCH:
        raise GGUFError(f"{path}: general.architecture = {dims['arch']!r}; the whole-model "
                        f"loader takes {ARCH!r} files (Qwen3-MoE)")
    return header, dims, {t.name: t for t in header.tensors}


def _key(header: Header, path: Path, name: str, default: Any = None) -> Any:
    """A key's value (type and range already checked at open), the default when absent."""
    v = number(header, name)
    if v is None:
        if default is None:
            raise GGUFError(f"{path}: key {name} is missing (a whole {ARCH} model needs it)")
        return default
    return v


def _spec(header: Header, path: Path, dims: dict[str, Any], tensors: dict[str, Any]
          ) -> Qwen3Spec:
    a = ARCH
    n_heads = _key(header, path, f"{a}.attention.head_count")
    n_kv = _key(header, path, f"{a}.attention.head_count_kv")
    # llama.cpp's rule when key_length is absent: hidden / heads
    head_dim = _key(header, path, f"{a}.attention.key_length",
                    default=max(1, dims["hidden"] // n_heads))
    v_len = _key(header, path, f"{a}.attention.value_length", default=head_dim)
    if v_len != head_dim:
        raise GGUFError(f"{path}: key {a}.attention.value_length = {v_len} differs from "
                        f"{a}.attention.key_length = {head_dim}; Qwen3-MoE uses one head size")
    rope_dims = number(header, f"{a}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise GGUFError(f"{path}: key {a}.rope.dimension_count = {rope_dims} but heads have "
                        f"{head_dim} dims; strata_rt rotates whole heads (Qwen3)")
    embd = tensors.get(tensor_name("token_embd"))
    if embd is None:
        raise problems_error(path, [f"tensor {tensor_name('token_embd')} is missing"])
    if len(embd.shape) != 2:
        raise problems_error(path, [f"tensor {embd.name} has {len(embd.shape)} dims "
                                    f"{list(reversed(embd.shape))}; expected [vocabulary, hidden]"])
    vocab = int(embd.shape[-1])
    key_vocab = number(header, f"{a}.vocab_size")
    if key_vocab is not None and key_vocab != vocab:
        raise GGUFError(f"{path}: key {a}.vocab_size = {key_vocab} but tensor "
                        f"{embd.name} holds {vocab} rows")
    check_vocabulary(header, path, embd.name, vocab)
    theta = _key(header, path, f"{a}.rope.freq_base", default=DEFAULT_ROPE_THETA)
    if f"{a}.rope.freq_base" not in header.keys:
        log.info("%s: no %s.rope.freq_base key; using llama.cpp's default %g", path, a, theta)
    try:
        return Qwen3Spec(n_layers=dims["n_layers"], hidden=dims["hidden"], n_heads=n_heads,
                         n_kv_heads=n_kv, head_dim=head_dim, vocab=vocab,
                         ffn=dims["ffn"], n_experts=dims["n_experts"], top_k=dims["top_k"],
                         rope_theta=theta, rms_eps=dims["rms_eps"],
                         context=_key(header, path, f"{a}.context_length"))
    except ConfigError as e:
        raise GGUFError(f"{path}: the keys do not describe a valid model: "
                        f"{'; '.join(e.problems)}") from None


def check_vocabulary(header: Header, path: Path, embd_name: str, rows: int) -> None:
    """The tokenizer's token count (and the ids it names) against the embedding's rows, at
    load: a mismatch would surface only at the first id past the shorter of the two."""
    tokens = header.keys.get(TOKENIZER + "tokens")
    if tokens is None:
        return
    if tokens.count != rows:
        raise GGUFError(f"{path}: key {TOKENIZER}tokens holds {tokens.count:,} tokens but "
                        f"tensor {embd_name} has {rows:,} rows; the vocabulary and the "
                        "embedding must be the same size")


def read_qwen3_spec(path: str | Path) -> tuple[Qwen3Spec, bool]:
    """The model's dimensions from the keys (vocabulary from token_embd) and whether its
    output head is tied, without reading any weight."""
    path = Path(path)
    header, dims, tensors = _open(path)
    return _spec(header, path, dims, tensors), tensor_name("output") not in tensors


def read_dense_types(path: str | Path) -> DenseTypes:
    """The GGML types of the dense matrices the GPU holds (each layer's q, k, v, o and the
    head), without reading any weight: what sizes the dense part in VRAM."""
    from gguf import GGMLQuantizationType

    path = Path(path)
    header, dims, tensors = _open(path)

    def type_of(name: str) -> str | None:
        t = tensors.get(name)
        if t is None:
            return None
        try:
            return GGMLQuantizationType(int(t.tensor_type)).name
        except ValueError:
            raise problems_error(path, [f"tensor {name} has GGML type {int(t.tensor_type)}, "
                                        "which the gguf package does not know"]) from None

    try:
        return DenseTypes.lookup(dims["n_layers"], type_of)
    except KeyError as e:
        raise problems_error(path, [f"tensor {e.args[0]} is missing"]) from None


def _why(spec: Qwen3Spec, role: str) -> str:
    a = ARCH
    H = f"{a}.embedding_length={spec.hidden}"
    q = f"{a}.attention.head_count={spec.n_heads} x key_length={spec.head_dim}"
    kv = f"{a}.attention.head_count_kv={spec.n_kv_heads} x key_length={spec.head_dim}"
    return {"token_embd": f"vocabulary {spec.vocab}, {H}", "output": f"vocabulary "
            f"{spec.vocab} (token_embd), {H}", "attn_q": f"{q}, {H}", "attn_k": f"{kv}, {H}",
            "attn_v": f"{kv}, {H}", "attn_output": f"{H}, {q}",
            "attn_q_norm": f"{a}.attention.key_length", "attn_k_norm":
            f"{a}.attention.key_length"}.get(role, H)


def _dense(path: Path, spec: Qwen3Spec, t, role: str) -> DenseTensor:
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(list(t.shape)))
    want = expected_shapes(spec)[role]
    if shape != want:
        raise problems_error(path, [f"tensor {t.name} has shape {list(shape)}; expected "
                                    f"{list(want)} ({_why(spec, role)})"])
    qt = ggml_type(t.tensor_type)
    data = np.asarray(t.data)
    if data.dtype not in (np.float32, np.float16):
        data = data.reshape(*shape[:-1], -1)
        try:
            dequantize(data.reshape(-1, data.shape[-1])[:1], qt)
        except (NotImplementedError, ValueError, KeyError, AssertionError):
            raise problems_error(path, [f"tensor {t.name} has type {qt.name}, which the gguf "
                                        "package cannot dequantize (use F32, F16, BF16, Q8_0, "
                                        "a K-quant or an i-quant it reads)"]) from None
    source = None if t.opened is None else TensorBytes(t.opened, t.name, t.offset, t.n_bytes)
    return DenseTensor(t.name, shape, qt, data, source)


def dense_problems(dense: DenseWeights) -> list[str]:
    """NaN/Inf in the dense weights (gguf_checks.check_dense), one line per tensor."""
    all_t = [t for t in (dense.token_embd, dense.output_norm, dense.output) if t is not None]
    all_t += [getattr(lw, r) for lw in dense.layers for r in LAYER_ROLES]
    found = (check_dense(t.name, t.data, int(t.type), t.shape) for t in all_t)
    return [p for p in found if p is not None]


def read_qwen3_dense(path: str | Path) -> tuple[Qwen3Spec, DenseWeights]:
    """The spec and the dense weights (memory-mapped, shapes and types checked; values not
    yet: see dense_problems)."""
    path = Path(path)
    header, dims, tensors = _open(path)
    spec = _spec(header, path, dims, tensors)

    def find(role: str, layer: int | None = None, optional: bool = False
             ) -> DenseTensor | None:
        name = tensor_name(role, layer)
        t = tensors.get(name)
        if t is None:
            if optional:
                return None
            why = "" if layer is None else (f" ({ARCH}.block_count = {spec.n_layers} says "
                                            f"layer {layer} exists)")
            raise problems_error(path, [f"tensor {name} is missing{why}"])
        return _dense(path, spec, t, role)

    def get(role: str, layer: int | None = None) -> DenseTensor:
        t = find(role, layer)
        assert t is not None  # find raises for a missing tensor that is not optional
        return t

    glob = {r: find(r, optional=r == "output") for r in GLOBAL_ROLES}
    token_embd, output_norm = glob["token_embd"], glob["output_norm"]
    assert token_embd is not None and output_norm is not None  # find raised if missing
    layers = tuple(LayerWeights(**{r: get(r, i) for r in LAYER_ROLES})
                   for i in range(spec.n_layers))
    return spec, DenseWeights(token_embd, output_norm, glob["output"], layers)


def read_qwen3_gguf(path: str | Path, fmt: QuantFormat | str | None = None) -> Qwen3Model:
    """Loads a whole qwen3moe GGUF: dense weights as stored (memory-mapped) and checked for
    NaN/Inf, experts converted to `fmt` by the MoE loader (raw copy when the file's type is
    fmt's own; None: every layer as stored, Model.from_gguf)."""
    path = Path(path)
    spec, dense = read_qwen3_dense(path)
    problems = dense_problems(dense)
    if problems:
        raise problems_error(path, problems)
    moe = Model.from_gguf(path, None if fmt is None else resolve_format(fmt))
    types = sorted({t.type_name for t in (dense.token_embd, dense.output_norm, dense.output,
                                          *(getattr(lw, r) for lw in dense.layers
                                            for r in LAYER_ROLES)) if t})
    log.info("%s: %s; dense tensors %s%s; experts as %s", path, spec, ", ".join(types),
             " (output tied to token_embd)" if dense.output is None else "",
             "; ".join(moe.formats.describe()) if moe.formats.mixed else moe.fmt.name)
    whole = Qwen3Model(spec, dense, moe)
    whole.tokenizer_keys = typed_keys(open_reader(path), ("tokenizer.",))
    return whole


# ---------------------------------------------------------------------------- writing
def _as_writer_tensor(t: DenseTensor) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType

    if t.type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.ascontiguousarray(t.data), None
    return np.ascontiguousarray(t.data, dtype=np.uint8), t.type


def write_qwen3_gguf(path: str | Path, model: Qwen3Model, *, omit: Iterable[str] = (),
                     keys: Mapping[str, Any] | None = None,
                     tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None,
                     split_max_tensors: int = 0, tokenizer: Any = None) -> Path:
    """Writes `model` as a qwen3moe GGUF with llama.cpp's names and keys: dense tensors in
    their stored types, experts as gguf_io writes them (the format's own GGUF type when it
    has one, else F32), router and norms F32; no `output` tensor when the head is tied.
    For tests of bad files: `omit` leaves tensors out, `keys` overrides keys by full name
    (None drops one), `tensors` replaces tensors by name with (array, type or None).
    split_max_tensors > 0 writes a split GGUF (write_moe_gguf). `tokenizer`: a TokenizerVocab
    whose keys the file carries (or a mapping of tokenizer keys as add_keys writes them);
    None: the model's own (`tokenizer_keys`, those of the file it was read from)."""
    kv: dict[str, Any] = spec_keys(model.spec)
    kv.update(getattr(model, "tokenizer_keys", {}))
    if tokenizer is not None:
        kv.update(tokenizer if isinstance(tokenizer, Mapping) else tokenizer.gguf_keys())
    kv.update(keys or {})
    dense = {t.name: _as_writer_tensor(t) for _, t in model.named_roles()}
    dense.update(tensors or {})
    return write_moe_gguf(path, model.moe, arch=ARCH, omit=omit, keys=kv, tensors=dense,
                          split_max_tensors=split_max_tensors)
