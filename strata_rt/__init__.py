"""strata_rt: MoE prefill with quantized experts streamed through a VRAM slot cache.

Importing strata_rt never imports pycuda; only strata_rt.runtime touches CUDA, lazily.
"""

from __future__ import annotations

from .errors import StrataError
from .hookspecs import hookimpl
from .registry import QuantRegistry, registry

__version__ = "0.1.0"
__all__ = ["QuantRegistry", "StrataError", "hookimpl", "registry", "__version__"]
