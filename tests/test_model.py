"""Model, layer math, ExpertStore and Residency on the CPU."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from strata_rt.errors import ConfigError
from strata_rt.schedule.vram.residency import Residency, RoutingProfile
from strata_rt.weights.model import (
    QWEN3_30B_SPEC,
    SMALL_SPEC,
    Model,
    MoESpec,
    rms_norm,
    route,
)
from strata_rt.weights.store import ExpertStore

TINY = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=8, top_k=2)


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model.synthetic(TINY, 5)


def test_spec_validation_names_every_problem():
    with pytest.raises(ConfigError) as ei:
        MoESpec(n_layers=0, hidden=256, ffn=-1, n_experts=4, top_k=2, rms_eps=0)
    msg = str(ei.value)
    assert "n_layers=0" in msg and "ffn=-1" in msg and "rms_eps=0" in msg
    with pytest.raises(ConfigError, match="top_k=5 exceeds n_experts=4"):
        MoESpec(n_layers=1, hidden=256, ffn=256, n_experts=4, top_k=5)


def test_synthetic_is_seeded_and_shaped(tiny):
    again = Model.synthetic(TINY, 5)
    other = Model.synthetic(TINY, 6)
    assert tiny.fmt.name == "iq3_xxs"
    assert tiny.blobs.shape == (2, 8, tiny.layout.blob_bytes)
    assert tiny.router.shape == (2, 8, 256) and tiny.router.dtype == np.float32
    assert tiny.norm.shape == (2, 256)
    assert np.array_equal(tiny.blobs, again.blobs) and np.array_equal(tiny.router, again.router)
    assert not np.array_equal(tiny.blobs, other.blobs)
    # every expert distinct in a model that fits the pool
    flat = tiny.blobs.reshape(16, -1)
    assert len({b.tobytes() for b in flat}) == 16
    assert abs(float(tiny.norm.mean()) - 1.0) < 0.05


def test_synthetic_routing_is_not_degenerate(tiny):
    h = np.random.default_rng(0).standard_normal((512, 256), dtype=np.float32)
    ids, w = route(rms_norm(h, tiny.norm[0], 1e-6), tiny.router[0], 2)
    counts = np.bincount(ids.reshape(-1), minlength=8)
    assert (counts > 0).all(), counts                 # every expert gets rows
    assert counts.max() < 0.5 * counts.sum(), counts  # no expert takes everything
    assert np.allclose(w.sum(axis=1), 1, atol=1e-6)


def test_pooled_synthetic_tiles_and_agrees_everywhere():
    spec = replace(TINY, n_layers=3)
    lay_bytes = Model.synthetic(TINY, 0).layout.blob_bytes
    m = Model.synthetic(spec, 1, pool_bytes=5 * lay_bytes)   # 5 distinct blobs for 24 experts
    assert m.experts.index is not None
    blobs = [[m.expert_blob(layer, e).copy() for e in range(8)] for layer in range(3)]
    out = np.zeros((8, m.layout.blob_bytes + 7), np.uint8)
    m.write_layer(2, out)
    assert np.array_equal(out[:, : m.layout.blob_bytes], np.stack(blobs[2]))
    assert len({b.tobytes() for row in blobs for b in row}) == 5
    assert not np.array_equal(blobs[0][0], blobs[1][0])       # layers are shifted
    full = m.blobs                                              # materialises
    assert np.array_equal(full[1, 3], blobs[1][3])
    sub = m.slice_layers(1, 3)
    assert np.array_equal(sub.expert_blob(0, 4), blobs[1][4])


def test_qwen3_30b_shape_is_cheap_to_create():
    t0 = time.perf_counter()
    m = Model.synthetic(QWEN3_30B_SPEC, 0)
    assert time.perf_counter() - t0 < 20
    assert m.layout.blob_bytes == 1_806_336
    assert m.expert_blob(47, 127).shape == (1_806_336,)
    assert m.experts.index is not None  # 11 GB never materialised here


def test_route_ties_go_to_the_lower_id():
    xn = np.ones((1, 4), np.float32)
    router = np.array([[1, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    ids, w = route(xn, router, 3)
    assert ids.tolist() == [[1, 2, 0]]
    assert np.isclose(w.sum(), 1)


def test_rms_norm_matches_definition():
    h = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    wt = np.linspace(0.5, 1.5, 256).astype(np.float32)
    want = h.astype(np.float64) / np.sqrt((h.astype(np.float64) ** 2).mean(1, keepdims=True)
                                          + 1e-6) * wt
    assert np.allclose(rms_norm(h, wt, 1e-6), want, rtol=1e-5, atol=1e-6)


def test_store_lays_out_every_blob_aligned(tiny):
    allocs = []

    def alloc(n):
        allocs.append(n)
        return np.full(n + 100, 0xAB, np.uint8)   # larger than asked, poisoned

    store = ExpertStore(tiny, alloc)
    assert allocs == [2 * 8 * tiny.layout.slot_bytes]
    assert store.slot_bytes % 256 == 0
    for layer in range(2):
        for e in range(8):
            assert store.offset(layer, e) % 256 == 0
            assert np.array_equal(store.view(layer, e), tiny.expert_blob(layer, e))
    pad = store.arena[store.offset(0, 0) + tiny.layout.blob_bytes: store.offset(0, 1)]
    assert (pad == 0).all()
    with pytest.raises(IndexError, match="layer 2 expert 0"):
        store.offset(2, 0)


def test_default_residency_spreads_evenly(tiny):
    res = Residency.from_budget(tiny, 5)
    assert res.pairs == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert res.slot(1, 1) == 4 and res.slot(1, 2) is None
    assert res.count == 5 and res.nbytes == 5 * tiny.layout.slot_bytes
    assert Residency.from_budget(tiny, 1000).n_slots == 16
    rep = res.report()
    assert "resident experts: 5 of 16" in rep and "\n    1         2" in rep


def test_profile_picks_most_routed_and_round_trips(tmp_path, tiny):
    counts = np.zeros((2, 8), np.int64)
    counts[1, 7] = 50
    counts[0, 3] = 40
    counts[1, 2] = 40
    prof = RoutingProfile(counts)
    res = Residency.from_budget(tiny, 2, prof)
    assert res.pairs == [(0, 3), (1, 7)]      # tie 40/40 -> lower layer
    path = tmp_path / "p.json"
    prof.save(path)
    assert np.array_equal(RoutingProfile.load(path).counts, counts)
    with pytest.raises(ConfigError, match="model has 2 layers x 8 experts"):
        Residency.from_budget(tiny, 2, RoutingProfile(np.zeros((3, 8), np.int64)))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a strata_rt routing profile"):
        RoutingProfile.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no such profile"):
        RoutingProfile.load(tmp_path / "missing.json")


def test_small_spec_matches_the_demo_config():
    assert (SMALL_SPEC.n_layers, SMALL_SPEC.n_experts, SMALL_SPEC.top_k, SMALL_SPEC.hidden,
            SMALL_SPEC.ffn) == (4, 32, 4, 512, 256)
