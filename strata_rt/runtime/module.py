"""Compiled modules and prepared kernel launches.

A prepared launch packs arguments with a fixed format string instead of inspecting every
argument's type, which is most of pycuda's per-launch host cost. A kernel asked for with
`overlap=True` launches overlapped (runtime/overlap.py) where the runtime allows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StrataError
from .overlap import OverlapFunction, OverlapModule

if TYPE_CHECKING:
    from .context import DriverContext
    from .streams import Stream

#: Dynamic shared memory a kernel may use without opting in.
DEFAULT_SHARED_LIMIT = 48 * 1024
#: Argument codes of `Module.kernel` (struct codes pycuda's prepare understands).
ARG_CODES = {"P": "pointer", "i": "int32", "I": "uint32", "f": "float32", "d": "float64",
             "q": "int64"}


class Kernel:
    """One kernel function with a fixed argument signature."""

    def __init__(self, runtime: DriverContext, func, name: str, arg_types: str,
                 overlapped: OverlapFunction | None = None):
        bad = sorted(set(arg_types) - set(ARG_CODES))
        if bad:
            allowed = ", ".join(f"{k} ({v})" for k, v in ARG_CODES.items())
            raise StrataError(f"kernel {name}: argument codes {bad} in {arg_types!r}; "
                              f"allowed: {allowed}")
        self.runtime = runtime
        self.name = name
        self.arg_types = arg_types
        self.func = func.prepare(arg_types)
        #: the driver-API handle of an overlapped launch, or None for an ordinary one
        self.overlapped = overlapped
        # the limits cover static and dynamic shared memory together
        self._static_shared = int(func.get_attribute(
            runtime.drv.function_attribute.SHARED_SIZE_BYTES))
        self._shared_opted = max(0, DEFAULT_SHARED_LIMIT - self._static_shared)

    def _opt_in_shared(self, shared: int) -> None:
        limit = self.runtime.max_shared_optin - self._static_shared
        if shared > limit:
            raise StrataError(f"kernel {self.name}: {shared} bytes of dynamic shared memory "
                              f"asked beside {self._static_shared} static, the device allows "
                              f"at most {limit}")
        drv = self.runtime.drv
        self.func.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
        if self.overlapped is not None:
            self.overlapped.allow_shared(shared)
        self._shared_opted = shared

    def launch(self, grid: Sequence[int], block: Sequence[int], stream: Stream,
               args: Sequence, shared: int = 0) -> None:
        """Enqueues one launch on `stream`; more than 48 KiB of shared memory (static and
        dynamic) is opted into once per kernel (the attribute is sticky)."""
        if shared > self._shared_opted:
            self._opt_in_shared(shared)
        block = tuple(block)
        if len(block) != 3:  # pycuda sets the block shape from exactly three numbers
            block = (*block, 1, 1)[:3]
        if self.overlapped is not None:
            grid = (*tuple(grid), 1, 1)[:3]
            self.overlapped.launch(grid, block, stream.handle, self.arg_types, args, shared)
            return
        self.func.prepared_async_call(tuple(grid), block, stream.raw, *args,
                                      shared_size=shared)

    def __repr__(self) -> str:
        return f"<Kernel {self.name}({self.arg_types})>"


class Module:
    """A cubin loaded into the runtime's context."""

    def __init__(self, runtime: DriverContext, cubin: Path, source: Path):
        self.runtime = runtime
        self.cubin = cubin
        self.source = source
        self.raw = runtime.drv.module_from_buffer(cubin.read_bytes())
        self._kernels: dict[tuple[str, str, bool], Kernel] = {}
        self._overlap: OverlapModule | None = None

    def kernel(self, name: str, arg_types: str, overlap: bool = False) -> Kernel:
        """The kernel `name` (an extern "C" symbol) prepared for `arg_types`. `overlap`: the
        kernel calls wait_prior_grid() (kernels/common/prior_grid.cuh) before it touches
        global memory, so it may launch overlapped with the grid before it; it does where the
        runtime's `overlap_launches` is set (sm_90 and later, unless STRATA_OVERLAP_LAUNCH=0)."""
        overlap = overlap and self.runtime.overlap_launches
        key = (name, arg_types, overlap)
        if key not in self._kernels:
            try:
                func = self.raw.get_function(name)
            except self.runtime.drv.LogicError as e:
                raise StrataError(f"{self.source.name} has no kernel {name!r} ({e}); "
                                  "kernels must be extern \"C\" __global__") from None
            over = None
            if overlap:
                if self._overlap is None:
                    self._overlap = OverlapModule(self.cubin)
                    self.runtime._own(self._overlap)
                over = self._overlap.function(name)
            self._kernels[key] = Kernel(self.runtime, func, name, arg_types, over)
        return self._kernels[key]

    def __repr__(self) -> str:
        return f"<Module {self.source.name} {self.cubin.name}>"
