"""The GGML types as formats, one class each: experts keep a GGUF file's bytes for any type
the device decoders handle (strata_rt.formats.ggml_types.NAMES). IQ3_XXS and F16 are the
iq3_xxs and fp16 formats of their own modules (a quantizer and exact kernels of their own, and
the name fp16); every other type is a GGMLFormat with nothing but its type's name, and, where
the gguf package can quantize it, the round-trip bound the conformance suite holds it to
(Gaussian weights measured at 0.7 of each bound or less).
"""

from __future__ import annotations

from strata_rt.formats.contract import QuantFormat
from strata_rt.formats.ggml_format import GGMLFormat
from strata_rt.formats.hookspecs import hookimpl


class F32(GGMLFormat):
    ggml = "F32"
    roundtrip_nmse = 1e-12


class BF16(GGMLFormat):
    ggml = "BF16"
    roundtrip_nmse = 1e-5


class Q8_0(GGMLFormat):
    ggml = "Q8_0"
    roundtrip_nmse = 1e-4


class Q4_0(GGMLFormat):
    ggml = "Q4_0"
    roundtrip_nmse = 0.012


class Q4_1(GGMLFormat):
    ggml = "Q4_1"
    roundtrip_nmse = 0.01


class Q5_0(GGMLFormat):
    ggml = "Q5_0"
    roundtrip_nmse = 0.003


class Q5_1(GGMLFormat):
    ggml = "Q5_1"
    roundtrip_nmse = 0.0025


class Q2_K(GGMLFormat):
    ggml = "Q2_K"


class Q3_K(GGMLFormat):
    ggml = "Q3_K"


class Q4_K(GGMLFormat):
    ggml = "Q4_K"


class Q5_K(GGMLFormat):
    ggml = "Q5_K"


class Q6_K(GGMLFormat):
    ggml = "Q6_K"


class IQ2_XXS(GGMLFormat):
    ggml = "IQ2_XXS"


class IQ2_XS(GGMLFormat):
    ggml = "IQ2_XS"


class IQ2_S(GGMLFormat):
    ggml = "IQ2_S"


class IQ3_S(GGMLFormat):
    ggml = "IQ3_S"


class IQ4_NL(GGMLFormat):
    ggml = "IQ4_NL"


class IQ4_XS(GGMLFormat):
    ggml = "IQ4_XS"


class IQ1_S(GGMLFormat):
    ggml = "IQ1_S"


class IQ1_M(GGMLFormat):
    ggml = "IQ1_M"


class MXFP4(GGMLFormat):
    ggml = "MXFP4"
    roundtrip_nmse = 0.02


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [F32(), BF16(), Q8_0(), Q4_0(), Q4_1(), Q5_0(), Q5_1(), Q2_K(), Q3_K(), Q4_K(),
            Q5_K(), Q6_K(), IQ2_XXS(), IQ2_XS(), IQ2_S(), IQ3_S(), IQ4_NL(), IQ4_XS(), IQ1_S(),
            IQ1_M(), MXFP4()]
