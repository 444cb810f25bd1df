"""Whether a chunk's products read resident experts in place (plan.Products.slots).

Why a rule: a format's gather writes each expert's images into the group buffers before the
products read them. For a format that dequantizes there (IQ3_XXS f16_gemm writes 1.2 GB of fp16
images per layer on the Qwen3-30B shape), that traffic is most of a short prompt's layer, while
a GEMM decoding the blocks in its main loop reads 0.23 GB. At long chunks the fp16 GEMM's speed
pays for its gather, so the format names the rows per expert up to which reading in place wins
(QuantFormat.in_place_max_rows) and the chunk's walk rows hint picks. Both paths give the same
bytes, so the choice never changes a result.

Pure Python: the executors, the planners' callers and the benchmarks read the same rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ...errors import ConfigError
from .lanes import walk_rows_hint

if TYPE_CHECKING:
    from ...formats.contract import ExpertLayout, QuantFormat
    from ...weights.model import MoESpec

InPlaceSetting = Literal["auto", "on", "off"]
IN_PLACE_SETTINGS: tuple[str, ...] = ("auto", "on", "off")


def parse_in_place(value: object, where: str = "in_place") -> InPlaceSetting:
    """A setting from a config value or an environment string (None: auto; YAML's booleans
    read as on and off)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value).strip().lower()
    if text not in IN_PLACE_SETTINGS:
        raise ConfigError(f"{where}: got {value!r}; expected one of "
                          f"{', '.join(IN_PLACE_SETTINGS)} (auto: short chunks read resident "
                          "experts in place where the format can)")
    return text  # type: ignore[return-value]


def check_in_place(setting: InPlaceSetting | None, fmt: QuantFormat) -> InPlaceSetting:
    """The setting an executor runs with (None: auto); refuses `on` for a format whose kernels
    cannot read experts in place (nothing falls back silently)."""
    setting = setting or "auto"
    if setting == "on" and fmt.in_place_max_rows <= 0:
        raise ConfigError(f"in_place: on, but format {fmt.name} ({type(fmt).__name__}) cannot "
                          "read experts in place; use auto or off")
    return setting


def chunk_in_place(setting: InPlaceSetting, fmt: QuantFormat, tokens: int,
                   spec: MoESpec) -> bool:
    """Whether a chunk of `tokens` reads its resident groups in place: never when off or when
    the format cannot; always when on; under auto while the walk rows hint stays within the
    format's in_place_max_rows."""
    if setting == "off" or fmt.in_place_max_rows <= 0:
        return False
    return setting == "on" or walk_rows_hint(tokens, spec) <= fmt.in_place_max_rows


def resident_parts(resident_base: int, slots: tuple[int, ...], layout: ExpertLayout,
                   slot_bytes: int | None = None) -> tuple[list[int], list[int]]:
    """Device addresses of the gate/up and down parts of the blobs in resident `slots` (the
    region of resident slots starting at resident_base): what mmq_in_place reads. `layout` is
    the blobs' layer's; slot_bytes (default: that layout's) the model's slot size, which a
    mixed model sets by its largest layer."""
    step = layout.slot_bytes if slot_bytes is None else slot_bytes
    base = [resident_base + s * step for s in slots]
    return ([b + layout.gate_up_offset for b in base], [b + layout.down_offset for b in base])
