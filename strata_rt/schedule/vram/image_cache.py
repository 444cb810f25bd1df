"""The image cache: group-buffer images of resident experts, kept on the device across chunks.

Why: a format whose gather dequantizes (IQ3_XXS and Q2 blob through fp16 images) rewrites
every resident expert's images on every chunk: ~1.2 GB of fp16 per layer of the Qwen3-30B
shape, whatever the prompt length. A program with VRAM to spare can keep those images instead
and let the streamed walk multiply them in place, with no gathering pass at all. A PyTorch
user who keeps dequantized bf16 experts in VRAM pays the same memory.

Unit: a block is one group of the walk, layer `layer`, experts [16 * group, 16 * group + 16)
(MMQ_GROUP), laid out as the group buffers are (position p holds expert 16 * group + p), so
the format's own matmul reads a block exactly as it reads the group buffers. Only groups whose
every expert is resident are cached: their images never change after the engine opens.

Exactness: a block is filled at open by the format's own gather from the resident slot, the
same launch the walk would make per chunk, so a cached product reads the bytes a gathered
one would and the outputs are byte-identical with and without the cache (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...config.settings import env
from ...errors import ConfigError
from ...formats.contract import MMQ_GROUP, ExpertLayout

if TYPE_CHECKING:
    from ...weights.model import MoESpec
    from .residency import Residency

log = logging.getLogger(__name__)

#: the setting that asks for room for every group of every layer
ALL = "all"
#: what an image-cache setting may be: MiB of device memory, or ALL
ImageCacheSetting = float | int | str | None


def block_bytes(layout: ExpertLayout) -> tuple[int, int]:
    """Device bytes of one block's gate/up images and down images (16 positions each)."""
    return MMQ_GROUP * layout.gate_up_image_bytes, MMQ_GROUP * layout.down_image_bytes


def groups_per_layer(spec: MoESpec) -> int:
    return -(-spec.n_experts // MMQ_GROUP)


#: more device memory than any machine has (1 PiB in MiB): larger sizes overflowed
MAX_MIB = 1 << 30


def check_setting(value: object) -> str | None:
    """None when `value` is a valid setting (None, a number of MiB >= 0, or "all"), else
    what is allowed, in words."""
    if value is None or value == ALL:
        return None
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value <= MAX_MIB):
        return (f"allowed: a number of MiB >= 0 (at most {MAX_MIB:,}: 1 PiB), or `{ALL}` (room "
                "for the images of every group of every layer)")
    return None


def parse_setting(text: str | None) -> ImageCacheSetting:
    """The environment's form of a setting (STRATA_IMAGE_CACHE_MIB), checked by env's rule
    for the switch: "all" or a number of MiB."""
    if text is None or text.strip() == "":
        return None
    t = text.strip()
    why = env.problem("STRATA_IMAGE_CACHE_MIB", t)
    if why is not None:
        raise ConfigError(f"STRATA_IMAGE_CACHE_MIB={text!r}: {why}", source="environment")
    return ALL if t == ALL else float(t)


def capacity_blocks(setting: ImageCacheSetting, spec: MoESpec, layout: ExpertLayout) -> int:
    """Blocks a setting reserves room for: every group of every layer for ALL, else as many
    whole blocks as the MiB hold (at most every group)."""
    if setting is None:
        return 0
    every = spec.n_layers * groups_per_layer(spec)
    if setting == ALL:
        return every
    why = check_setting(setting)
    if why is not None:
        raise ConfigError(f"image_cache_mib: got {setting!r}; {why}", source="engine config")
    gu, dn = block_bytes(layout)
    return min(every, int(float(setting) * (1 << 20)) // (gu + dn))


@dataclass(frozen=True)
class ImageCache:
    """Which (layer, group) each block holds, in block order; `capacity` blocks have room."""

    blocks: tuple[tuple[int, int], ...] = ()
    capacity: int = 0
    _index: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.blocks) > self.capacity:
            raise ValueError(f"{len(self.blocks)} image blocks in room for {self.capacity}")
        if len(set(self.blocks)) != len(self.blocks):
            raise ValueError("an image block is listed twice")
        object.__setattr__(self, "_index", {b: i for i, b in enumerate(self.blocks)})

    def index(self, layer: int, group: int) -> int | None:
        """The block holding that group's images, or None."""
        return self._index.get((layer, group))

    def experts(self, block: int, spec: MoESpec) -> tuple[int, ...]:
        """The experts of a block, by position."""
        _, group = self.blocks[block]
        return tuple(range(group * MMQ_GROUP, min(spec.n_experts, (group + 1) * MMQ_GROUP)))

    def fills(self, spec: MoESpec, residency: Residency) -> Iterator[tuple[int, int, int]]:
        """(block, position, resident slot) of every image a backend writes at open."""
        for b, (layer, _) in enumerate(self.blocks):
            for pos, e in enumerate(self.experts(b, spec)):
                slot = residency.slot(layer, e)
                if slot is None:
                    raise AssertionError(f"image block {b}: layer {layer} expert {e} is not "
                                         "resident (choose caches resident groups only)")
                yield b, pos, slot

    @classmethod
    def choose(cls, spec: MoESpec, residency: Residency, capacity: int) -> ImageCache:
        """Up to `capacity` groups whose every expert is resident, layer by layer."""
        blocks: list[tuple[int, int]] = []
        for layer in range(spec.n_layers):
            for group in range(groups_per_layer(spec)):
                if len(blocks) == capacity:
                    return cls(tuple(blocks), capacity)
                first = group * MMQ_GROUP
                members = range(first, min(spec.n_experts, first + MMQ_GROUP))
                if all(residency.slot(layer, e) is not None for e in members):
                    blocks.append((layer, group))
        return cls(tuple(blocks), capacity)

    def report(self, spec: MoESpec, layout: ExpertLayout) -> None:
        """Logs what the cache holds and what its room costs: a warning when room stays
        unused (only groups whose experts are all resident are cached) or holds no block."""
        gu, dn = block_bytes(layout)
        every = spec.n_layers * groups_per_layer(spec)
        line = (f"image cache: {len(self.blocks)} of {every} groups cached, room for "
                f"{self.capacity} ({self.capacity * (gu + dn) / (1 << 20):.0f} MiB, "
                f"{(gu + dn) / (1 << 20):.1f} MiB a group)")
        if len(self.blocks) == self.capacity and self.capacity:
            log.info("%s", line)
        elif not self.capacity:
            log.warning("%s: image_cache_mib is smaller than one group", line)
        else:
            log.warning("%s; the rest stays unused: a group is cached only when its %d "
                        "experts are all resident (lower image_cache_mib, or make more "
                        "experts resident)", line, MMQ_GROUP)
