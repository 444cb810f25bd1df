"""The routed walk (planner.plan_walk with routed copies): the walk's schedule whose copies each
layer's routing switches on the device, so only routed experts cross PCIe on the copy engine.

CPU: plans on random residencies, lane counts and image caches pass the hazard checker and
have the shape the executors rely on; hand-broken plans are rejected; on the reference backend
(which poisons the slot of every copy switched off) the logits equal the walk's byte for byte
while only routed non-resident experts count as streamed. GPU: the switched copies themselves
(runtime/conditional.py, kernels/common/copy_switches.cu) on poisoned buffers, and the whole
engine's captured routed walk against its walk."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata_rt.engine import Engine
from strata_rt.errors import PlanHazardError, StrataError
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec
from strata_rt.schedule.hazards import check
from strata_rt.schedule.plan import (
    COPY_CHAINS,
    LANES,
    ChunkPlan,
    Copy,
    GatherBatch,
    GatherRouted,
    LayerBegin,
    LayerPlan,
    Record,
    RouteCopies,
    Wait,
    copies_routed,
)
from strata_rt.schedule.planners.dense_schedule import DenseSchedule
from strata_rt.schedule.planners.planner import plan_walk
from strata_rt.schedule.vram.image_cache import ImageCache
from strata_rt.schedule.vram.residency import Residency

SPEC = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=300,
                 ffn=256, n_experts=32, top_k=4, context=512)
MOE = SPEC.moe_spec()


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.synthetic(SPEC, 5, "iq3_xxs")


def _routed_walk(res: Residency, ring: int = 20, lanes: int = 1, start: int | None = None,
                 in_place: bool = False, images: ImageCache | None = None) -> ChunkPlan:
    attention = None if start is None else DenseSchedule(SPEC.n_layers, start, None)
    return plan_walk(MOE, res, ring, False, tokens=64, attention=attention, lanes=lanes,
                     in_place=in_place, routed_copies=True, images=images)


def _resident_groups(res: Residency) -> list[tuple[int, int]]:
    return [(layer, g) for layer in range(SPEC.n_layers)
            for g in range(SPEC.n_experts // MMQ_GROUP)
            if all(res.slot(layer, e) is not None
                   for e in range(g * MMQ_GROUP, (g + 1) * MMQ_GROUP))]


def _random_scenario(model, rng) -> tuple[Residency, int, ImageCache]:
    """A random residency, ring size, and image cache of up to two whole-resident groups."""
    res = Residency.from_budget(model.moe, int(rng.integers(0, 2 * SPEC.n_experts + 1)))
    ring = int(rng.integers(MMQ_GROUP, 3 * MMQ_GROUP))
    whole = _resident_groups(res)
    cached = [whole[i] for i in rng.permutation(len(whole))[:int(rng.integers(0, 3))]]
    return res, ring, ImageCache(tuple(cached), capacity=len(cached))


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("start", [None, 9])
def test_routed_walks_pass_the_checker_on_random_residencies(model, rng, lanes, start) -> None:
    """Random residencies, rings, lanes, in-place reads and image caches of resident groups:
    every Copy routed and issued after its layer's RouteCopies (which names exactly the layer's
    entries, in order), every ring read inside a GatherRouted, the checker content."""
    for _ in range(12):
        res, ring, images = _random_scenario(model, rng)
        plan = _routed_walk(res, ring, lanes, start, bool(rng.integers(2)), images)
        assert plan.mode == "routed_walk"
        check(plan, res, images=images)
        routed_layer: int | None = None
        switched: list[tuple[int, int]] = []
        entries = []
        for _, op in plan.ops():
            if isinstance(op, RouteCopies):
                routed_layer = op.layer
                switched += op.copies
                assert [e for _, e in op.copies] == [
                    e for e in range(SPEC.n_experts) if res.slot(op.layer, e) is None]
            if isinstance(op, Copy):
                assert op.routed and op.layer == routed_layer
                entries.append((op.entry, op.expert))
            assert not isinstance(op, GatherBatch)
        assert entries == switched == sorted(switched)
        assert len(entries) == int((~res.mask()).sum())


def test_a_ring_smaller_than_a_groups_streamed_experts_is_refused() -> None:
    """A group's ring entries are gathered in one launch: the ring holds a group's streamed
    experts (16 with nothing resident; 13 where three of each group are resident)."""
    res = Residency(SPEC.n_layers, SPEC.n_experts, [], 256)
    with pytest.raises(ValueError, match=f"a group here streams {MMQ_GROUP} experts"):
        _routed_walk(res, ring=MMQ_GROUP - 1)
    some = [(layer, e) for layer in range(SPEC.n_layers) for e in range(SPEC.n_experts)
            if e % MMQ_GROUP < 3]
    res = Residency(SPEC.n_layers, SPEC.n_experts, some, 256)
    check(_routed_walk(res, ring=MMQ_GROUP - 3), res)
    with pytest.raises(ValueError, match="streams 13 experts"):
        _routed_walk(res, ring=12)


def _reject(plan: ChunkPlan, res: Residency, *patterns: str) -> None:
    with pytest.raises(PlanHazardError) as ei:
        check(plan, res)
    for p in patterns:
        assert re.search(p, str(ei.value)), f"{p!r} not in: {ei.value}"


def _edited(plan: ChunkPlan, edit) -> ChunkPlan:
    return ChunkPlan(plan.tokens, plan.mode, plan.ring_slots,
                     [LayerPlan(lp.layer, tuple(edit(list(lp.ops)))) for lp in plan.layers])


def test_broken_routed_walks_are_rejected() -> None:
    res = Residency(SPEC.n_layers, SPEC.n_experts, [(0, 3), (1, 5)], 256)
    plan = _routed_walk(res)
    check(plan, res)
    no_wait = _edited(plan, lambda ops: [op for op in ops if not (
        isinstance(op, Wait) and op.event == copies_routed(1))])
    _reject(no_wait, res, r"Copy\(entry \d+, layer 1.*routed\) may run before",
            r"RouteCopies\(layer 1\)", r"Wait\(copies_routed\[1\]\)")
    unswitched = _edited(plan, lambda ops: [op for op in ops if not (
        isinstance(op, RouteCopies) and op.layer == 0)])
    _reject(unswitched, res, r"no RouteCopies before it switched entry 0")
    before_routing = _edited(plan, lambda ops: [op for op in ops if not isinstance(op, LayerBegin)])
    _reject(before_routing, res, r"no LayerBegin\(layer 0\)")

    def plain_gathers(ops):
        return [GatherBatch(op.group, 0, op.gathers, op.stream) if isinstance(op, GatherRouted)
                else op for op in ops]
    _reject(_edited(plan, plain_gathers), res, r"whose routed Copy may have been switched off",
            r"only a GatherRouted")
    twice = _edited(plan, lambda ops: ops + [op for op in ops if isinstance(op, RouteCopies)])
    _reject(twice, res, r"switches entry \d+ a second time")
    assert Record(copies_routed(0), LANES[0]) in [op for _, op in plan.ops()]


def _prefill(model, ids, stream: str, monkeypatch, backend: str = "reference",
             runs: int = 1, **conf):
    monkeypatch.setenv("STRATA_PREFILL_STREAM", stream)
    monkeypatch.setenv("STRATA_CHECK_PLAN", "1")
    out = []
    with Engine.open({"model": model, "backend": backend, "prefill": 128, "expert_cache": 24,
                      **conf}) as eng:
        for _ in range(runs):
            eng.reset()
            logits, stats = eng.prefill(np.asarray(ids))
            out.append((logits.copy(), stats, eng.driver.last_plan.mode,
                        dict(eng.driver.graph_trials)))
        walk_bytes = eng.driver.walk_bytes()
    return out, walk_bytes


def test_reference_routed_walk_gives_the_walks_bytes(model, monkeypatch, rng) -> None:
    """8 random tokens (few enough that some non-resident expert goes unrouted: 60 could
    route them all), 24 of 64 experts resident: the routed walk's logits equal the walk's byte
    for byte (its switched-off copies poison their slots, so a read would show), and it
    streams only the routed non-resident experts: fewer bytes than the walk, as many as the
    routed plan."""
    ids = rng.integers(0, SPEC.vocab, 8)
    [(lw, sw, mw, _)], walk_bytes = _prefill(model, ids, "walk", monkeypatch)
    [(lr, sr, mr, _)], _ = _prefill(model, ids, "routed_walk", monkeypatch)
    [(lp, sp, mp, _)], _ = _prefill(model, ids, "routed", monkeypatch)
    assert (mw, mr, mp) == ("walk", "routed_walk", "routed")
    assert lr.tobytes() == lw.tobytes() == lp.tobytes()
    assert sw.bytes_streamed == walk_bytes
    assert 0 < sr.bytes_streamed == sp.bytes_streamed < walk_bytes
    assert sr.experts_streamed == sp.experts_streamed


def test_routed_walk_needs_a_backend_that_switches_copies(model, monkeypatch) -> None:
    from strata_rt.backends.reference.executor import ReferenceBackend

    monkeypatch.setattr(ReferenceBackend, "routed_copies", False)
    with pytest.raises(StrataError, match="cannot switch copies on the device"):
        _prefill(model, np.arange(40), "routed_walk", monkeypatch)


def test_routed_walk_on_a_ring_under_a_groups_experts_names_ring_mib(model, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_PREFILL_STREAM", "routed_walk")
    with Engine.open({"model": model, "backend": "reference", "prefill": 128,
                      "expert_cache": 24}) as eng:
        eng.driver.executor.walk_slots = 1
        with pytest.raises(StrataError, match="a group streams .* experts, gathered in one "
                                              "launch, and the walk ring holds 1 slots: give "
                                              "it more room .ring_mib."):
            eng.prefill(np.arange(40))


def test_a_driver_without_conditional_nodes_keeps_every_other_call(monkeypatch) -> None:
    """A 12.2 driver lacks the conditional-node calls: libcuda() still loads the others, and
    no executor offers the routed walk there."""
    import ctypes

    from strata_rt.runtime import conditional, driver_api

    newer = {"cuGraphConditionalHandleCreate", "cuStreamBeginCaptureToGraph",
             "cuGraphAddNode_v2", "cuStreamGetCaptureInfo_v3",
             "cuStreamUpdateCaptureDependencies_v2"}

    class Call:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args):
            if self.name == "cuDriverGetVersion":
                args[0]._obj.value = 12020
            return 0

    class OldDriver:
        def __init__(self, path: str) -> None:
            self.path = path

        def __getattr__(self, name: str) -> Call:
            if name in newer:
                raise AttributeError(name)
            call = Call(name)
            setattr(self, name, call)
            return call

    monkeypatch.setattr(ctypes, "CDLL", OldDriver)
    driver_api.libcuda.cache_clear()
    conditional.conditional_copies_supported.cache_clear()
    try:
        lib = driver_api.libcuda()
        assert lib.cuGraphLaunch.restype is ctypes.c_int and not hasattr(lib, "cuGraphAddNode_v2")
        assert not conditional.conditional_copies_supported()
    finally:
        driver_api.libcuda.cache_clear()
        conditional.conditional_copies_supported.cache_clear()


def test_a_failed_routed_walk_capture_stops_auto_taking_it(model, monkeypatch) -> None:
    """Switches exist only inside a graph: once a routed walk's capture failed (the driver
    then launches it plainly, copying every expert), auto streams routed experts by the
    routed plan instead, and a forced routed walk is refused naming the failure."""
    same = np.full(40, 7)
    monkeypatch.setenv("STRATA_PREFILL_STREAM", "auto")
    with Engine.open({"model": model, "backend": "reference", "prefill": 128,
                      "expert_cache": 24}) as eng:
        modes = []
        for failed in (False, False, True):
            eng.driver._switches_failed = failed
            eng.reset()
            eng.prefill(same)
            modes.append(eng.driver.last_plan.mode)
        assert modes == ["walk", "routed_walk", "routed"]
        eng.driver.cfg.prefill_stream = "routed_walk"
        with pytest.raises(StrataError, match="its capture failed earlier"):
            eng.prefill(same)


class _RecordedSwitches:
    """runtime.conditional.CopySwitches as the fake runtime's capture records it."""

    def __init__(self, rt, n_entries, side):
        self.n, self.side = n_entries, side
        self.experts: dict[int, int] = {}
        self.copies: list[tuple[int, str, int]] = []
        self.uploaded = False

    def handles_ptr(self, entry):
        return (1 << 40) + 8 * entry

    def experts_ptr(self, entry):
        return (1 << 41) + 4 * entry

    def set_expert(self, entry, expert):
        self.experts[entry] = expert

    def copy(self, stream, entry, dst, src_host, nbytes):
        self.copies.append((entry, stream.name, nbytes))

    def upload(self, stream):
        self.uploaded = True

    def free(self):
        pass


