"""Decode steps on the GPU with the routed set kept on the device: the routed gathers (skip
unrouted experts, read host memory over PCIe) against the plain batched gather, whole
greedy runs through the decode plan - plain launches, then CUDA-graph replays at moving
positions - against the staging ring, byte for byte, and the gemv decode plan (matrix-vector
launches over the routed experts) against the routed one, and the split decode attention
against the tiled kernel: the same greedy tokens, logits within NMSE 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.engine import Engine
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.formats.ggml_format import down_typed
from strata_rt.formats.numerics import nmse
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.iq3_xxs_device import MMQ_VARIANTS
from strata_rt.schedule.plan import RoutedExperts
from strata_rt.schedule.plan_keys import DECODE_KEY

pytestmark = pytest.mark.gpu

SPEC = Qwen3Spec(n_layers=3, hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab=700,
                 ffn=256, n_experts=32, top_k=4, context=1024)


@pytest.mark.parametrize("variant", ["f16_gemm", MMQ_VARIANTS[0]])
def test_routed_gather_skips_unrouted_experts(rt, rng, variant) -> None:
    """16 experts (ids 16..31 of a 40-expert layer), even ones in device memory and odd ones in
    page-locked host memory: a routed member gets the bytes gather_batch gives it, an unrouted
    one leaves its poisoned positions untouched."""
    from strata_rt.runtime.hostmap import host_device_pointer

    fmt = IQ3XXS().for_variant(variant)
    H, F = SPEC.hidden, SPEC.ffn
    lay = fmt.layout(H, F)
    kern = fmt.kernels(rt, lay)
    s = rt.stream("test")
    slot = lay.slot_bytes
    host = rt.pinned({"store": MMQ_GROUP * slot})
    store = host.view("store")
    for i in range(MMQ_GROUP):
        store[i * slot: i * slot + lay.blob_bytes] = fmt.random_expert(rng, H, F)
    on_device = upload(rt, s, store)
    mapped = host_device_pointer(store)
    srcs = [(on_device.ptr if i % 2 == 0 else mapped) + i * slot for i in range(MMQ_GROUP)]
    counts = rng.integers(0, 3, 40).astype(np.int32)
    counts[16:32:3] = 0
    counts[17] = 2
    bounds = np.zeros(41, np.int32)
    bounds[1:] = np.cumsum(counts)
    d_bounds = upload(rt, s, bounds)
    gu_n, dn_n = MMQ_GROUP * lay.gate_up_image_bytes, MMQ_GROUP * lay.down_image_bytes
    want_gu, want_dn = poisoned(rt, s, gu_n), poisoned(rt, s, dn_n)
    got_gu, got_dn = poisoned(rt, s, gu_n), poisoned(rt, s, dn_n)
    kern.gather_batch(s, srcs, 0, want_gu.ptr, want_dn.ptr)
    kern.gather_routed(s, srcs, got_gu.ptr, got_dn.ptr, d_bounds.ptr, 16)
    for got, want, image in ((got_gu, want_gu, lay.gate_up_image_bytes),
                             (got_dn, want_dn, lay.down_image_bytes)):
        g = download(rt, s, got, np.uint8, (MMQ_GROUP, image))
        w = download(rt, s, want, np.uint8, (MMQ_GROUP, image))
        for p in range(MMQ_GROUP):
            if counts[16 + p] > 0:
                assert np.array_equal(g[p], w[p]), (variant, p)
            else:
                assert (g[p] == 0xFF).all(), (variant, p)
    assert (counts[16:32] > 0).any() and (counts[16:32] == 0).any()


def _greedy(model, decode: str, monkeypatch, steps: int = 8, **kw):
    monkeypatch.setenv("STRATA_DECODE", decode)
    ids = np.random.default_rng(8).integers(0, SPEC.vocab, 45)
    conf = {"model": model, "backend": "cuda", "prefill": 256, "expert_cache": 40, **kw}
    with Engine.open(conf) as eng:
        logits, _ = eng.prefill(ids)
        out, streamed = [logits], 0
        for _ in range(steps):
            logits, stats = eng.prefill(np.array([int(logits.argmax())]))
            out.append(logits)
            streamed += stats.experts_streamed
        trial = eng.driver.graph_trials.get(eng.driver.decode_key, {})
        mode = eng.driver.last_plan.mode
        if decode == "gemv":
            assert eng.driver.last_plan.count(RoutedExperts) == SPEC.n_layers
        else:
            assert eng.driver.decode_key == DECODE_KEY
    return out, streamed, trial, mode


@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_decode_plan_and_graph_equal_the_staging_ring(monkeypatch, dense) -> None:
    """Eight greedy steps with 40 of 96 experts resident: the decode plan (its first step plain
    launches, its second a captured graph, then the faster of the two) gives the staging
    ring's logits byte for byte at every step, and counts the same experts streamed."""
    model = Qwen3Model.synthetic(SPEC, 21, "iq3_xxs")
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    routed, r_streamed, trial, mode = _greedy(model, "routed", monkeypatch, dense=dense)
    staged, s_streamed, _, s_mode = _greedy(model, "staging", monkeypatch, dense=dense)
    assert mode == "decode" and s_mode == "staging"
    assert "plain" in trial and "graph" in trial and "error" not in trial, trial
    for step, (a, b) in enumerate(zip(routed, staged)):
        assert np.array_equal(a, b), (dense, step)
    assert r_streamed == s_streamed > 0


