"""The GGML dequantizing gather without a GPU: gather.cu compiles for sm_80 and sm_90 with one
kernel per type, and the launcher's checks, grid and arguments (through a recording fake
runtime). The bytes it writes are tested on the GPU (test_ggml_gather_gpu.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _launch_log import LoggingRuntime

from strata_rt.errors import FormatError
from strata_rt.formats.ggml_types import TYPES, ggml_type
from strata_rt.gemm.ggml_gather import (
    GATHER_ARG_TYPES,
    GATHER_SOURCE,
    GATHER_STEP_BYTES,
    GATHER_THREADS,
    GgmlGather,
    check_geometry,
    gather_blocks,
    groups_per_step,
    images_reference,
)
from strata_rt.resources import KERNELS_ROOT
from strata_rt.runtime.compile import compile_cubin, kernel_jobs, nvcc_available


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or STRATA_NVCC)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gather_compiles_one_kernel_per_type(arch):
    cubin = compile_cubin(GATHER_SOURCE, arch).read_bytes()
    names = set(re.findall(rb"ggml_gather_([A-Z0-9_]+?)\x00", cubin))
    assert {t.name.encode() for t in TYPES} <= names


def test_check_kernels_compiles_the_ggml_sources():
    """`strata check-kernels` (and the installed wheel's check) covers kernels/ggml too."""
    ggml = sorted(p for owner, p in kernel_jobs([]) if owner == "ggml")
    assert GATHER_SOURCE.resolve() in ggml
    assert ggml == sorted(p.resolve() for p in (KERNELS_ROOT / "ggml").glob("*.cu"))


def test_launch_arguments_and_grid():
    rt = LoggingRuntime(GATHER_ARG_TYPES)
    gg = GgmlGather(rt)  # type: ignore[arg-type]
    assert rt.sources == [GATHER_SOURCE]
    srcs = [0x1001, 0, 0x3003]
    gg.gather("stream", "Q4_K", srcs, 0x10000, 768, 2048, first_pos=2, image_stride=2 * 768 *
              2048 + 16, bounds=0x500, first_expert=7)
    name, grid, block, args = rt.log[-1]
    assert name == "ggml_gather_Q4_K" and block == (GATHER_THREADS, 1, 1)
    # 6,144 groups of 256 values; a Q4_K group is 144 bytes, so a warp stages 1024 // 144 = 7
    # a step: 8 warps a block take 56, 110 blocks cover them (under 2048 / 3 a member)
    assert grid == (110, 3, 1)
    assert args[:3] == tuple(srcs) and args[3:16] == (0,) * 13
    assert args[16:] == (0x10000, 2 * 768 * 2048 + 16, 768 * 2048, 2, 0x500, 7)
    gg.gather("stream", ggml_type("F32"), [0x2000], 0x20000, 1, 8)
    name, grid, _, args = rt.log[-1]
    assert name == "ggml_gather_F32" and grid == (1, 1, 1) and args[17] == 16  # default stride


def test_groups_per_step_follow_the_staged_bytes():
    """GatherStep::GROUPS in gather_run.cuh: 1024 staged bytes a warp over a group's bytes,
    1 to 8 groups."""
    want = {"Q4_K": 7, "Q6_K": 4, "Q2_K": 8, "IQ3_XXS": 8, "Q8_0": 3, "F16": 2, "F32": 1,
            "BF16": 2}
    assert {n: groups_per_step(ggml_type(n)) for n in want} == want
    assert GATHER_STEP_BYTES == 1024 and GATHER_THREADS == 256
    # a launch too small to give every warp a step still gets one block per member's share
    assert gather_blocks(ggml_type("F32"), 8, 16) == 1
    assert gather_blocks(ggml_type("Q4_K"), 768 * 2048, 1) == 110


def test_launcher_refuses_what_the_kernel_cannot_do():
    gg = GgmlGather(LoggingRuntime(GATHER_ARG_TYPES))  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="whole number"):
        gg.gather(None, "IQ2_S", [1], 0, 2, 300)
    with pytest.raises(FormatError, match="multiple of 8"):
        gg.gather(None, "F16", [1], 0, 1, 6)
    with pytest.raises(FormatError, match="batch holds"):
        gg.gather(None, "Q8_0", [1] * 17, 0, 1, 32)
    with pytest.raises(FormatError, match="end by position"):
        gg.gather(None, "Q8_0", [1, 1], 0, 1, 32, first_pos=15)
    with pytest.raises(FormatError, match="less than one"):
        gg.gather(None, "Q8_0", [1], 0, 2, 32, image_stride=64)
    with pytest.raises(FormatError, match="16-byte"):
        gg.gather(None, "Q8_0", [1], 0, 2, 32, image_stride=136)
    with pytest.raises(FormatError, match="16-byte"):
        gg.gather(None, "Q8_0", [1], 4, 2, 32)
    with pytest.raises(FormatError, match="no decoder"):
        gg.gather(None, "Q8_1", [1], 0, 2, 32)
    assert check_geometry(ggml_type("MXFP4"), 3, 64) == 192


def test_images_reference_is_gguf_rounded_to_fp16(rng):
    t = ggml_type("Q8_0")
    w = rng.standard_normal((4, 64)).astype(np.float32)
    import gguf

    raw = gguf.quants.quantize(w, t.qtype)
    want = gguf.quants.dequantize(raw, t.qtype).astype(np.float16)
    assert np.array_equal(images_reference(t, raw, 4, 64), want)
