"""Models whose layers store their experts in different formats (mixed files).

The claim under test: a mixed model runs each layer exactly as a model of that layer's format
alone would, with one store and one set of slots sized for the largest layer. Layer by layer,
the mixed engine's output must equal (byte for byte) a chain of one-layer engines, each of
one format; and a copy moves the layer's own blob bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import FormatError
from strata_rt.formats.registry import registry
from strata_rt.weights.layer_formats import LayerFormats
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore

#: hidden 256 and ffn 256 suit both formats (IQ3_XXS needs multiples of 256)
SPEC = MoESpec(n_layers=4, hidden=256, ffn=256, n_experts=8, top_k=2)
#: IQ3_XXS (fp16 images via f16_gemm) and FP16 layers share images and activations
MIX = ("iq3_xxs", "fp16", "fp16", "iq3_xxs")


def _variant(name: str):
    """The format object the engine runs for `name` by default."""
    return registry()[name].for_variant(None)


def mixed_model(seed: int = 3) -> Model:
    return Model.synthetic(SPEC, seed, layer_formats=[_variant(n) for n in MIX])


def test_table_describes_runs_and_sizes_slots_by_the_largest_layer() -> None:
    m = mixed_model()
    f = m.formats
    assert f.mixed and len(f) == 4
    sizes = [lay.blob_bytes for lay in f.layouts]
    assert sizes[1] == sizes[2] > sizes[0] == sizes[3]
    assert m.layout.blob_bytes == max(sizes) and f.slot_bytes >= max(sizes)
    lines = f.describe()
    assert len(lines) == 3 and lines[0].startswith("layer 0: iq3_xxs")
    assert lines[1].startswith("layers 1-2: fp16")


def test_store_pads_each_layer_with_zeros_and_views_its_own_blob() -> None:
    m = mixed_model()
    store = ExpertStore(m)
    for layer, lay in enumerate(m.formats.layouts):
        for e in (0, SPEC.n_experts - 1):
            off = store.offset(layer, e)
            assert store.view(layer, e).size == lay.blob_bytes
            assert np.array_equal(store.view(layer, e), m.expert_blob(layer, e)[:lay.blob_bytes])
            assert not store.arena[off + lay.blob_bytes: off + store.slot_bytes].any()


def test_formats_that_cannot_share_group_buffers_are_refused() -> None:
    exact = registry()["iq3_xxs"].for_variant("f16_pipe")  # q8_1 activations, native images
    with pytest.raises(FormatError, match="layer 1's experts"):
        LayerFormats.of([_variant("fp16"), exact], SPEC.hidden, SPEC.ffn)


def _layer_alone(m: Model, layer: int) -> Model:
    """Layer `layer` of m as a one-layer model of its own format (the same blobs)."""
    one = m.slice_layers(layer, layer + 1)
    fmt = m.formats.format(layer)
    n = m.formats.layout(layer).blob_bytes
    blobs = np.stack([one.expert_blob(0, e)[:n] for e in range(SPEC.n_experts)])[None]
    from dataclasses import replace

    return Model(replace(SPEC, n_layers=1), fmt, one.router, one.norm, blobs)


@pytest.mark.parametrize("cache", [0, 16, 32])
def test_mixed_engine_equals_a_chain_of_one_format_layers(cache: int) -> None:
    m = mixed_model()
    h0 = np.random.default_rng(7).standard_normal((37, SPEC.hidden), dtype=np.float32)
    with Engine.open(EngineConfig(model=m, backend="reference", expert_cache=cache)) as eng:
        got, stats = eng.prefill(h0)
    h = h0
    for layer in range(SPEC.n_layers):
        alone = _layer_alone(m, layer)
        with Engine.open(EngineConfig(model=alone, backend="reference",
                                      expert_cache=min(cache, SPEC.n_experts))) as eng:
            h, _ = eng.prefill(h)
    assert np.array_equal(got, h)
    # every streamed expert moved its own layer's bytes, not the largest layer's
    sizes = np.array([lay.blob_bytes for lay in m.formats.layouts])
    assert stats.bytes_streamed <= stats.experts_streamed * sizes.max()
    if cache == 0:
        assert stats.bytes_streamed < stats.experts_streamed * sizes.max()


@pytest.mark.gpu
@pytest.mark.parametrize("gather_one", [True, False])
@pytest.mark.parametrize("cache", [0, 16])
def test_cuda_mixed_engine_equals_a_chain_of_one_format_layers(gather_one: bool,
                                                               cache: int) -> None:
    """The CUDA backend: each layer's own kernels (the IQ3_XXS dequantizing gather and in-place
    GEMM, the FP16 copy), the same bytes as one-format engines layer by layer; both gather
    modes, streamed and resident experts, short (in place) and longer chunks."""
    m = mixed_model()
    for tokens in (37, 700):
        h0 = np.random.default_rng(tokens).standard_normal((tokens, SPEC.hidden),
                                                           dtype=np.float32)
        cfg = dict(backend="cuda", gather_one=gather_one)
        with Engine.open(EngineConfig(model=m, expert_cache=cache, **cfg)) as eng:
            got, _ = eng.prefill(h0)
        h = h0
        for layer in range(SPEC.n_layers):
            alone = _layer_alone(m, layer)
            with Engine.open(EngineConfig(model=alone, expert_cache=min(cache, SPEC.n_experts),
                                          **cfg)) as eng:
                h, _ = eng.prefill(h)
        assert np.array_equal(got, h), f"{tokens} tokens"
