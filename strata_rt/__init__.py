"""strata_rt: MoE prefill with quantized experts streamed through a VRAM slot cache.

Importing strata_rt never imports pycuda; only strata_rt.runtime touches CUDA, lazily. The
plugin registry lives in strata_rt.formats.registry and loads on first use, so importing a lower
layer (strata_rt.runtime, strata_rt.formats.contract) does not load every plugin.
"""

from __future__ import annotations

from .errors import StrataError
from .formats.hookspecs import hookimpl
from .resources import common_include_dir

__version__ = "0.1.0"
__all__ = ["StrataError", "common_include_dir", "hookimpl", "__version__"]
