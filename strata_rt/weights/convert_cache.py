"""A conversion a config asks for (its `format` is not the type of the file's expert tensors),
written once as a GGUF and reused by every later open.

Converting a Qwen3-30B's experts takes minutes on every core; a run that converts at each open
pays them again and again. The first open writes the converted model to the cache folder
(STRATA_CONVERT_CACHE, default ~/.cache/strata_rt/converted), every key of the source copied
(the tokenizer and chat template included) and every tensor as stored but the experts, which
are in the format's GGUF type, so later opens copy them raw. A progress line on stderr counts
the experts converted. The cached file is named by the source's stem, the format and a key of
the source's identity (for every shard: resolved path, size, modification time, inode, device)
and the format's name, and it carries that key (`strata.converted.key`): a source edited,
replaced or re-downloaded gets a new key and a new conversion. The user's files are never
written: the file is made under a temporary name in the cache folder and renamed into place,
and a file of that name that is not a conversion of ours is left alone (the run converts in
memory instead, as it does when the folder lacks the room or cannot be written).

Only formats whose blob is the tensors' bytes in their GGUF type (gate rows, up rows, down rows)
can be cached: a file of another layout would be converted again at load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ..config.files.input_files import user_path
from ..config.settings import env
from ..errors import GGUFError
from .gguf_file.gguf_format import expert_types
from .gguf_file.gguf_header import Header
from .gguf_file.gguf_io import (
    EXPERT_PARTS,
    add_keys,
    open_moe,
    open_reader,
    tensor_names,
    typed_keys,
)

log = logging.getLogger(__name__)

CACHE_SWITCH = "STRATA_CONVERT_CACHE"
#: the keys a cached conversion carries
MARK = "strata.converted."
#: bumped when what this module writes changes (older conversions are then redone)
LAYOUT_VERSION = 1
#: converted experts held at once while the file is written
CHUNK_BYTES = 1 << 30
#: room left on the cache's disk after the file
SPARE_BYTES = 1 << 30
#: keys the writer makes itself or that describe the source's files, not the model
_NOT_COPIED = ("general.architecture", "general.alignment", "split.no", "split.count",
               "split.tensors.count")


def cache_dir() -> Path:
    configured = env.text(CACHE_SWITCH)
    if configured:
        return user_path(configured)  # checked at the start
    return Path.home() / ".cache" / "strata_rt" / "converted"


def source_key(header: Header, fmt: Any) -> str:
    """The key of (the source's files as they are now, the target format)."""
    parts: list[Any] = [LAYOUT_VERSION, fmt.name]
    for shard in header.shards or (header.path,):
        st = os.stat(shard)
        parts += [shard.resolve(), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:20]


def needs_conversion(header: Header, fmt: Any) -> bool:
    return any(t != fmt.ggml_type for t in expert_types(header).values())


def _part_bytes(fmt: Any, hidden: int, ffn: int) -> tuple[int, int, int] | None:
    """Bytes of one expert's gate, up and down rows in fmt's GGUF type, when fmt's blob is
    exactly those rows in that order (else None: not cacheable)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if fmt.ggml_type is None:
        return None
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)]
    if hidden % block or ffn % block:
        return None
    g = ffn * hidden // block * size
    d = hidden * ffn // block * size
    lay = fmt.layout(hidden, ffn)
    if (lay.gate_up_offset, lay.gate_up_bytes, lay.down_offset, lay.down_bytes,
            lay.blob_bytes) != (0, 2 * g, 2 * g, d, 2 * g + d):
        return None
    return g, g, d


def converted_path(path: Path, fmt: Any) -> Path | None:
    """The cached conversion of the GGUF at `path` to `fmt`, written now when absent (with
    progress on stderr); None when nothing needs converting or it cannot be cached (the
    reason logged: the run then converts in memory)."""
    header = open_reader(path)
    if not needs_conversion(header, fmt):
        return None
    moe = open_moe(path)
    parts = _part_bytes(fmt, moe.dims["hidden"], moe.dims["ffn"])
    if parts is None:
        log.info("%s: format %s keeps its own blob layout; its conversion is not cached",
                 path, fmt.name)
        return None
    key = source_key(header, fmt)
    stem = path.name.removesuffix(".gguf")
    folder = cache_dir()
    target = folder / f"{stem}.{fmt.name}.{key}.gguf"
    if target.exists():
        why = _not_ours(target, key)
        if why is None:
            log.info("%s: experts as %s from the conversion cache, %s", path, fmt.name, target)
            return target
        if not why.startswith("damaged"):
            log.warning("%s: %s; converting in memory (that file is left alone)", target, why)
            return None
        log.warning("%s: %s; converting again", target, why)
    L, E = moe.dims["n_layers"], moe.dims["n_experts"]
    need = sum(t.n_bytes for t in header.tensors if not _is_expert(t.name)) + L * E * sum(parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as e:
        log.warning("%s: cannot use the conversion cache %s (%s); converting in memory", path,
                    folder, e.strerror or e)
        return None
    if free < need + SPARE_BYTES:
        log.warning("%s: the conversion to %s needs %.1f GiB in %s, which has %.1f GiB free; "
                    "converting in memory (set %s to a folder with room)", path, fmt.name,
                    need / 2**30, folder, free / 2**30, CACHE_SWITCH)
        return None
    tmp = folder / f".{target.name}.{os.getpid()}.partial"
    try:
        _write(header, moe, fmt, parts, tmp, {MARK + "key": key, MARK + "format": fmt.name,
                                              MARK + "source": str(path)})
        os.replace(tmp, target)
    except OSError as e:
        log.warning("%s: cannot write the conversion cache %s (%s); converting in memory",
                    path, target, e.strerror or e)
        return None
    finally:
        if tmp.exists():
            tmp.unlink()
    log.warning("%s: experts converted to %s once, into %s; later opens read that file "
                "(%s names the folder)", path, fmt.name, target, CACHE_SWITCH)
    return target


def _not_ours(target: Path, key: str) -> str | None:
    """None when `target` is our conversion of this key; else why not ('damaged ...' for
    one of ours that cannot be read)."""
    try:
        header = open_reader(target)
    except GGUFError as e:
        marked = False
        try:
            with open(target, "rb") as f:
                marked = (MARK + "key").encode() in f.read(1 << 20)
        except OSError:
            pass
        return f"damaged ({e})" if marked else "a file that is not a conversion of strata_rt"
    got = header.value(MARK + "key")
    if got is None:
        return "a file that is not a conversion of strata_rt"
    return None if got == key else "damaged (a conversion of another source)"


def _is_expert(name: str) -> bool:
    return name.startswith("blk.") and name.endswith("_exps.weight")


def _write(header: Header, moe: Any, fmt: Any, parts: tuple[int, int, int], out: Path,
           marks: dict[str, str]) -> None:
    """The converted model into `out`: the source's keys and `marks`, the dense tensors as
    stored, then each layer's expert tensors in fmt's GGUF type, converted a chunk of layers
    at a time (about CHUNK_BYTES held)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from ..report.eta import Eta
    from .convert import GGUFExperts

    experts = GGUFExperts.open(moe, fmt)
    experts.check_all()  # a NaN anywhere is refused before anything is written
    arch = header.value("general.architecture")
    w = GGUFWriter(str(out), arch)
    kept = typed_keys(header, skip=_NOT_COPIED)
    add_keys(w, {k: v for k, v in kept.items() if not k.startswith(MARK)})
    add_keys(w, marks)
    dense = [t for t in header.tensors if not _is_expert(t.name)]
    for t in dense:
        a = t.data
        w.add_tensor_info(t.name, a.shape, a.dtype, a.nbytes,
                          GGMLQuantizationType(int(t.tensor_type)) if a.dtype == np.uint8
                          else None)
    qt = GGMLQuantizationType(fmt.ggml_type)
    L, E, H, F = (moe.dims[k] for k in ("n_layers", "n_experts", "hidden", "ffn"))
    rows = {"gate": F, "up": F, "down": H}
    for layer in range(L):
        for part, n in zip(EXPERT_PARTS, parts):
            w.add_tensor_info(tensor_names(layer)[part], (E, rows[part], n // rows[part]),
                              np.dtype(np.uint8), E * n, qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in dense:
        w.write_tensor_data(np.ascontiguousarray(t.data))
    blob = sum(parts)
    step = max(1, CHUNK_BYTES // max(1, E * blob))
    eta = Eta(f"{header.path.name}: converting experts to {fmt.name} (once, for the "
              "conversion cache)", L * E, "experts")
    try:
        for lo in range(0, L, step):
            hi = min(L, lo + step)
            grid = np.empty((hi - lo, E, blob), np.uint8)
            experts.write_jobs([(layer, grid[layer - lo]) for layer in range(lo, hi)], eta)
            for g in grid:
                g_end, u_end = parts[0], parts[0] + parts[1]
                for lo_b, hi_b in ((0, g_end), (g_end, u_end), (u_end, blob)):
                    w.write_tensor_data(np.ascontiguousarray(g[:, lo_b:hi_b]))
    finally:
        eta.close()
        w.close()
