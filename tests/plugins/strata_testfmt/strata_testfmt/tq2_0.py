"""TQ2_0 (ternary weights, 2 bits each, one fp16 scale per 256): a GGML type strata_rt does not
build in, added the way a plugin adds any GGML type - this class and the decoder in
kernels/tq2_0.cu. GGMLFormat supplies the rest (sizes, gguf's dequantize and quantize, GGUF
loading, gathers, both fp16 products and their references)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from strata_rt import hookimpl
from strata_rt.formats.ggml_format import GGMLFormat


class TQ2_0(GGMLFormat):
    ggml = "TQ2_0"
    decoder_source = Path(str(resources.files(__package__).joinpath("kernels", "tq2_0.cu")))
    #: ternary values: a Gaussian matrix keeps only its sign pattern and one scale per block
    roundtrip_nmse = 0.75


@hookimpl
def strata_rt_formats() -> list[GGMLFormat]:
    return [TQ2_0()]
