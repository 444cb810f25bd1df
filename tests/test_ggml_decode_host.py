"""The GGML decoders (kernels/ggml/) on the CPU, in CI without a GPU: built by nvcc as host code
and compared with gguf.quants.dequantize byte for byte, for every type, on thousands of random
blocks (finite scales, edge scales first; the gather's 8-value path also on blocks starting at
every byte offset), on blocks the package's quantizer writes where it can, on IQ3_XXS blocks of
the project's own quantizer, and on unconstrained bytes (NaN-aware: a NaN or infinite scale).
Also: the generated headers match their sources, and the compiled traits match the Python
table; and a plugin's own decoder (the example plugin's TQ2_0, built from its source alone).
Skipped, with the reason, only where nvcc is absent."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest
from _ggml_blocks import QUANTIZABLE, gguf_quantize, quantize_source, random_blocks
from _ggml_host import SOURCE_DIR, HostDecoder, host_decoder, plugin_decoder

from strata_rt.errors import FormatError
from strata_rt.formats.ggml_types import BY_ID, NAMES, TYPES, GgmlType, ggml_type
from strata_rt.gemm.ggml_decoders import DecoderSpec
from strata_rt.runtime.compile import nvcc_available

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or "
                                "STRATA_NVCC): the host build of the decoders needs it")
#: blocks per type of the random-bytes tests (values for the 1-value float types)
BLOCKS = 4096
FLOAT_VALUES = 1 << 16
IDS = [t.name for t in TYPES]


@pytest.fixture(scope="module")
def dec() -> HostDecoder:
    return host_decoder()


def reference(t: GgmlType, raw: np.ndarray) -> np.ndarray:
    """gguf.quants.dequantize of whole blocks, flat float32 (its NaN warnings silenced)."""
    cols = t.block_values if t.block_values > 1 else 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return t.dequantize(raw, cols).reshape(-1)


def blocks_for(rng: np.random.Generator, t: GgmlType, finite: bool = True) -> np.ndarray:
    return random_blocks(rng, t, BLOCKS if t.block_values > 1 else FLOAT_VALUES, finite)


def assert_bits_equal(t: GgmlType, got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (
        f"{t.name} {what}: {bad.size} of {got.size} values differ; first at value {bad[0]} "
        f"(block {bad[0] // t.block_values}): got {got[bad[0]]!r} ({got.view(np.uint32)[bad[0]]:#x}), "
        f"gguf {want[bad[0]]!r} ({want.view(np.uint32)[bad[0]]:#x})")


# ------------------------------------------------------------------------- the one table
def _make_tables():
    spec = importlib.util.spec_from_file_location("ggml_make_tables", SOURCE_DIR / "make_tables.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_headers_match_their_sources():
    gen = _make_tables()
    assert (SOURCE_DIR / "traits.cuh").read_text() == gen.render_traits(), \
        "traits.cuh is stale: run python kernels/ggml/make_tables.py"
    assert (SOURCE_DIR / "tables.cuh").read_text() == gen.render_tables(), \
        "tables.cuh is stale: run python kernels/ggml/make_tables.py"


def test_iq3_xxs_grid_matches_the_iq3_xxs_format():
    """The IQ3_XXS grid is generated twice (the format's from quants/iq3_xxs_grid.py, this one
    from the package): both say the same."""
    from strata_rt.quants.iq3_xxs_grid import GRID

    gen = _make_tables()
    assert gen._words(gen._grid("IQ3_XXS"), 8) == [int(w) for w in GRID]


def test_table_lists_every_type_once_with_gguf_geometry():
    import gguf

    assert len(NAMES) == 23 and len(set(NAMES)) == 23 and len(BY_ID) == 23
    for t in TYPES:
        assert gguf.GGML_QUANT_SIZES[t.qtype] == (t.block_values, t.block_bytes)
        assert ggml_type(t.name) is ggml_type(t.type_id) is ggml_type(t.qtype) is t
    assert (ggml_type("Q4_K").block_values, ggml_type("Q4_K").block_bytes) == (256, 144)
    assert ggml_type("MXFP4").row_bytes(64) == 34
    with pytest.raises(FormatError, match="no decoder"):
        ggml_type("TQ1_0")
    with pytest.raises(FormatError, match="whole number"):
        ggml_type("Q6_K").row_bytes(300)


@needs_nvcc
def test_compiled_traits_match_the_table(dec):
    assert dec.traits() == [(t.type_id, t.block_values, t.block_bytes) for t in TYPES]


@needs_nvcc
def test_harness_refuses_unknown_types_and_partial_blocks(dec):
    raw = np.zeros(256, np.uint8)
    out = np.empty(256, np.float32)
    assert dec.lib.ggml_host_decode(35, raw.ctypes.data, 32, out.ctypes.data) == -1
    assert dec.lib.ggml_host_decode(ggml_type("Q4_0").type_id, raw.ctypes.data, 16,
                                    out.ctypes.data) == -2
    assert dec.lib.ggml_host_decode(ggml_type("F16").type_id, raw.ctypes.data, 3,
                                    out.ctypes.data) == -2
    assert dec.lib.ggml_host_decode_chunks(ggml_type("F16").type_id, raw.ctypes.data, 4,
                                           out.ctypes.data) == -2


# ------------------------------------------------------------------------- bit-exactness
@needs_nvcc
@pytest.mark.parametrize("name", IDS)
def test_random_blocks_decode_bit_exact(dec, rng, name):
    """Random bytes with finite fp16 scales (the edge patterns in the first blocks): every
    float32 bit equals the package's. The float types take every bit pattern, NaN included
    (the host keeps NaN payloads as numpy does)."""
    t = ggml_type(name)
    raw = blocks_for(rng, t)
    want = reference(t, raw)
    if t.name not in ("F32", "F16", "BF16"):
        assert np.isfinite(want).all() or t.name == "MXFP4"  # MXFP4's 2^127 * 12 is inf
    assert_bits_equal(t, dec.decode(t, raw), want, "random blocks")
    assert_bits_equal(t, dec.decode(t, raw, chunks=True), want, "random blocks, gather path")


@needs_nvcc
@pytest.mark.parametrize("name", IDS)
def test_gather_path_decodes_blocks_at_any_byte(dec, rng, name):
    """The gather's 8-value path reads blocks wherever they start (a source may start at any
    byte; the K-quants' chunk8 picks its load widths from each address): at every offset from a
    16-byte boundary, every value of every block equals the package's bit for bit."""
    t = ggml_type(name)
    raw = blocks_for(rng, t)[:64].reshape(-1)  # 64 blocks: every block start modulo 16
    want = reference(t, raw)
    buf = np.zeros(raw.size + 32, np.uint8)
    base = -buf.ctypes.data % 16
    for offset in range(16):
        src = buf[base + offset: base + offset + raw.size]
        src[:] = raw
        assert src.ctypes.data % 16 == offset
        assert_bits_equal(t, dec.decode(t, src, chunks=True), want,
                          f"gather path, source at 16n + {offset}")


