"""The MMQ variant a run asks for (EngineConfig.mmq_kernel, STRATA_MMQ_KERNEL): refused where
the model's format does not offer it, and the model viewed through it. Its own module because
the engine applies both at open, before either backend exists."""

from __future__ import annotations

import copy

from ..errors import ConfigError
from ..formats.contract import QuantFormat
from .layer_formats import LayerFormats
from .model import Model


def check_mmq_kernel(fmt: QuantFormat, kernel: str | None,
                     where: str = "STRATA_MMQ_KERNEL") -> None:
    """Refuses an MMQ variant (EngineConfig.mmq_kernel, STRATA_MMQ_KERNEL: `where` says which
    gave it) the format does not offer. Only the CUDA kernels of a format with variants run it,
    so without this check a typo would be ignored silently on the reference backend and for
    every other format."""
    variants = fmt.mmq_variants()
    if kernel is not None and kernel not in variants:
        raise ConfigError(f"{where}={kernel!r}: format {fmt.name} offers {', '.join(variants)}",
                          source="environment" if where.isupper() else "engine config")


def with_variant(model: Model, name: str | None) -> Model:
    """The model as the engine runs it: each layer's format replaced by the object of MMQ
    variant `name` (None: the format's default). A variant may change the group-buffer images,
    the activation encoding and the numpy reference, never the blob bytes, so the view shares
    the model's weights and expert source and both backends read everything from its formats."""
    chosen: dict[int, QuantFormat] = {}
    for fmt, _ in model.formats.distinct():
        chosen[id(fmt)] = fmt.for_variant(name)
    if all(chosen[id(f)] is f for f, _ in model.formats.distinct()):
        return model
    spec = model.spec
    formats = LayerFormats.of([chosen[id(f)] for f in model.formats.formats], spec.hidden,
                              spec.ffn)
    for layer, (old, new) in enumerate(zip(model.formats.layouts, formats.layouts)):
        if (old.blob_bytes, old.slot_bytes) != (new.blob_bytes, new.slot_bytes):
            raise ConfigError(f"format {formats.format(layer).name}: variant {name!r} changes "
                              "the blob layout; a variant may change images and kernels only",
                              source="plugin")
    view = copy.copy(model)
    view.fmt, view.formats, view.layout = formats.format(0), formats, formats.slot_layout
    return view