@pytest.mark.parametrize("chains", [1, 4])
def test_cuda_executor_switches_routed_copies_only_inside_a_capture(fake, monkeypatch,
                                                                    chains) -> None:
    """The CUDA executor on the recording runtime: the first (plain) run of a routed walk copies
    every entry and launches no switch kernel; the capture turns each routed Copy into a
    switched copy on its copy stream (entry k on COPY_CHAINS[k % chains]) and each RouteCopies
    into one route_copies launch on the compute stream over its layer's consecutive entries;
    the table is uploaded and held by the graph, which the third run replays."""
    from strata_rt.backends.cuda.experts import routed_walk
    from strata_rt.config.settings.engine_config import EngineConfig
    from strata_rt.weights.model import SMALL_SPEC, Model

    made: list[_RecordedSwitches] = []
    monkeypatch.setattr(routed_walk, "CopySwitches",
                        lambda *a: made.append(_RecordedSwitches(*a)) or made[-1])
    monkeypatch.setattr(routed_walk, "conditional_copies_supported", lambda: True)
    monkeypatch.setenv("STRATA_PREFILL_STREAM", "routed_walk")
    monkeypatch.setenv("STRATA_COPY_CHAINS", str(chains))
    moe = Model.synthetic(SMALL_SPEC, 3)
    spec = moe.spec
    cfg = EngineConfig(model=moe, backend="cuda", expert_cache=spec.total_experts // 2,
                       check_plan=True, timing=False)
    streamed = spec.total_experts - spec.total_experts // 2
    with Engine.open(cfg) as eng:
        rt = fake["rt"]
        rt.tokens = 300
        h = np.ones((300, spec.hidden), np.float32)
        copies = rt.copies
        eng.prefill(h)
        assert eng.driver.last_plan.mode == "routed_walk" and not made
        assert "route_copies" not in rt.launches
        assert rt.copies - copies >= streamed  # every entry copied plainly
        rt.launched_on.clear()
        copies = rt.copies
        eng.prefill(h)  # captured
        (sw,) = made
        assert sw.uploaded and sw.n == streamed
        assert sorted(e for e, _, _ in sw.copies) == list(range(streamed))
        assert all(stream == COPY_CHAINS[e % chains] for e, stream, _ in sw.copies)
        assert {stream for _, stream, _ in sw.copies} == set(COPY_CHAINS[:chains])
        assert len(sw.experts) == streamed
        switch = [(s, args) for name, s, args in rt.launched_on if name == "route_copies"]
        assert len(switch) == spec.n_layers and {s for s, _ in switch} == {"compute"}
        assert sum(args[3] for _, args in switch) == streamed
        rt.launches.clear()
        eng.prefill(h)
        assert rt.launches == ["graph"]


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_switched_copies_land_only_where_the_routing_says(rt, rng) -> None:
    """A captured graph of route_copies and 12 switched copies into a poisoned buffer, replayed
    under three routings: exactly the copies of experts with rows land, the rest stay poison,
    and a fresh replay switches again (no switch keeps the last launch's value)."""
    from _device_buffers import download, poisoned, upload

    from strata_rt.backends.cuda.experts.routed_walk import RoutedWalkCopies
    from strata_rt.runtime.conditional import conditional_copies_supported

    if not conditional_copies_supported():
        pytest.skip("the driver has no conditional graph nodes")
    n, size, n_experts = 12, 4096, 16
    experts = rng.choice(n_experts, n, replace=False)
    host = rt.pinned({"src": n * size})
    src = host.view("src", np.uint8)
    src[:] = rng.integers(0, 256, n * size, dtype=np.uint8)
    stream = rt.stream("test compute")
    bounds_host = np.zeros(n_experts + 1, np.int32)
    bounds = upload(rt, stream, bounds_host)
    dst = poisoned(rt, stream, n * size)
    copies = RoutedWalkCopies(rt, rt.stream("test side"))
    op = RouteCopies(0, tuple((k, int(e)) for k, e in enumerate(experts)))
    ops = [op] + [Copy(k, 0, int(e), k, routed=True) for k, e in enumerate(experts)]
    copies.prepare(ops)
    with rt.capture(stream) as graph:
        copies.route(op, stream, bounds.ptr)
        for k in range(n):
            assert copies.copy(ops[k + 1], stream, dst.ptr + k * size,
                               src.ctypes.data + k * size, size)
    copies.finish(graph, stream)
    for share in (0.5, 0.0, 1.0):
        counts = (rng.random(n_experts) < share).astype(np.int32) * rng.integers(1, 5, n_experts)
        bounds_host[1:] = np.cumsum(counts)
        rt.memcpy_htod(bounds.ptr, bounds_host, stream)
        rt.memset_d8(dst.ptr, 0xFF, n * size, stream)
        graph.launch(stream)
        got = download(rt, stream, dst, np.uint8, (n, size))
        on = counts[experts] > 0
        assert np.array_equal(got[on], src.reshape(n, size)[on])
        assert (got[~on] == 0xFF).all()
    graph.free()


