"""The one list of environment switches strata_rt reads (the README mirrors it).

Reading switches in one place keeps them discoverable and makes a typo in a value an error
instead of a silent default. `validate_all` (the CLI calls it at startup) parses every switch
that is set, whatever the backend and format, and warns about a `STRATA_*` name that is no
switch at all, naming the closest one.

Where each is read (tests/test_switches.py holds every module to it):

- engine switches, everything that changes what an engine does, are resolved once when an
  engine opens, in config/settings/engine_config.py (EngineConfig.resolve; a field the caller set
  beats its switch), and passed down as plain fields: the driver, the executors, the kernel
  launchers, the GEMMs and the formats never read the environment. They are
  STRATA_PREFILL_GATHER_ONE, STRATA_PREFILL_TIMING, STRATA_PREFILL_DUMP_R,
  STRATA_PREFILL_TRACE, STRATA_WALK_MIN_TOKENS, STRATA_CHECK_PLAN, STRATA_MMQ_KERNEL,
  STRATA_DECODE, STRATA_DECODE_ATTENTION, STRATA_DECODE_DENSE, STRATA_DECODE_ARGMAX,
  STRATA_PREFILL_STREAM, STRATA_PREFILL_ATTENTION,
  STRATA_IMAGE_CACHE_MIB, STRATA_TABLE_PRODUCTS, STRATA_COPY_CHAINS, STRATA_PREFILL_ORDER,
  STRATA_COMPUTE_LANES, STRATA_IN_PLACE, STRATA_CUDA_GRAPH, STRATA_ROUTING, STRATA_DENSE_GEMM,
  STRATA_EMBEDDING, STRATA_F16_GEMM and STRATA_STORE_MEMORY.
  A run config's checks (config/run/schema.py, run/whole.py) size the engine before it exists:
  they take STRATA_MMQ_KERNEL, STRATA_DENSE_GEMM, STRATA_EMBEDDING and STRATA_PREFILL_ORDER
  through engine_config's readers, and
  config/run/schema.py reads STRATA_ROUTING for the router's buffers.
- process switches, which say where the process finds its tools and plugins or which checks
  it runs rather than what an engine computes, stay where they are used: STRATA_KERNEL_CACHE
  and STRATA_NVCC in runtime/compile.py, STRATA_CONVERT_CACHE in weights/convert_cache.py, STRATA_PLUGINS and STRATA_DISABLE_PLUGINS in
  formats/registry.py (the CLI's `--plugins` sets STRATA_PLUGINS in cli/__init__.py),
  STRATA_HOST_MEMORY_CHECK in config/hostmem.py, STRATA_CUTLASS_DIR in gemm/cutlass_gemm.py,
  STRATA_OVERLAP_LAUNCH in runtime/device.py (how kernels launch, not what they compute). Outside
  this list, gemm/cublas.py reads CUDA_HOME and CUDA_PATH to find the CUDA toolkit's libcublas.
"""

from __future__ import annotations

import difflib
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError
from ..files.input_files import InputFileError, user_path
from ..files.numbers import significant_digits, to_int
from ..files.paths import output_dir_problem, output_file_problem

log = logging.getLogger(__name__)

PREFIX = "STRATA_"


@dataclass(frozen=True)
class Switch:
    name: str
    #: "flag" (0/1), "int" (>= 1), "str", "choice:a,b" (one of the names), "path" (read),
    #: "program" (an executable), "outfile" (a file written), "outdir" (a folder written) or
    #: "mib" (a number of MiB >= 0, or `all`)
    kind: str
    help: str


SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch("STRATA_PREFILL_GATHER_ONE", "flag",
               "1: one gather launch per expert instead of one batched launch per group "
               "(native formats only; results are bit-identical)."),
        Switch("STRATA_PREFILL_TIMING", "flag",
               "1: record events at phase boundaries and print a phase table per prompt "
               "(instrumented runs are slower)."),
        Switch("STRATA_PREFILL_DUMP_R", "outfile",
               "path: after each chunk append the final residual of every 64th position "
               "(int64 position + float32 values) so two runs compare with `cmp`."),
        Switch("STRATA_PREFILL_TRACE", "outfile",
               "path.json: write a Chrome/Perfetto trace of the compute and copy streams, one "
               "lane per prompt, rewritten after each prompt (CUDA backend; turns "
               "STRATA_PREFILL_TIMING on)."),
        Switch("STRATA_WALK_MIN_TOKENS", "int",
               "N: chunks of at least N tokens take the streamed walk, smaller ones the "
               "staging ring (default: the walk once half of a layer's experts are expected "
               "to be routed; the original fixed rule was 1024)."),
        Switch("STRATA_CHECK_PLAN", "flag",
               "1: run the hazard checker on every plan before it executes."),
        Switch("STRATA_MMQ_KERNEL", "str",
               "MMQ variant for formats that offer several (see `strata plugins`); "
               "default: the format's fastest measured variant."),
        Switch("STRATA_DECODE", "choice:auto,routed,staging,gemv",
               "a whole model's one-token steps (greedy decoding): auto (the default: gemv "
               "where every layer's format offers its matrix-vector kernels, else routed), "
               "routed (the routed set stays on the device, gathers read routed experts from "
               "their slots or straight from host memory, and the step replays as a CUDA "
               "graph, where the format's kernels offer it), staging (the staging ring: the "
               "routed set comes back to the host every layer and only the routed experts are "
               "copied) or gemv (as routed, but each layer's experts run as two matrix-vector "
               "launches over the routed experts only, read where they lie; not bit-identical "
               "to routed: the sums run in another order; a model with a layer whose format "
               "has no such kernels is refused)."),
        Switch("STRATA_DECODE_ATTENTION", "choice:split,tiled",
               "a whole model's one-token chunks (decode steps) on the CUDA backend: split "
               "(the default: the cache is split over 32 blocks per KV head and the parts "
               "merged, float32 probabilities; within NMSE 1e-4 of tiled, not its bytes) or "
               "tiled (the prefill's attention kernel, one block per KV head: a one-token "
               "chunk's bytes are those of the same row inside a longer chunk)."),
        Switch("STRATA_PREFILL_ATTENTION", "choice:mma,auto,wgmma",
               "a whole model's attention over prompt chunks on the CUDA backend: mma (the "
               "default: the mma.sync kernel, sm_80 on), wgmma (Hopper's warpgroup tensor-core "
               "kernel: sm_90 devices, head dim 128; opt-in until its GPU tests have run) or "
               "auto (wgmma where it runs, else mma). Each gives a query the same bytes "
               "whatever chunk it comes in (`prefill_attention` in Engine.open's settings)."),
        Switch("STRATA_DECODE_DENSE", "choice:gemv,gemm",
               "a whole model's dense projections and output head in one-token chunks (decode "
               "steps) on the CUDA backend: gemv (the default: matrix-vector kernels that read "
               "each weight in its own type, F16 a warp per output row) or gemm (the chunk's "
               "GEMMs, weights not stored as F16 decoded into an fp16 scratch first). gemv is "
               "within NMSE 1e-4 of gemm, not its bytes: the sums run in another order."),
        Switch("STRATA_DECODE_ARGMAX", "choice:device,host",
               "where a greedy decode step on the CUDA backend takes its token: device (the "
               "default: a kernel takes the argmax where the head left the logits, with numpy's "
               "tie rule and NaN/Inf refusal, and 16 bytes come back) or host (the step's "
               "float32 logits come back and numpy takes the argmax: the same ids)."),
        Switch("STRATA_PREFILL_STREAM", "choice:auto,walk,routed,routed_walk",
               "how a prefill chunk streams its non-resident experts: walk (the copy engine "
               "streams every one beside the compute), routed (the gathers read only the "
               "experts the chunk routes, straight from host memory, on the compute lane), "
               "routed_walk (the copy engine copies only the experts each layer routes, "
               "switched on the GPU once the layer's routing is known: CUDA graphs only) or "
               "auto (the default: routed where the routing measured on earlier chunks of that "
               "length makes it cheaper, the walk otherwise)."),
        Switch("STRATA_IMAGE_CACHE_MIB", "mib",
               "MiB (or all): keep the group images of resident experts on the device across "
               "chunks, so the streamed walk multiplies groups whose 16 experts are all "
               "resident without gathering them (for formats that dequantize in the gather, "
               "~1.2 GB of fp16 per layer of the 30B shape; results are bit-identical). The "
               "`image_cache_mib` config key sets it per run; default: none."),
        Switch("STRATA_COMPUTE_LANES", "choice:auto,1,2",
               "compute lanes when the config gives no `compute_lanes`: 2 puts every other "
               "group of 16 experts on a second compute stream with its own group buffers, so "
               "two groups' gathers and GEMMs overlap (chunks up to 512 rows per expert in the "
               "walk's sizing); auto (the default) takes two when every expert is resident, "
               "else one; results are bit-identical."),
        Switch("STRATA_IN_PLACE", "choice:auto,on,off",
               "products of groups whose experts are all resident, when the config gives no "
               "`in_place`: on reads each expert's blocks where they lie (its resident slot) "
               "with a GEMM that decodes them in its main loop, so nothing is gathered; off "
               "always gathers first; auto (the default) reads in place while the chunk's rows "
               "per expert stay within the format's in_place_max_rows (IQ3_XXS f16_gemm: 136, "
               "up to 1,088 tokens on the Qwen3 shapes). Results are bit-identical."),
        Switch("STRATA_TABLE_PRODUCTS", "choice:auto,off",
               "a layer whose every expert is read in place: auto (the default) runs its "
               "products as one launch per product over a table of slot addresses where the "
               "layer's format offers it (FormatKernels.mmq_table), off as one in-place launch "
               "per group of 16 experts. Results are bit-identical."),
        Switch("STRATA_COPY_CHAINS", "choice:1,2,3,4",
               "copy streams a routed walk's switched copies go round-robin over (1, the "
               "default, to 4; `copy_chains` in Engine.open's settings): a copy the routing "
               "switched off then delays its own stream alone, and a group's copies land side "
               "by side. Results are bit-identical."),
        Switch("STRATA_PREFILL_ORDER", "choice:chunks,layers,auto",
               "how a whole model's prompt longer than one chunk runs (`prefill_order` in "
               "Engine.open's settings): chunks (the default) takes each chunk through every "
               "layer in turn, so every chunk streams the non-resident experts again; layers "
               "runs each layer over all the chunks while its streamed experts sit in the "
               "walk's ring (the layer pass: they cross PCIe once per prompt; the ring must "
               "hold one layer's streamed experts and the device the prompt's residual); auto "
               "takes the pass where experts stream and it fits. Logits of every position "
               "(perplexity) keep the chunk order. Results are bit-identical."),
        Switch("STRATA_CUDA_GRAPH", "flag",
               "0: launch the streamed walk kernel by kernel instead of replaying a CUDA graph."),
        Switch("STRATA_KERNEL_CACHE", "outdir",
               "directory of compiled cubins (default: ~/.cache/strata_rt/kernels)."),
        Switch("STRATA_CONVERT_CACHE", "outdir",
               "directory of GGUFs converted to a config's format, written once and reused "
               "(default: ~/.cache/strata_rt/converted)."),
        Switch("STRATA_NVCC", "program", "the nvcc to use (default: nvcc on PATH)."),
        Switch("STRATA_PLUGINS", "path",
               "the plugins.yaml to load instead of the one next to the package "
               "(`strata --plugins PATH` sets it)."),
        Switch("STRATA_DISABLE_PLUGINS", "str",
               "comma-separated plugin names to leave out (as `enabled: false` in "
               "plugins.yaml does); `strata plugins` shows what is disabled."),
        Switch("STRATA_ROUTING", "choice:exact,f16,fp32",
               "router kernels of the CUDA backend: exact (the default: the experts the "
               "canonical float64 logits pick, near-ties included, from split-operand "
               "tensor-core logits proven or re-ranked per token), f16 (fp16 operands on "
               "tensor cores: fast, near-ties may flip) or fp32 (CUDA-core float32 logits)."),
        Switch("STRATA_DENSE_GEMM", "choice:cublas,own",
               "a whole model's dense projections and output head: cublas (cuBLAS GemmEx, the "
               "default) or own (the project's fp16 GEMM, whose bytes do not depend on the "
               "chunk's row count, so GPU logits are the same bytes for any chunking)."),
        Switch("STRATA_EMBEDDING", "choice:auto,device,host",
               "a whole model's token embedding on the CUDA backend: device (it stays in VRAM "
               "in its GGUF type, and each chunk uploads its token ids, whose rows the GPU "
               "decodes), host (the rows are decoded on the host and uploaded as float32 "
               "hidden states; the same bytes, without the VRAM of an embedding the output "
               "head does not share) or auto (the default: device for a quantized embedding "
               "or one a tied head on the device holds anyway, host for an F32, F16 or BF16 "
               "one, whose rows the host only copies)."),
        Switch("STRATA_STORE_MEMORY", "choice:alloc,register",
               "how the CUDA backend page-locks its host stores, the expert store and a "
               "whole model's streamed dense layers: alloc (the default: one cuMemHostAlloc "
               "per store, then the fill) or register (ordinary memory filled on the host, "
               "then page-locked once with cuMemHostRegister, the faster open of a large "
               "store); both hold the same bytes and copy at the same rate."),
        Switch("STRATA_F16_GEMM", "choice:auto,cutlass,own",
               "the grouped fp16 GEMM (fp16 images: FP16, IQ3_XXS f16_gemm): auto (on sm_90 "
               "CUTLASS's wgmma kernels for launches of 96 rows per expert or more when "
               "nvidia-cutlass is installed, warning once when it is not; the own mma.sync "
               "kernels otherwise), cutlass (the same, an error where it cannot) or own."),
        Switch("STRATA_CUTLASS_DIR", "path",
               "a CUTLASS checkout (include/, tools/util/include/) to build the sm_90 "
               "grouped GEMM with, instead of the nvidia-cutlass package's headers."),
        Switch("STRATA_OVERLAP_LAUNCH", "flag",
               "0: launch every kernel ordinarily; by default (1) the kernels that wait for the "
               "grid before them in the kernel (the routing chain) launch overlapped with it "
               "on sm_90 and later (programmatic dependent launch), the same results without "
               "the launch gap."),
        Switch("STRATA_HOST_MEMORY_CHECK", "flag",
               "0: skip the check that the host has the memory a run needs before it "
               "allocates (for systems that overcommit or swap); sizes beyond a 64-bit "
               "address space are refused regardless."),
    )
}


