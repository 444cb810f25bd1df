"""A layer split on the CUDA backend, on the CPU through the recording fake runtime
(tests/_fake_runtime.py): one executor per part, each sized for its own layers; the receiver's
HandOff is a device copy of the sender's residual on its compute stream; the hand-off events
are recorded by their owner and waited on by the other part; a sender reads nothing of its
residual back; a captured plan runs its hand-off ops live around the graph; two GPUs open two
runtimes over one portable store, and the first context holds each part's streamed dense
layers too. The same split on a GPU: tests/test_cuda_split_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.engine import Engine, EngineConfig
from strata_rt.errors import ConfigError
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.weights.model import SMALL_SPEC, Model

H = SMALL_SPEC.hidden


def _moe_engine(devices, **kw) -> Engine:
    model = Model.synthetic(SMALL_SPEC, 3)
    return Engine.open(EngineConfig(model=model, backend="cuda", devices=devices,
                                    expert_cache=SMALL_SPEC.total_experts // 4,
                                    check_plan=True, timing=False, **kw))


def _log(backend, kind):
    return [name for k, name in backend.dev.compute.log if k == kind]


@pytest.mark.parametrize("store_memory", ["alloc", "register"])
def test_two_parts_on_one_gpu_hand_off_on_the_fake(fake, fixed_walk_rule, store_memory):
    with _moe_engine([0, 0], repeat_devices=True, store_memory=store_memory) as eng:
        rt = fake["rt"]
        assert len(fake["rts"]) == 1  # a device named twice shares its runtime
        first, second = eng.backend.backends
        assert (first.part.layers, second.part.layers) == (range(0, 2), range(2, 4))
        assert first.rt is second.rt
        if store_memory == "register":  # the store: filled, then registered once in the context
            (store,) = rt.host_arenas
            assert store.registered == 1 and store.registered_current
        else:  # one context: not portable
            assert rt.portable[0] is False and not rt.host_arenas
        # each part's arena holds its own layers' router, norms and routing bounds
        E = SMALL_SPEC.n_experts
        for b in (first, second):
            assert b.memory.regions["norm"] == 2 * H * 4
            assert b.memory.regions["bounds"] == 2 * (E + 1) * 4
        for n, tokens in enumerate((300, 2048, 2048), start=1):
            rt.tokens = tokens
            rt.launches.clear()
            rt.dtoh.clear()
            out, st = eng.prefill(np.ones((tokens, H), np.float32))
            assert out.shape == (tokens, H)
            assert st.experts_streamed > 0
            # one copy of the residual per chunk: the sender's x into the receiver's
            assert rt.peer_copies[-1] == (second.dev.ptr["x"], first.dev.ptr["x"],
                                          tokens * H * 4, "compute", 0)
            assert len(rt.peer_copies) == n
            # the sender reads its flag word back, never its residual; the receiver both
            assert all(src != first.dev.ptr["x"] for src, _, _ in rt.dtoh)
            assert (second.dev.ptr["x"], tokens * H * 4, "compute") in rt.dtoh
        # the third prefill replays both parts' captured walks, the hand-off live around them
        assert rt.launches == ["graph", "graph"]
        assert eng.driver.drivers[0].graph_trials[(2048, False, None)]["choice"]
        # the sender records ready and (after the first chunk) waits for taken; the receiver
        # waits for ready before its copy and records taken after it
        assert _log(first, "record").count("handoff_ready[2]") == 3
        assert _log(first, "wait").count("handoff_taken[2]") == 2
        assert _log(second, "wait").count("handoff_ready[2]") == 3
        assert _log(second, "record").count("handoff_taken[2]") == 3
        assert rt.activations > 0
    assert rt.closed


def _whole_model() -> tuple[Qwen3Spec, Qwen3Model]:
    """The seeded whole model both whole-model split tests open: the routing shape of
    SMALL_SPEC under 8 query heads of 64."""
    spec = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=H, n_heads=8, n_kv_heads=2,
                     head_dim=64, vocab=1000, ffn=SMALL_SPEC.ffn,
                     n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
    return spec, Qwen3Model.synthetic(spec, 3, "iq3_xxs")


def test_whole_model_split_holds_each_parts_layers(fake, monkeypatch, fixed_walk_rule):
    """Dense weights, KV cache and head: the part's own (the head on the last part only);
    the position register travels with the residual; only the last part runs Logits."""
    from test_cuda_engine_cpu import _RecordingCublas

    import strata_rt.backends.cuda.dense.kernels as dk
    import strata_rt.backends.cuda.executor as ex

    monkeypatch.setattr(dk, "Cublas", _RecordingCublas)
    monkeypatch.setattr(ex, "host_device_pointer", lambda host: 1 << 40)  # no driver here
    spec, whole = _whole_model()
    cfg = EngineConfig(model=whole, backend="cuda", devices=[0, 0], repeat_devices=True,
                       expert_cache=spec.n_experts, check_plan=True, timing=False,
                       context=1024, prefill=256)
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        first, second = eng.backend.backends
        assert first.memory.regions["head"] == 0 and second.memory.regions["head"] > 0
        assert first.memory.regions["head_out"] == 0
        kv_layer = 2 * 1024 * spec.kv_dim * 2
        assert first.memory.regions["kv"] == second.memory.regions["kv"] == 2 * kv_layer
        assert first._whole.kv_pointers(0)[0] == second._whole.kv_pointers(2)[0] - (
            second.dev.ptr["kv"] - first.dev.ptr["kv"])
        rt.tokens = 300
        logits, st = eng.prefill(np.arange(300) % spec.vocab)
        assert logits.shape == (spec.vocab,) and eng.kv_length == 300
        positions = [c for c in rt.peer_copies if c[2] == 4]
        assert [c[:2] for c in positions] == [(second.dev.ptr["position"],
                                               first.dev.ptr["position"])] * 2  # two chunks
        assert second._whole.position == 256
        with pytest.raises(RuntimeError, match="holds no head"):
            first._whole.run_logits(first.dev.compute, None, 1)
        rt.tokens = 1
        for _ in range(3):  # decode: planned, then plain, then replayed
            eng.prefill(np.array([5]))
        assert second._whole.position == 302
        assert eng.driver.decode_path == "gemv"  # both parts' (cli.generate names it)


@pytest.mark.parametrize("store_memory", ["alloc", "register"])
def test_two_gpus_open_two_runtimes_over_a_portable_store(fake, fixed_walk_rule, store_memory):
    with _moe_engine([0, 1], store_memory=store_memory) as eng:
        rts = fake["rts"]
        assert [r.device_index for r in rts] == [0, 1]
        # the store every context copies from: registered once (portable, which
        # HostArena.register always asks for: tests/test_host_arena.py), or allocated portable
        if store_memory == "register":
            assert [a.registered for a in rts[0].host_arenas] == [1] and not rts[1].host_arenas
        else:
            assert rts[0].portable[0] is True and not rts[0].host_arenas
        first, second = eng.backend.backends
        assert first.rt is rts[0] and second.rt is rts[1]
        rts[0].tokens = rts[1].tokens = 300
        eng.prefill(np.ones((300, H), np.float32))
        (copy,) = rts[1].peer_copies
        assert copy[4] == 0 and copy[3] == "compute"  # read from device 0, on device 1
        assert not rts[0].peer_copies
    assert all(r.closed for r in rts)


@pytest.mark.parametrize("store_memory", ["alloc", "register"])
def test_two_gpus_stream_each_parts_dense_layers_from_the_first_context(fake, monkeypatch,
                                                                        fixed_walk_rule,
                                                                        store_memory):
    """A whole model over two GPUs with streamed dense layers: each part's dense store is host
    memory of the first context as the expert store is (registered once after its fill, or
    allocated portable), and each part's DenseCopy reads its own layers' slot images."""
    from test_cuda_engine_cpu import _RecordingCublas

    import strata_rt.backends.cuda.dense.kernels as dk
    import strata_rt.backends.cuda.executor as ex
    from strata_rt.backends.cuda.dense.host_store import WHAT
    from strata_rt.backends.cuda.dense.slots import dense_slot_bytes

    monkeypatch.setattr(dk, "Cublas", _RecordingCublas)
    monkeypatch.setattr(ex, "host_device_pointer", lambda host: 1 << 40)  # no driver here
    spec, whole = _whole_model()
    cfg = EngineConfig(model=whole, backend="cuda", devices=[0, 1], dense="stream",
                       expert_cache=spec.n_experts, check_plan=True, timing=False,
                       context=1024, prefill=256, store_memory=store_memory)
    with Engine.open(cfg) as eng:
        rts = fake["rts"]
        parts = eng.backend.backends
        assert not rts[1].host_arenas and all(b._whole.streamed for b in parts)
        if store_memory == "register":
            assert [a.what for a in rts[0].host_arenas] == ["the expert store", WHAT, WHAT]
            assert [a.registered for a in rts[0].host_arenas] == [1, 1, 1]
            memory = [a.array for a in rts[0].host_arenas[1:]]
        else:  # every store of the first context portable: both contexts copy from them
            stores = [a for sizes, a in rts[0].pinned_arenas if list(sizes) == ["store"]]
            assert len(stores) == 3 and not rts[0].host_arenas
            assert [p for p, (sizes, _) in zip(rts[0].portable, rts[0].pinned_arenas)
                    if list(sizes) == ["store"]] == [True] * 3
            memory = [a.view("store") for a in stores[1:]]
        for rt in rts:
            rt.tokens = 300
            rt.htod.clear()
        eng.prefill(np.arange(300) % spec.vocab)
        for b, rt, mem in zip(parts, rts, memory):
            w = b._whole
            base, slot_bytes = b.dev.ptr["dense"], w.layout.slot_bytes
            copies = [h for dst, h, _ in rt.htod if base <= dst < base + 2 * slot_bytes]
            assert all(np.shares_memory(h, mem) for h in copies)
            layers = [(h.ctypes.data - mem.ctypes.data) // slot_bytes for h in copies]
            assert sorted(set(layers)) == list(range(w.n_layers))  # the part's own layers
            for h, i in zip(copies, layers):
                want = dense_slot_bytes(whole, b.first + i, w.layout.slots[i])
                assert h.tobytes() == want.tobytes()


def test_a_device_named_twice_needs_the_test_switch(fake):
    with pytest.raises(ConfigError, match="names a device twice"):
        _moe_engine([0, 0])
