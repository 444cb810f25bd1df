"""FP16 experts: GGML's F16 type, gate, up and down as fp16 row-major matrices.

A GGMLFormat like every GGML type, with two differences: its name is fp16, and its blocks are
fp16 images already, so f16_gemm's gathers copy bytes (batched and routed, as for every native
format) and its grouped fp16 GEMM reads them unchanged. With no quantization error in the
weights beyond fp16 rounding, it is the accuracy reference for the quantized formats on the GPU.
"""

from __future__ import annotations

from strata_rt.formats.contract import QuantFormat
from strata_rt.formats.ggml_format import GGMLFormat
from strata_rt.formats.hookspecs import hookimpl


class FP16(GGMLFormat):
    ggml = "F16"
    name = "fp16"
    roundtrip_nmse = 1e-6
    #: f16_gemm's products stay the grouped fp16 GEMM's on every chunk: its gathers are byte
    #: copies, so reading in place would save only that copy
    f16_gemm_in_place_rows = 0
    description = ("fp16 row-major experts (GGUF F16), 16 bits/weight; f16_gemm (default): "
                   "byte-copy gathers, grouped fp16 tensor-core GEMM; f16_fused: the GEMM that decodes blocks in its main loop; "
                   "the GPU accuracy reference")


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [FP16()]