@needs_nvcc
@pytest.mark.parametrize("name", IDS)
def test_unconstrained_bytes_decode_nan_aware(dec, rng, name):
    """Any bytes, NaN and infinite scales too: NaN exactly where the package has NaN, every
    other value bit for bit (a NaN's payload and sign may differ: numpy's vectorized loops pick
    either operand's NaN)."""
    t = ggml_type(name)
    raw = blocks_for(rng, t, finite=False)
    want = reference(t, raw)
    got = dec.decode(t, raw)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_bits_equal(t, got[~nan], want[~nan], "unconstrained bytes")


@needs_nvcc
@pytest.mark.parametrize("t", QUANTIZABLE, ids=[t.name for t in QUANTIZABLE])
def test_gguf_quantized_blocks_decode_bit_exact(dec, rng, t):
    """Blocks written by gguf.quants.quantize (for the types it can quantize) from weights at
    scales 1e-6..1e4, an all-zero block and a constant block among them."""
    nblocks = BLOCKS if t.block_values > 1 else FLOAT_VALUES // 32
    per_row = max(t.block_values, 32)
    raw = gguf_quantize(t, quantize_source(rng, nblocks, per_row))
    assert raw is not None
    want = reference(t, raw)
    assert_bits_equal(t, dec.decode(t, raw), want, "gguf-quantized blocks")
    assert_bits_equal(t, dec.decode(t, raw, chunks=True), want, "gguf-quantized, gather path")


