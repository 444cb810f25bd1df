"""Where strata_rt's own data lives: the CUDA sources and the built-in plugin list.

Both travel inside the package (a wheel carries them as package data; a source checkout links
`strata_rt/kernels`, `strata_rt/quants` and `strata_rt/plugins.yaml` to the top-level folders),
so they are found through importlib.resources wherever strata_rt is installed or run from.
This module imports nothing of strata_rt's: every layer, the runtime included, may use it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _package_path(*parts: str) -> Path:
    return Path(str(resources.files("strata_rt").joinpath(*parts)))


#: the kernels folder: kernels/common (shared) and kernels/<format> (one per built-in format)
KERNELS_ROOT = _package_path("kernels")
#: plugins.yaml of the built-in formats (STRATA_PLUGINS or `strata --plugins` replace it)
BUILTIN_PLUGINS_YAML = _package_path("plugins.yaml")


def common_include_dir() -> Path:
    """The folder of strata_rt's shared CUDA headers (mma.cuh, q8_1.cuh, tile64.cuh, ...).

    A third-party plugin's kernels `#include` them by name; strata_rt's compiler adds this
    folder to nvcc's include path for every module, so a plugin needs it only for its own
    tools (an IDE, a standalone nvcc check)."""
    return KERNELS_ROOT / "common"


def kernel_lines(source: Path, macro: str) -> list[tuple[str, ...]]:
    """The arguments of every line of `source` that starts with `macro(` (a kernel
    instantiation), as strings: a launcher reads its tile table from these lines, so the CUDA
    source is the table's one copy."""
    import re

    found = re.findall(rf"^{re.escape(macro)}\(([^)]*)\)", source.read_text(), flags=re.M)
    return [tuple(a.strip() for a in args.split(",")) for args in found]


def kernel_constant(source: Path, name: str) -> int:
    """The integer a CUDA source defines as `name` (`#define NAME 4` or `constexpr int NAME =
    4;`): a launcher that must agree with a kernel on a block size or a buffer bound reads it
    here, so the source is the constant's one copy."""
    import re

    text = source.read_text()
    found = (re.search(rf"^#define {re.escape(name)} (\d+)\b", text, flags=re.M)
             or re.search(rf"constexpr int {re.escape(name)} = (\d+);", text))
    if found is None:
        raise ValueError(f"{source.name} defines no integer {name}")
    return int(found.group(1))

