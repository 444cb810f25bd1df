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