def test_gguf_quantizes_the_types_it_is_known_to():
    """What the tests above cover with real quantizer output; the K-quants and i-quants have a
    dequantizer only in the package (their random-bytes tests stand in)."""
    names = {t.name for t in QUANTIZABLE}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"} <= names


@needs_nvcc
def test_project_quantized_iq3_xxs_blocks_decode_bit_exact(dec, rng):
    """IQ3_XXS blocks of the project's own quantizer (quants/iq3_xxs_quantize.py)."""
    from strata_rt.quants.iq3_xxs import IQ3XXS

    t = ggml_type("IQ3_XXS")
    w = quantize_source(rng, 64, 256).reshape(16, 1024)
    raw = np.asarray(IQ3XXS().quantize(w), dtype=np.uint8)
    assert raw.size == 64 * t.block_bytes
    assert_bits_equal(t, dec.decode(t, raw), reference(t, raw), "project-quantized blocks")


@needs_nvcc
def test_pairs_of_one_value_types_span_two_blocks(dec):
    """F16's pair (v, v + 1) reads two consecutive 2-byte blocks: the last value is not lost."""
    t = ggml_type("F16")
    vals = np.array([1.5, -2.0, 65504.0, 2.0 ** -24], dtype=np.float16)
    got = dec.decode(t, vals.view(np.uint8))
    assert np.array_equal(got, vals.astype(np.float32))


# ------------------------------------------------------------------------- a plugin's decoder
#: the example plugin's TQ2_0 decoder: one struct and one STRATA_GGML_KERNELS line
TQ2_SOURCE = (Path(__file__).resolve().parent / "plugins" / "strata_testfmt" / "strata_testfmt"
              / "kernels" / "tq2_0.cu")
TQ2 = DecoderSpec("TQ2_0", 256, 66)


def tq2_reference(raw: np.ndarray) -> np.ndarray:
    import gguf

    flat = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, TQ2.block_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = gguf.quants.dequantize(flat, gguf.GGMLQuantizationType.TQ2_0)
    return np.asarray(out, dtype=np.float32).reshape(-1)


@needs_nvcc
@pytest.mark.parametrize("kind", ["random", "gguf-quantized", "unconstrained"])
def test_plugin_tq2_0_decodes_bit_exact(rng, kind):
    """The plugin's decoder, built from its own source as host code (-DSTRATA_GGML_HOST turns
    its macro line into host exports), equals gguf.quants.dequantize bit for bit, pair by pair
    and on the gather's 8-value path; NaN exactly where the package has NaN."""
    import gguf

    dec = plugin_decoder(TQ2_SOURCE)
    if kind == "gguf-quantized":
        w = quantize_source(rng, BLOCKS, 256)
        raw = np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.TQ2_0))
    else:
        raw = random_blocks(rng, TQ2, BLOCKS, finite=kind != "unconstrained")
    want = tq2_reference(raw)
    for chunks in (False, True):
        got = dec.decode_suffix(TQ2.name, TQ2.block_values, TQ2.block_bytes, raw, chunks)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert (kind == "unconstrained") or not nan.any()
        bad = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
        assert bad.size == 0, f"TQ2_0 ({kind}, chunks={chunks}): {bad.size} values differ"


@needs_nvcc
def test_macro_exports_decode_as_the_type_harness(dec, rng):
    """The built-in harness's per-type exports (the same macro a plugin writes, in host mode)
    decode as ggml_host_decode does."""
    for t in TYPES:
        raw = blocks_for(rng, t)[:64]
        want = dec.decode(t, raw)
        got = dec.decode_suffix(t.name, t.block_values, t.block_bytes, raw, chunks=True)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
