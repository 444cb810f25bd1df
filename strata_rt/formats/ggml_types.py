"""The GGML tensor types strata_rt decodes, in one table: name, GGUF type id and block geometry.

Why one table: the device decoders (kernels/ggml/), their generated traits header, the
dequantizing gather's launcher and the tests must agree on every type's id and geometry. The
names are listed here once; the ids and the geometry are read from the `gguf` package (the same
package whose `gguf.quants.dequantize` is the float32 reference the decoders reproduce bit for
bit), so nothing is typed twice. kernels/ggml/make_tables.py renders this table into
kernels/ggml/traits.cuh; a CPU test fails when the committed header no longer matches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import FormatError

#: the decoded types, in the order the traits header lists them: plain floats, the legacy
#: 32-value quants, the K-quants, the i-quants, then MXFP4
NAMES: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M",
    "MXFP4",
)

#: GGML type id -> byte offsets, within one block, of its fp16 scale fields. Every other field
#: of these blocks is an integer code, and every code is valid, so random bytes with finite fp16
#: scales are valid blocks (strata_rt.formats.ggml_blocks) and a NaN/Inf check of a tensor reads
#: only these fields (strata_rt.weights.gguf_file.gguf_checks). IQ1_M spreads its fp16 scale over the top
#: nibbles of four u16 words at 48..55 and MXFP4 scales by a power-of-two exponent byte: neither
#: has an entry. Keyed by id, not name: the checks also read types no decoder handles (Q8_1, TQ*).
F16_SCALES: dict[int, tuple[int, ...]] = {
    2: (0,),        # Q4_0:   d, 16 bytes of nibbles
    3: (0, 2),      # Q4_1:   d, m
    6: (0,),        # Q5_0:   d, qh, qs
    7: (0, 2),      # Q5_1:   d, m, qh, qs
    8: (0,),        # Q8_0:   d, 32 int8
    9: (0, 2),      # Q8_1:   d, s
    10: (80, 82),   # Q2_K:   scales[16], qs[64], d, dmin
    11: (108,),     # Q3_K:   hmask[32], qs[64], scales[12], d
    12: (0, 2),     # Q4_K:   d, dmin, scales[12], qs
    13: (0, 2),     # Q5_K:   d, dmin, scales[12], qh, qs
    14: (208,),     # Q6_K:   ql[128], qh[64], scales[16], d
    16: (0,),       # IQ2_XXS
    17: (0,),       # IQ2_XS
    18: (0,),       # IQ3_XXS: d, grid indices[64], sign/scale words[32]
    19: (0,),       # IQ1_S
    20: (0,),       # IQ4_NL
    21: (0,),       # IQ3_S
    22: (0,),       # IQ2_S
    23: (0,),       # IQ4_XS
    34: (52,),      # TQ1_0:  qs[48], qh[4], d
    35: (64,),      # TQ2_0:  qs[64], d
}

#: values one decoder call yields (values i and i+1 of a block, i even)
PAIR = 2


@dataclass(frozen=True)
class GgmlType:
    """One GGML type: its GGUF name and id, and a block's values and bytes.

    A tensor row of `cols` values is cols / block_values blocks of block_bytes, stored one
    after the other; rows follow each other, so value v of a [rows, cols] matrix lives in
    block v // block_values at in-block index v % block_values (for 1-value types the pair
    v, v+1 spans two consecutive blocks)."""

    name: str
    type_id: int
    block_values: int
    block_bytes: int

    @classmethod
    def from_gguf(cls, name: str) -> GgmlType:
        """The type `name` with its id and geometry as the `gguf` package states them."""
        qtype = GGMLQuantizationType[name]
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        return cls(name=name, type_id=int(qtype.value), block_values=int(values),
                   block_bytes=int(nbytes))

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.type_id)

    @property
    def kernel_name(self) -> str:
        """The dequantizing gather instantiated for this type (kernels/ggml/gather.cu)."""
        return f"ggml_gather_{self.name}"

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` values; FormatError unless cols is a whole number of
        blocks."""
        if cols <= 0 or cols % self.block_values:
            raise FormatError(f"{self.name}: a row of {cols} values is not a whole number of "
                              f"{self.block_values}-value blocks")
        return cols // self.block_values * self.block_bytes

    def dequantize(self, raw: np.ndarray, cols: int) -> np.ndarray:
        """The float32 reference: `gguf.quants.dequantize` of raw rows of `cols` values,
        returned as float32 [rows, cols]."""
        flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        row = self.row_bytes(cols)
        if flat.size % row:
            raise FormatError(f"{self.name}: {flat.size} bytes are not whole rows of {row}")
        out = gguf.quants.dequantize(flat.reshape(-1, row), self.qtype)
        return np.asarray(out, dtype=np.float32).reshape(-1, cols)

    def __str__(self) -> str:
        return self.name


#: every decoded type, in NAMES order
TYPES: tuple[GgmlType, ...] = tuple(GgmlType.from_gguf(n) for n in NAMES)
BY_NAME: dict[str, GgmlType] = {t.name: t for t in TYPES}
BY_ID: dict[int, GgmlType] = {t.type_id: t for t in TYPES}


def ggml_type(key: str | int | GGMLQuantizationType | GgmlType) -> GgmlType:
    """The table's entry for a name, a GGUF type id, a gguf enum member or an entry."""
    if isinstance(key, GgmlType):
        return key
    if isinstance(key, GGMLQuantizationType):
        key = int(key.value)
    found = BY_NAME.get(key) if isinstance(key, str) else BY_ID.get(int(key))
    if found is None:
        raise FormatError(f"GGML type {key!r} has no decoder; decoded: {', '.join(NAMES)}")
    return found