def test_decode_graph_off_runs_plain_launches(monkeypatch) -> None:
    """STRATA_CUDA_GRAPH=0: the decode plan launches op by op (no trial) with the same bytes."""
    model = Qwen3Model.synthetic(SPEC, 22, "iq3_xxs")
    with_graph = _greedy(model, "routed", monkeypatch, steps=4)
    monkeypatch.setenv("STRATA_CUDA_GRAPH", "0")
    plain = _greedy(model, "routed", monkeypatch, steps=4)
    assert plain[2] == {} and plain[3] == "decode"
    for a, b in zip(with_graph[0], plain[0]):
        assert np.array_equal(a, b)


#: gemv against routed: the logits of every step (the sums run in another order)
GEMV_LOGITS_NMSE = 1e-4


@pytest.mark.parametrize("fmt", ["q4_k", "iq3_xxs", "q4_k+q6_k"])
def test_gemv_decode_follows_the_routed_decode(monkeypatch, fmt) -> None:
    """Eight greedy steps with 40 of 96 experts resident (the rest read from host memory),
    the gemv plan's first step plain, then its captured graph: the same greedy tokens as the
    routed decode plan, every step's logits within GEMV_LOGITS_NMSE of its, the same experts
    streamed; a layer whose down tensors have another type (q4_k+q6_k) runs two types'
    kernels."""
    own = down_typed("Q4_K", "Q6_K")() if fmt == "q4_k+q6_k" else fmt
    model = Qwen3Model.synthetic(SPEC, 23, own)
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    gemv, g_streamed, trial, mode = _greedy(model, "gemv", monkeypatch)
    routed, r_streamed, _, _ = _greedy(model, "routed", monkeypatch)
    assert mode == "decode" and "plain" in trial and "graph" in trial and "error" not in trial
    tokens = [int(x.argmax()) for x in gemv]
    assert tokens == [int(x.argmax()) for x in routed]
    for step, (a, b) in enumerate(zip(gemv, routed)):
        err = nmse(a, b)
        print(f"{fmt} step {step}: logits NMSE {err:.3g} (gemv vs routed)")
        assert err <= GEMV_LOGITS_NMSE, (fmt, step, err)
    assert g_streamed == r_streamed > 0


#: split decode attention against the tiled kernel (float32 probabilities against fp16 ones)
SPLIT_LOGITS_NMSE = 1e-4


@pytest.mark.parametrize("decode", ["routed", "gemv"])
def test_split_decode_attention_follows_the_tiled_kernel(monkeypatch, decode) -> None:
    """Eight greedy steps (plain launches, then the captured graph replayed at moving
    positions, which reads the position on the device): decode_attention "split" gives the
    tiled kernel's greedy tokens, every step's logits within SPLIT_LOGITS_NMSE; the prompt's
    own logits (a 45-token chunk, tiled either way) are the same bytes."""
    model = Qwen3Model.synthetic(SPEC, 24, "iq3_xxs")
    monkeypatch.setenv("STRATA_DECODE_ATTENTION", "split")
    split, _, trial, _ = _greedy(model, decode, monkeypatch)
    assert "plain" in trial and "graph" in trial and "error" not in trial, trial
    monkeypatch.setenv("STRATA_DECODE_ATTENTION", "tiled")
    tiled, _, _, _ = _greedy(model, decode, monkeypatch)
    assert np.array_equal(split[0], tiled[0])
    assert [int(x.argmax()) for x in split] == [int(x.argmax()) for x in tiled]
    errs = [nmse(a, b) for a, b in zip(split[1:], tiled[1:])]
    print(f"{decode}: logits NMSE split vs tiled per step {[f'{e:.2g}' for e in errs]}")
    assert max(errs) <= SPLIT_LOGITS_NMSE, errs
    assert max(errs) > 0  # the steps did take the split kernels