def _raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a strata_rt switch; known: {', '.join(SWITCHES)}")
    value = (os.environ if environ is None else environ).get(name)
    return None if value is None or value == "" else value


#: the most digits an integer switch takes (every one fits an int64)
_INT_DIGITS = 18


def _shown(value: str) -> str:
    """A switch's value as a message quotes it: its repr, cut at 120 characters."""
    return repr(value) if len(value) <= 120 else f"{value[:120]!r}... ({len(value):,} characters)"


def problem(name: str, value: str) -> str | None:
    """Why `value` is not valid for switch `name`, or None."""
    kind = SWITCHES[name].kind
    if kind == "flag" and value not in ("0", "1"):
        return "expected 0 or 1"
    if kind == "int":
        if not (value.isascii() and value.isdigit()):
            return "expected a positive whole number"
        digits = significant_digits(value)
        if digits > _INT_DIGITS:
            return f"a whole number of {digits:,} digits; expected one of at most {_INT_DIGITS}"
        if to_int(value) < 1:
            return "expected a positive whole number"
    if kind == "mib" and value != "all":
        try:
            ok = 0 <= float(value) <= 1 << 30  # 1 PiB: no machine has more
        except ValueError:
            ok = False
        if not ok:
            return "expected a number of MiB >= 0 (at most 1,073,741,824: 1 PiB), or all"
    if kind.startswith("choice:") and value not in kind[7:].split(","):
        return f"expected one of {kind[7:].replace(',', ', ')}"
    if kind == "program":
        found = shutil.which(value)
        if found is None:
            return ("not an executable file" if Path(value).exists()
                    else "no such program (give a path to nvcc, or a name on PATH)")
    if kind in ("outfile", "outdir"):
        try:
            path = user_path(value)
        except InputFileError as e:
            return e.why
        return (output_file_problem if kind == "outfile" else output_dir_problem)(path)
    return None