@pytest.mark.gpu
@pytest.mark.parametrize("dense", ["resident", "stream"])
def test_cuda_routed_walk_equals_the_walk(monkeypatch, rng, dense) -> None:
    """On the GPU, one prompt three times (plain, then captured with switched copies, then the
    faster): the routed walk's logits equal the walk's byte for byte, its capture succeeded, and
    it streams fewer bytes than the walk copies."""
    spec = Qwen3Spec(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                     ffn=256, n_experts=32, top_k=4, context=512)  # a head the GPU kernels have
    gpu_model = Qwen3Model.synthetic(spec, 6, "iq3_xxs")
    ids = rng.integers(0, spec.vocab, 12)  # few enough that some expert goes unrouted
    walk, _ = _prefill(gpu_model, ids, "walk", monkeypatch, "cuda", 3, dense=dense)
    routed, walk_bytes = _prefill(gpu_model, ids, "routed_walk", monkeypatch, "cuda", 3,
                                  dense=dense)
    for (lw, sw, mw, _), (lr, sr, mr, _) in zip(walk, routed):
        assert (mw, mr) == ("walk", "routed_walk")
        assert lr.tobytes() == lw.tobytes()
        assert 0 < sr.bytes_streamed < sw.bytes_streamed == walk_bytes
    (trial,) = [t for key, t in routed[-1][3].items() if key[1] == "routed_walk"]
    assert "graph" in trial and "error" not in trial, trial
