"""Each layer's expert format: a model file may store its layers' experts in different types.

Why a table and not one format per model: the files people download are mixes (llama.cpp's
Q4_K_M keeps some layers' down projections in Q6_K, and community mixes override types per
tensor), so the bytes of one layer's expert blob are not another's. What stays the same across
layers is everything after the gather: the group-buffer images, the activation encoding and the
products. So a model holds one format object per layer, all of them agreeing on that common
part (`LayerFormats.of` refuses a table where they do not), and:
- the store, the VRAM slots and the ring slots are sized for the largest layer's blob
  (`slot_bytes`), each layer's blob at the start of its slot;
- a copy moves that layer's own blob bytes (`layout(layer).blob_bytes`), never the padding;
- the gathers and in-place products run the kernels of the layer's own format.
A model of one type is the table of one format repeated, and behaves as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FormatError
from ..formats.contract import ExpertLayout, QuantFormat

if TYPE_CHECKING:
    from ..formats.contract import FormatKernels
    from ..runtime import Runtime


@dataclass(frozen=True)
class LayerFormats:
    """The expert format and blob layout of every layer of one model."""

    formats: tuple[QuantFormat, ...]
    layouts: tuple[ExpertLayout, ...]

    @classmethod
    def of(cls, formats: Sequence[QuantFormat], hidden: int, ffn: int) -> LayerFormats:
        """The table for these per-layer formats; FormatError when two layers disagree on what
        every layer must share (activation encoding, image sizes)."""
        if not formats:
            raise FormatError("a model needs at least one layer of experts")
        fmts = tuple(formats)
        layouts = tuple(f.layout(hidden, ffn) for f in fmts)
        first, lay0 = fmts[0], layouts[0]
        for layer, (f, lay) in enumerate(zip(fmts, layouts)):
            why = _disagreement(first, lay0, f, lay)
            if why is not None:
                raise FormatError(f"layer {layer}'s experts ({f.name}) cannot run beside layer "
                                  f"0's ({first.name}): {why}")
        return cls(fmts, layouts)

    @classmethod
    def uniform(cls, fmt: QuantFormat, n_layers: int, hidden: int, ffn: int) -> LayerFormats:
        lay = fmt.layout(hidden, ffn)
        return cls((fmt,) * n_layers, (lay,) * n_layers)

    def __len__(self) -> int:
        return len(self.formats)

    def format(self, layer: int) -> QuantFormat:
        return self.formats[layer]

    def layout(self, layer: int) -> ExpertLayout:
        return self.layouts[layer]

    @property
    def mixed(self) -> bool:
        """True when some layer's blob differs from another's (type or bytes)."""
        return len({id(f) for f in self.formats}) > 1 or len(set(self.layouts)) > 1

    @property
    def slot_layout(self) -> ExpertLayout:
        """The layout of the layer with the largest blob: what sizes the store's, the VRAM
        cache's and the rings' slots (the image sizes are every layer's)."""
        return max(self.layouts, key=lambda lay: lay.blob_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.slot_layout.slot_bytes

    @property
    def native(self) -> bool:
        """Whether every layer's blobs are plain byte ranges (batched gathers allowed)."""
        return all(f.native for f in self.formats)

    def offers_mmq_table(self, layer: int) -> bool:
        """Whether the layer's format runs a whole resident layer's products over a table of
        slot addresses (QuantFormat.offers_mmq_table;
        strata_rt.schedule.planners.layer_products)."""
        return self.formats[layer].offers_mmq_table()

    @property
    def in_place_format(self) -> QuantFormat:
        """The layer format that reads experts in place for the fewest rows: what decides for
        the whole model whether a chunk's products read resident experts in place."""
        return min(self.formats, key=lambda f: f.in_place_max_rows)

    def distinct(self) -> Iterator[tuple[QuantFormat, list[int]]]:
        """Each distinct format object with the layers that use it, in layer order."""
        seen: dict[int, tuple[QuantFormat, list[int]]] = {}
        for layer, f in enumerate(self.formats):
            seen.setdefault(id(f), (f, []))[1].append(layer)
        yield from seen.values()

    def kernels(self, runtime: Runtime) -> list[FormatKernels]:
        """Each layer's format kernels on `runtime`, loaded once per distinct format object."""
        loaded = {id(f): f.kernels(runtime, self.layout(layers[0]))
                  for f, layers in self.distinct()}
        return [loaded[id(f)] for f in self.formats]

    def sliced(self, lo: int, hi: int) -> LayerFormats:
        return LayerFormats(self.formats[lo:hi], self.layouts[lo:hi])

    def describe(self) -> list[str]:
        """One line per run of consecutive layers of one format: 'layers 0-3: q4_k (…)'."""
        lines: list[str] = []
        start = 0
        for layer in range(1, len(self) + 1):
            if layer == len(self) or self.formats[layer] is not self.formats[start]:
                span = f"layer {start}" if layer - 1 == start else f"layers {start}-{layer - 1}"
                lines.append(f"{span}: {self.formats[start].name}, "
                             f"{self.layouts[start].blob_bytes:,} bytes per expert")
                start = layer
        return lines


def _disagreement(a: QuantFormat, la: ExpertLayout, b: QuantFormat,
                  lb: ExpertLayout) -> str | None:
    """Why two layers' formats cannot share group buffers, activations and products."""
    if a.activation is not b.activation:
        return f"activations {a.activation.name} and {b.activation.name} differ"
    if (la.gate_up_image_bytes, la.down_image_bytes) != (lb.gate_up_image_bytes,
                                                         lb.down_image_bytes):
        return (f"group-buffer images of ({la.gate_up_image_bytes}, {la.down_image_bytes}) and "
                f"({lb.gate_up_image_bytes}, {lb.down_image_bytes}) bytes differ")
    return None