def _error(name: str, value: str, why: str) -> ConfigError:
    return ConfigError(f"environment {name}={_shown(value)}: {why}", source="environment")


def flag(name: str, default: bool = False) -> bool:
    """A 0/1 switch; any other value is an error naming the switch."""
    value = _raw(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise _error(name, value, "expected 0 or 1")
    return value == "1"


def text(name: str) -> str | None:
    """A path or string switch, or None when unset."""
    return _raw(name)


def _checked(name: str) -> str | None:
    """The switch's value once its kind accepts it (ConfigError naming it otherwise), or None
    when unset."""
    value = _raw(name)
    if value is not None:
        why = problem(name, value)
        if why is not None:
            raise _error(name, value, why)
    return value


def choice(name: str, default: str) -> str:
    """A switch that names one of a fixed set (its kind "choice:a,b"); default when unset."""
    value = _checked(name)
    return default if value is None else value


def choices(name: str) -> tuple[str, ...]:
    """The names a choice switch accepts (its kind "choice:a,b"), its default first, so a
    config field of the same meaning checks against the same list."""
    kind = SWITCHES[name].kind
    if not kind.startswith("choice:"):
        raise KeyError(f"{name} is a {kind} switch, not a choice")
    return tuple(kind[7:].split(","))


def integer(name: str) -> int | None:
    """A positive whole-number switch, or None when unset."""
    value = _checked(name)
    return None if value is None else to_int(value)


def closest(name: str) -> str | None:
    """The known switch a misspelt `STRATA_*` name most likely meant, or None."""
    found = difflib.get_close_matches(name, SWITCHES, n=1, cutoff=0.6)
    return found[0] if found else None


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """`STRATA_*` variables that are set but name no switch."""
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if k.startswith(PREFIX) and k not in SWITCHES)


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Parses every switch that is set (ConfigError listing each bad value, exit 2) and logs
    a warning for each `STRATA_*` variable that is no switch, naming the closest one. Which
    switches a run reads depends on its backend and format; this checks all of them."""
    environ = os.environ if environ is None else environ
    for name in unknown(environ):
        near = closest(name)
        hint = f"did you mean {near}?" if near else f"known switches: {', '.join(SWITCHES)}"
        log.warning("environment variable %s is not a strata_rt switch (ignored); %s",
                    name, hint)
    problems = []
    for name in SWITCHES:
        value = _raw(name, environ)
        why = None if value is None else problem(name, value)
        if value is not None and why is not None:
            problems.append(f"{name}={_shown(value)}: {why}")
    if problems:
        raise ConfigError(problems, source="environment")
