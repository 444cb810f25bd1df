"""Every error strata_rt raises on purpose derives from StrataError.

The CLI turns these into a one-paragraph message and an exit code, never a traceback, so each
message must name the thing the user gave (YAML key, GGUF tensor, plugin module) and say what
would have been valid.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of the errors a user can act on."""

    exit_code = 1


class ConfigError(StrataError):
    """A run configuration is invalid; carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, problems: list[str] | str, source: str = "config"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


class PluginError(StrataError):
    """A quant plugin could not be loaded or breaks the format contract."""


class FormatError(StrataError):
    """Bytes or weights handed to a format do not fit it (bad shape, NaN, wrong GGUF type)."""


class GGUFError(StrataError):
    """A GGUF file is missing a tensor or key, or holds one of the wrong shape or type."""


class GGUFChangedError(GGUFError):
    """A GGUF file changed (cut short, grown or rewritten) after it was opened: the bytes a
    run would read are no longer those checked at open."""


class BudgetError(StrataError):
    """A memory budget cannot hold what the run needs."""

    exit_code = 2


class HostMemoryError(StrataError):
    """The host cannot hold what a run would allocate (checked before allocating)."""

    exit_code = 2


class KernelBuildError(StrataError):
    """nvcc rejected a kernel source; the message carries the compiler's output."""


class CudaUnavailableError(StrataError):
    """No CUDA driver, device or pycuda: the cuda backend cannot run here."""

    def __init__(self, why: str):
        super().__init__(
            f"CUDA is not available: {why}. The `reference` backend runs everything on the CPU "
            "with numpy (`--backend reference`, or `backend: reference` in the config)."
        )


class PlanHazardError(StrataError):
    """The hazard checker found a plan that could race, read stale bytes or deadlock."""
