"""The benchmark's GGUF files: their shapes, a writer that streams them tensor by tensor, and
the cache folder that keeps them between runs.

The writer is the project's file format: the keys of strata_rt.models.qwen3.write_qwen3_gguf
(the MoE dims, `spec_keys`, the tokenizer keys of a TokenizerVocab, which llama.cpp needs to load
a file) through strata_rt.weights.gguf_file.gguf_io.add_keys, llama.cpp's tensor names, the same tensor
order and alignment; but where write_qwen3_gguf takes every array first, this one writes the
tensor list from the plan's shapes and then makes and writes each tensor in turn, so it holds
one tensor at a time (the largest: one expert tensor of a layer, 165 MB at the 30B shape).

A file is written as <name>.partial-<pid> and renamed when complete: a file under its own name
is whole. It is reused when its header opens (strata_rt's checks: every tensor inside the file,
the data ending where the file does) and lists the plan's tensors, types and shapes.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_rt.models.qwen3.gguf_full import ARCH, spec_keys
from strata_rt.models.qwen3.spec import Qwen3Spec
from strata_rt.weights.gguf_file.gguf_io import DIM_KEYS, EPS_KEY, add_keys

from .mixes import MIXES, PlannedTensor, plan_for

#: a 2-layer shape of the same kind, for checking the whole pipeline on any machine
TINY = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=1024,
                 ffn=256, n_experts=8, top_k=2, context=512)
#: room left on the disk beside a file being written
DISK_MARGIN = 1 << 30


@dataclass(frozen=True)
class Shape:
    """What the files are made of: the model's dims, its synthetic options and seed."""

    name: str
    spec: Qwen3Spec
    options: dict[str, Any]
    seed: int

    def file_name(self, mix: str) -> str:
        return f"{self.name}-{mix}.gguf"

    def plan(self, mix: str) -> list[PlannedTensor]:
        return plan_for(mix, self.spec, self.options, self.seed)

    def data_bytes(self, mix: str) -> int:
        return sum(t.nbytes for t in self.plan(mix))


def shape_of(config: Any, tiny: bool) -> Shape:
    """The config's synthetic whole model (its dims, options and seed), or TINY with the
    config's options and seed."""
    if config.whole is None:
        raise ValueError("the config is not a synthetic whole model (model.synthetic with "
                         "n_heads, n_kv_heads, head_dim and vocab)")
    options = {k: v for k, v in config.whole_options.items() if k != "pool_layers"}
    if tiny:
        return Shape("tiny-qwen3moe", TINY, options, config.model_seed)
    stem = Path(str(config.source)).stem if config.source else "model"
    return Shape(stem.removesuffix("-whole"), config.whole, options, config.model_seed)


def vocab_for(spec: Qwen3Spec) -> Any:
    """A byte-level BPE vocabulary of the model's size (Qwen3's token and merge counts for
    the real vocabulary size; strata_rt.text.large_vocab)."""
    from strata_rt.text.large_vocab import QWEN3_MERGES, QWEN3_TOKENS, large_vocab

    if spec.vocab == QWEN3_TOKENS:
        return large_vocab(QWEN3_TOKENS, QWEN3_MERGES)
    return large_vocab(spec.vocab, max(1, spec.vocab - 256 - 26 - 64))


def file_keys(spec: Qwen3Spec, vocab: Any) -> dict[str, Any]:
    """The keys in write_qwen3_gguf's order: the MoE dims and epsilon, the model's keys, the
    tokenizer's."""
    kv: dict[str, Any] = {f"{ARCH}.{suffix}": getattr(spec, name) for suffix, name in DIM_KEYS}
    kv[f"{ARCH}.{EPS_KEY}"] = float(spec.rms_eps)
    kv.update(spec_keys(spec))
    kv.update(vocab.gguf_keys())
    return kv


def _info(t: PlannedTensor) -> tuple[tuple[int, ...], Any, Any]:
    """(shape as the writer takes it, numpy dtype, GGML type or None) of a planned tensor."""
    from gguf import GGMLQuantizationType

    if t.type == "F32":
        return t.shape, np.dtype(np.float32), None
    if t.type == "F16":
        return t.shape, np.dtype(np.float16), None
    return (*t.shape[:-1], t.row_bytes), np.dtype(np.uint8), GGMLQuantizationType[t.type]


def write_streamed(path: Path, spec: Qwen3Spec, vocab: Any, plan: list[PlannedTensor]) -> None:
    """Writes the file (module doc): header, keys and tensor list, then each tensor made and
    written in the plan's order."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), ARCH)
    try:
        add_keys(w, file_keys(spec, vocab))
        for t in plan:
            shape, dtype, qt = _info(t)
            w.add_tensor_info(t.name, shape, dtype, t.nbytes, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            shape, dtype, _ = _info(t)
            arr = np.ascontiguousarray(t.make())
            if arr.dtype != dtype or tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{t.name}: made {arr.dtype} {list(arr.shape)}, planned "
                                 f"{dtype} {list(shape)} ({t.type})")
            w.write_tensor_data(arr)
    finally:
        w.close()


def stale_reason(path: Path, plan: list[PlannedTensor]) -> str | None:
    """None when the file at `path` is whole and holds the plan's tensors, else why not."""
    from gguf import GGMLQuantizationType

    from strata_rt.errors import GGUFError
    from strata_rt.weights.gguf_file.gguf_io import open_reader

    try:
        header = open_reader(path)
    except (GGUFError, OSError) as e:
        return f"it does not open: {str(e).splitlines()[0]}"
    have = {t.name: (GGMLQuantizationType(int(t.tensor_type)).name,
                     tuple(int(x) for x in reversed(list(t.shape)))) for t in header.tensors}
    want = {t.name: (t.type, t.shape) for t in plan}
    if have != want:
        diff = sorted(set(have.items()) ^ set(want.items()))
        return f"its tensors differ from the plan's ({len(diff)} entries, e.g. {diff[0]})"
    return None


@dataclass
class Written:
    """A file ready for the run: where, how big, whether it was reused, the seconds taken."""

    path: Path
    bytes: int
    reused: bool
    seconds: float
    note: str = ""


def ensure_file(folder: Path, shape: Shape, mix: str) -> Written:
    """The mix's file in `folder`, written once (module doc)."""
    if mix not in MIXES:
        raise ValueError(f"unknown file {mix!r}; known: {', '.join(MIXES)}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / shape.file_name(mix)
    plan = shape.plan(mix)
    t0 = time.perf_counter()
    note = ""
    if path.is_file():
        why = stale_reason(path, plan)
        if why is None:
            return Written(path, path.stat().st_size, True, time.perf_counter() - t0)
        note = f"rewrote {path.name}: {why}"
        print(note, file=sys.stderr, flush=True)
    need = sum(t.nbytes for t in plan)
    free = shutil.disk_usage(folder).free
    if free < need + DISK_MARGIN:
        raise OSError(f"{folder}: {free / 2**30:,.1f} GiB free; {path.name} needs "
                      f"{need / 2**30:,.1f} GiB and {DISK_MARGIN >> 30} GiB to spare (--dir "
                      "names another folder)")
    print(f"writing {path} ({need / 2**30:,.2f} GiB of tensors) ...", file=sys.stderr,
          flush=True)
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        write_streamed(tmp, shape.spec, vocab_for(shape.spec), plan)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    took = time.perf_counter() - t0
    print(f"wrote {path.name}: {path.stat().st_size / 2**30:,.2f} GiB in {took:,.1f} s",
          file=sys.stderr, flush=True)
    return Written(path, path.stat().st_size, False, took, note)
