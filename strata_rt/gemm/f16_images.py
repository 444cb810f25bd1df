"""What a format's fp16-image variant changes, once for every format that has one (IQ3_XXS and
Q2 blob `f16_gemm`): mixed in before the format class, it keeps the blob and its quantizer and
changes the rest the engine reads from the format object.

- activations: fp16 (not q8_1), so the variant is not `exact`;
- images: the dequantizing gather writes fp16 weights, 2 bytes each (`layout` keeps the blob's
  ranges and sets the image sizes; `image_matrix` reads one back);
- the reference: float64 products of those fp16 images and the fp16 activations
  (strata_rt.gemm.grouped_gemm.gemm_reference), which the grouped fp16 GEMM meets within the
  conformance suite's tolerance.
The subclass supplies `images` (its gather's numpy twin), its kernels and its description.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..errors import FormatError
from ..formats.activations import F16, Activation
from ..formats.contract import ExpertLayout
from .grouped_gemm import fp16_image_layout, gemm_reference


class F16ImagesVariant:
    """Mixin for a format variant whose group buffers hold fp16 images (see the module doc)."""

    activation: ClassVar[Activation] = F16
    exact: ClassVar[bool] = False
    #: the element type the group-buffer images hold: the exact weights rounded to it (the
    #: conformance suite's image check reads this)
    image_dtype = np.float16
    name: str
    variant: str

    def layout(self, hidden: int, ffn: int) -> ExpertLayout:
        """The format's blob (same ranges and bytes) with fp16 images: 2 * rows * cols bytes."""
        return fp16_image_layout(super().layout(hidden, ffn))  # type: ignore[misc]

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        raw = np.ascontiguousarray(image, dtype=np.uint8).reshape(-1)
        if raw.size != 2 * rows * cols:
            raise FormatError(f"{self.name} ({self.variant}): an fp16 image of {rows} x {cols} "
                              f"takes {2 * rows * cols} bytes, got {raw.size}")
        return raw.view(np.float16).reshape(rows, cols).astype(np.float32)

    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """float64 products of the fp16 images and the fp16 activations (from
        prepare_activations), rounded to float32; rows outside the group are zero."""
        return gemm_reference(image, expert_ids, acts, bounds, m, k)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.variant})>"
