"""The head layouts the attention kernels take and the scratch the split decode attention
needs, as plain Python: the memory planner sizes a whole model's regions from these without
loading a kernel module (kernels/model/attention.cu, attention_decode.cu)."""

from __future__ import annotations

import math

import numpy as np

from ....errors import ConfigError
from ....formats.contract import first_misaligned

#: head dimensions with a kernel (template instances of attention.cu and attention_decode.cu)
HEAD_DIMS = (64, 128)
#: query heads per KV head at most (a block holds 128 // group positions of the whole group)
MAX_GROUP = 16
#: query heads per KV head with a split decode kernel (decode_split_hd{HD}_g{G})
DECODE_GROUPS = (1, 2, 4, 8, 16)
#: splits of the cache length a decode step launches (blocks: n_kv_heads x splits)
DECODE_SPLITS = 32


def scale_log2(head_dim: int) -> float:
    """hd^-0.5 * log2(e) as float32: the scores' factor before exp2."""
    return float(np.float32(head_dim ** -0.5 * math.log2(math.e)))


def check_attention_shape(n_heads: int, n_kv_heads: int, head_dim: int, tokens: int = 1,
                          start: int = 0, context: int | None = None) -> None:
    """Raises ConfigError naming every head layout or chunk the kernels do not support."""
    problems = []
    if n_kv_heads < 1 or n_heads < 1 or n_heads % n_kv_heads:
        problems.append(f"n_heads={n_heads}, n_kv_heads={n_kv_heads} (both >= 1 and n_heads "
                        f"a multiple of n_kv_heads)")
    elif n_heads // n_kv_heads > MAX_GROUP:
        problems.append(f"group={n_heads // n_kv_heads} query heads per KV head (at most "
                        f"{MAX_GROUP})")
    if head_dim not in HEAD_DIMS:
        problems.append(f"head_dim={head_dim} (the kernels exist for "
                        f"{', '.join(map(str, HEAD_DIMS))})")
    if tokens < 1:
        problems.append(f"tokens={tokens} (at least 1)")
    if start < 0:
        problems.append(f"start={start} (a position, >= 0)")
    if context is not None and start + tokens > context:
        problems.append(f"positions {start}..{start + tokens - 1} (the KV cache holds "
                        f"{context} positions)")
    if problems:
        raise ConfigError(problems, source="GPU attention")


def check_aligned(pointers: dict[str, int], align: int = 16) -> None:
    """Raises ConfigError naming the first device address the attention kernels' vector loads
    cannot take (formats.contract.first_misaligned)."""
    why = first_misaligned(pointers, align)
    if why is not None:
        raise ConfigError(f"device address not aligned: {why}", source="GPU attention")


def decode_part_bytes(n_heads: int, head_dim: int, splits: int = DECODE_SPLITS) -> int:
    """Bytes of the split results (float32 [n_heads, splits, head_dim + 2])."""
    return n_heads * splits * (head_dim + 2) * 4


def check_decode_shape(n_heads: int, n_kv_heads: int, head_dim: int, splits: int) -> None:
    """Raises ConfigError naming every layout the decode kernels do not support."""
    problems = []
    try:
        check_attention_shape(n_heads, n_kv_heads, head_dim)
    except ConfigError as e:
        problems += e.problems
    if n_kv_heads >= 1 and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads not in DECODE_GROUPS:
        problems.append(f"group={n_heads // n_kv_heads} query heads per KV head (the decode "
                        f"kernels exist for {', '.join(map(str, DECODE_GROUPS))})")
    if not 1 <= splits <= 65535:
        problems.append(f"splits={splits} (1 to 65,535)")
    if problems:
        raise ConfigError(problems, source="GPU attention")


def decode_supported(n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether the split kernels exist for this head layout (else one-token chunks run the
    prefill's tiled kernel, which takes every layout the model loader accepts)."""
    try:
        check_decode_shape(n_heads, n_kv_heads, head_dim, DECODE_SPLITS)
    except ConfigError:
        return False
    return True
