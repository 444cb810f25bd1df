"""The expert store filled on several threads holds the bytes a one-thread fill writes: random
pools gathered through an index (host_copy.gather_rows, the synthetic models' path) and the
layers of GGUF fixtures (run_each, the file's path), with failures raised as a loop would."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from strata_rt.errors import GGUFError
from strata_rt.host import host_copy
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore
from strata_rt.weights.whole_model import load_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ggml_mixes"


@pytest.fixture
def threads(monkeypatch):
    """Five threads, no size threshold, small tasks: every fill below is split many ways."""
    monkeypatch.setattr(host_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(host_copy, "_workers", lambda: 5)
    monkeypatch.setattr(host_copy, "GATHER_TASK_BYTES", 3000)
    return 5


def _serial(monkeypatch):
    monkeypatch.setattr(host_copy, "_workers", lambda: 1)


@pytest.mark.parametrize("rows,width,pad", [(1, 1, 0), (37, 100, 3), (500, 7, 9),
                                             (64, 4096, 256), (9, 20_000, 0)])
def test_gather_rows_equals_the_fancy_index_copy(rng, threads, rows, width, pad):
    pool = rng.integers(0, 256, (max(1, rows // 3), width), dtype=np.uint8)
    index = rng.integers(0, pool.shape[0], rows)
    want = np.full((rows, width + pad), 0xA5, np.uint8)
    want[:, :width] = pool[index]
    got = np.full((rows, width + pad), 0xA5, np.uint8)  # the padding is left as it is
    seen: list[int] = []
    host_copy.gather_rows(got, pool, index, seen.append)
    assert got.tobytes() == want.tobytes()
    assert sum(seen) == rows
    full = rng.integers(0, 256, (rows, width), dtype=np.uint8)
    host_copy.gather_rows(got, full)  # no index: row i from row i
    assert got[:, :width].tobytes() == full.tobytes()


def test_gather_rows_copies_large_rows_one_by_one(rng, threads, monkeypatch):
    monkeypatch.setattr(host_copy, "GATHER_STEP_BYTES", 64)  # rows of 300 bytes: one at a time
    pool = rng.integers(0, 256, (4, 300), dtype=np.uint8)
    index = rng.integers(0, 4, 50)
    got = np.zeros((50, 301), np.uint8)
    host_copy.gather_rows(got, pool, index)
    assert got[:, :300].tobytes() == pool[index].tobytes() and not got[:, 300].any()


def test_gather_rows_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="gather_rows"):
        host_copy.gather_rows(np.zeros((3, 4), np.uint8), np.zeros((2, 5), np.uint8), [0, 1, 1])
    with pytest.raises(ValueError, match="gather_rows"):
        host_copy.gather_rows(np.zeros((3, 4), np.uint8), np.zeros((2, 4), np.uint8))


def test_run_each_raises_the_first_failure_in_order(threads):
    done, where = [], set()

    def fn(i: int) -> None:
        where.add(threading.current_thread().name)
        if i in (13, 40):
            raise KeyError(i)

    with pytest.raises(KeyError) as info:
        host_copy.run_each(fn, list(range(60)), done.append)
    assert info.value.args == (13,)
    assert 13 not in done and set(done) <= set(range(60)) - {13, 40}
    host_copy.run_each(fn, list(range(13)), done.append)
    assert all(name.startswith("strata-host") for name in where)


@pytest.mark.parametrize("pool_bytes", [5 * 40_000, 1 << 30], ids=["tiled", "distinct"])
def test_a_synthetic_store_is_the_serial_store(monkeypatch, threads, pool_bytes):
    model = Model.synthetic(MoESpec(n_layers=5, hidden=256, ffn=256, n_experts=16, top_k=2), 3,
                            pool_bytes=pool_bytes)
    assert (model.experts.index is not None) == (pool_bytes < 1 << 30)
    threaded = ExpertStore(model).arena.copy()
    _serial(monkeypatch)
    serial = ExpertStore(model).arena
    assert threaded.tobytes() == serial.tobytes()
    # and both are the layer-by-layer copy, padding zero
    grid = np.full((5, 16, model.layout.slot_bytes), 0xFF, np.uint8)
    for layer in range(5):
        model.write_layer(layer, grid[layer])
    grid[:, :, model.layout.blob_bytes:] = 0
    assert threaded.tobytes() == grid.tobytes()


@pytest.mark.parametrize("name", ["IQ3_XXS-imatrix", "Q4_K_M", "Q4_K-down_exps_Q6_K"])
def test_a_gguf_store_is_the_serial_store(monkeypatch, threads, name):
    model, _ = load_model({"gguf": str(FIXTURES / f"{name}.gguf")})
    threaded = ExpertStore(model).arena.copy()
    _serial(monkeypatch)
    serial = ExpertStore(model).arena
    assert threaded.tobytes() == serial.tobytes()
    for layer in range(model.spec.n_layers):
        for e in range(model.spec.n_experts):
            n = model.formats.layout(layer).blob_bytes
            o = (layer * model.spec.n_experts + e) * model.layout.slot_bytes
            assert threaded[o: o + n].tobytes() == model.expert_blob(layer, e)[:n].tobytes()


def test_a_bad_gguf_layer_fails_as_it_does_in_order(monkeypatch, threads, tmp_path):
    """NaN in the scales of layers 1 and 2: the threaded fill names layer 1, as a loop does."""
    from strata_rt.weights.gguf_file.gguf_io import write_moe_gguf

    spec = MoESpec(n_layers=3, hidden=256, ffn=256, n_experts=4, top_k=2)
    model = Model.synthetic(spec, 2, "q8_0")
    blobs = model.blobs.copy()
    nan = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    for layer in (1, 2):
        blobs[layer, 0, :2] = nan  # the first block's f16 scale of gate row 0
    bad = Model(spec, model.fmt, model.router, model.norm, blobs)
    path = write_moe_gguf(tmp_path / "bad.gguf", bad)
    messages = []
    for serial in (False, True):
        if serial:
            _serial(monkeypatch)
        with pytest.raises(GGUFError) as info:
            ExpertStore(Model.from_gguf(path, "q8_0"))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "blk.1." in messages[0]
    assert "blk.2." not in messages[0]
