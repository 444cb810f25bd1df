"""The runtime layer: the only code in strata_rt that touches CUDA (through pycuda, imported
lazily when a Runtime opens). Compilation (`compile`) needs only nvcc."""

from __future__ import annotations

from .compile import KernelCheck, check_kernels, compile_cubin, nvcc_available
from .device import Runtime, cuda_available
from .graph import Graph
from .memory import DeviceArena, DeviceBuffer, PinnedArena, plan_regions
from .module import Kernel, Module
from .streams import Event, Stream

__all__ = [
    "DeviceArena", "DeviceBuffer", "Event", "Graph", "Kernel", "KernelCheck", "Module",
    "PinnedArena", "Runtime", "Stream", "check_kernels", "compile_cubin", "cuda_available",
    "nvcc_available", "plan_regions",
]
