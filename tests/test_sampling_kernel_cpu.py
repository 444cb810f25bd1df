"""The sampling kernel's launcher without a GPU: the arguments it packs (in sampling.cu's order,
with the plan numpy uses), the shared memory it asks for, `strata check-kernels` finding the
source, and no pycuda imported by the sampler, its config or the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from strata_rt.backends.cuda.sampling_kernels import (
    SAMPLING_SOURCE,
    SamplingKernels,
    shared_bytes,
    signed_seed,
)
from strata_rt.errors import StrataError
from strata_rt.runtime.compile import kernel_jobs
from strata_rt.text.sampling import SamplingParams


class Launches:
    """A runtime whose module hands out one recording kernel."""

    def __init__(self):
        self.loaded: list[tuple[Path, str, str]] = []
        self.calls: list[dict] = []

    def module(self, source):
        rt = self

        class Module:
            def kernel(self, name, codes, overlap=False):
                rt.loaded.append((Path(source), name, codes))

                class Kernel:
                    def launch(self, **kw):
                        rt.calls.append(kw)

                return Kernel()

        return Module()


def test_the_launch_packs_the_kernels_arguments() -> None:
    rt = Launches()
    kern = SamplingKernels(rt)  # type: ignore[arg-type]
    assert rt.loaded == [(SAMPLING_SOURCE, "sample_logits", "PiPiffiddqiP")]
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.3, seed=(1 << 64) - 1)
    kern.sample("stream", 0x1000, 151_936, 0x2000, 17, params, 5, 0x3000)  # type: ignore[arg-type]
    call = rt.calls[-1]
    assert call["grid"] == (1, 1, 1) and call["block"] == (1024, 1, 1)
    assert call["shared"] == shared_bytes(151_936)
    args = call["args"]
    assert args[:4] == (0x1000, 151_936, 0x2000, 17)
    assert args[4] == pytest.approx(1.3) and args[5] == pytest.approx(0.7)
    assert args[6:] == (40, 0.9, 0.05, -1, 5, 0x3000)
    kern.sample("stream", 1, 100, 2, 0, SamplingParams(repetition_penalty=2.0, seed=3), 0, 4)  # type: ignore[arg-type]
    assert rt.calls[-1]["args"][4:7] == (2.0, 1.0, 1)  # temperature 0: one candidate
    with pytest.raises(StrataError, match="needs a seed"):
        kern.sample("stream", 1, 100, 2, 0, SamplingParams(temperature=1.0), 0, 4)  # type: ignore[arg-type]


def test_seeds_pack_as_int64() -> None:
    assert signed_seed(0) == 0 and signed_seed((1 << 63) - 1) == (1 << 63) - 1
    assert signed_seed(1 << 63) == -(1 << 63) and signed_seed((1 << 64) - 1) == -1


def test_shared_memory_fits_without_opting_in_for_qwen() -> None:
    assert shared_bytes(151_936) <= 48 * 1024
    assert shared_bytes(1) == 2048 * 8 + 2048 * 8
    assert shared_bytes(1 << 20) == 2048 * 8 + 1024 + 4096 + (1 << 20) // 8


def test_check_kernels_compiles_the_sampling_kernel() -> None:
    assert any(p.name == "sampling.cu" and owner == "model" for owner, p in kernel_jobs([]))


def test_sampling_needs_no_cuda() -> None:
    code = ("import sys; import strata_rt.text.sampling, strata_rt.cli.generate, "
            "strata_rt.config.run.sampling, strata_rt.backends.cuda.sampling_kernels; "
            "assert 'pycuda' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
