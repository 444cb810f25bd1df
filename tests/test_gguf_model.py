"""GGUF loading: a round trip through GGUFWriter, one error per kind of bad file, conversion on
several processes (bytes equal to one process's), and the host memory a load takes."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import quantize as gguf_quantize

from strata_rt.errors import GGUFError
from strata_rt.formats.registry import registry
from strata_rt.report.eta import Eta, format_seconds
from strata_rt.weights.gguf_file.gguf_io import tensor_names, write_moe_gguf
from strata_rt.weights.model import Model, MoESpec
from strata_rt.weights.store import ExpertStore

SPEC = MoESpec(n_layers=2, hidden=256, ffn=256, n_experts=4, top_k=2, rms_eps=1e-5)
Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.synthetic(SPEC, 11)


@pytest.fixture(scope="module")
def good(tmp_path_factory, model):
    return write_moe_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", model)


def test_round_trip_is_exact(good, model):
    back = Model.from_gguf(good, "iq3_xxs")
    assert back.spec == SPEC
    assert np.array_equal(back.blobs, model.blobs)
    assert np.array_equal(back.router, model.router)
    assert np.array_equal(back.norm, model.norm)


def test_experts_stay_in_the_file_until_the_store_is_built(good, model):
    back = Model.from_gguf(good, "iq3_xxs")
    assert not hasattr(back.experts, "full")          # no array of all experts was made
    store = ExpertStore(back)
    for layer in range(2):
        for e in range(4):
            assert np.array_equal(store.view(layer, e), model.expert_blob(layer, e))
            assert np.array_equal(back.expert_blob(layer, e), model.expert_blob(layer, e))
    sub = back.slice_layers(1, 2)
    out = np.zeros((4, back.layout.blob_bytes + 5), np.uint8)
    sub.write_layer(0, out)
    assert np.array_equal(out[:, :-5], model.blobs[1]) and (out[:, -5:] == 0).all()


def test_round_trip_fp16_raw(tmp_path):
    fmt = registry()["fp16"]
    m = Model.synthetic(MoESpec(1, 128, 128, 2, 1, format="fp16"), 3, fmt)
    back = Model.from_gguf(write_moe_gguf(tmp_path / "f.gguf", m), "fp16")
    assert np.array_equal(back.blobs, m.blobs)


def test_load_into_another_format_converts(good, model, caplog):
    """IQ3_XXS tensors loaded as fp16 are dequantized (exactly representable in fp16), and the
    conversion is said once for the file, not once per layer."""
    caplog.set_level(logging.WARNING, logger="strata_rt.weights.convert")
    back = Model.from_gguf(good, "fp16")
    ExpertStore(back)
    ExpertStore(back)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "IQ3_XXS" in said[0] and "through float" in said[0], said
    caplog.clear()
    ExpertStore(Model.from_gguf(good, "iq3_xxs"))
    assert caplog.records == []  # raw bytes copied: nothing to say
    for e in (0, 3):
        want = model.dequantized(1, e)
        got = back.dequantized(1, e)
        for w, g in zip(want, got):
            assert np.allclose(g, w, rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------- conversion
def _mixed_file(tmp_path, n_experts: int, hidden: int = 256, ffn: int = 256,
                fmt: str = "iq3_xxs"):
    """Layer 0 as `fmt` writes it (IQ3_XXS: copied raw when loading as iq3_xxs); layer 1 with
    gate in F16, up in BF16 and down in Q8_0 (converted)."""
    m = Model.synthetic(MoESpec(2, hidden, ffn, n_experts, 1), 4, fmt)
    rng = np.random.default_rng(9)
    gate = rng.standard_normal((n_experts, ffn, hidden), np.float32) * hidden ** -0.5
    up = rng.standard_normal((n_experts, ffn, hidden), np.float32) * hidden ** -0.5
    down = rng.standard_normal((n_experts, hidden, ffn), np.float32) * ffn ** -0.5
    names = tensor_names(1)
    return write_moe_gguf(tmp_path / "mixed.gguf", m, tensors={
        names["gate"]: (gate.astype(np.float16), None),
        names["up"]: (gguf_quantize(up, Q.BF16), Q.BF16),
        names["down"]: (gguf_quantize(down, Q.Q8_0), Q.Q8_0)})


def _one_process(path, fmt_name: str) -> np.ndarray:
    """The conversion as one process does it: the format's pack_gguf_experts over whole
    layers of the gguf reader's tensors."""
    fmt = registry()[fmt_name]
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    names = tensor_names(1)
    return fmt.pack_gguf_experts(*(tensors[names[p]] for p in ("gate", "up", "down")))


def test_conversion_on_workers_is_byte_identical(tmp_path):
    path = _mixed_file(tmp_path, n_experts=2)
    back = Model.from_gguf(path, "iq3_xxs", workers=2)
    grid = np.empty((2, 2, back.layout.blob_bytes), np.uint8)
    back.write_layers(grid)
    assert np.array_equal(grid[1], _one_process(path, "iq3_xxs"))
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    want0 = np.concatenate([np.asarray(raw[tensor_names(0)[p]].data).reshape(2, -1)
                            for p in ("gate", "up", "down")], axis=1)
    assert np.array_equal(grid[0], want0)  # the IQ3_XXS layer is the file's bytes


def test_many_tasks_and_one_process_agree(tmp_path, monkeypatch):
    """Several tasks per worker (more than are in flight at once) and the in-process path."""
    from strata_rt.weights import convert

    monkeypatch.setattr(convert, "TASK_WEIGHTS", 3 * 128 * 128)  # one expert per task
    path = _mixed_file(tmp_path, n_experts=8, hidden=128, ffn=128, fmt="q2_blob")
    pooled = Model.from_gguf(path, "q2_blob", workers=2)
    here = Model.from_gguf(path, "q2_blob", workers=1)
    a = np.empty((2, 8, pooled.layout.blob_bytes), np.uint8)
    plan = pooled.experts._plan([(s, a[i]) for i, s in enumerate(pooled.experts.sources)], 2)
    assert len(plan) > 2 * 2  # more tasks than the in-flight window of 2 workers x 2
    pooled.write_layers(a)
    b = here.blobs
    assert np.array_equal(a, b)
    assert np.array_equal(a[1], _one_process(path, "q2_blob"))


def test_eta_line_and_summary():
    out = io.StringIO()
    eta = Eta("convert", 100, "experts", stream=out, delay_s=0, log_interval_s=0)
    eta.t0 -= 10  # as if 10 s had passed
    eta.advance(25)
    eta.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("convert: 25/100 experts (25%)") and "left" in lines[0]
    assert "30 s left" in lines[0] or "29 s left" in lines[0] or "31 s left" in lines[0]
    assert lines[-1].startswith("convert: 25 experts in 10 s")
    quiet = io.StringIO()
    eta = Eta("x", 5, "experts", stream=quiet, delay_s=60)
    eta.advance(5)
    eta.close()
    assert quiet.getvalue() == ""  # short work shows nothing
    assert (format_seconds(59), format_seconds(61), format_seconds(3725)) == \
        ("59 s", "1m 01s", "1h 02m")


# ---------------------------------------------------------------------------- memory
PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    from strata_rt.weights.model import Model
    from strata_rt.weights.store import ExpertStore

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    model = Model.from_gguf(sys.argv[1], "iq3_xxs")
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # restart VmHWM from here
        f.write("5")
    store = ExpertStore(model)
    print(json.dumps({"base": base, "peak": status("VmHWM"), "store": store.nbytes}))
""")


def test_load_peak_is_the_store_plus_about_one_layer(tmp_path):
    """Experts go from the file's memory map into the store a layer at a time: host memory
    grows by the store plus about one layer of the file, not by twice the experts."""
    spec = MoESpec(n_layers=8, hidden=512, ffn=512, n_experts=16, top_k=2)
    m = Model.synthetic(spec, 2)
    path = write_moe_gguf(tmp_path / "big.gguf", m)
    layer_bytes = spec.n_experts * m.layout.blob_bytes
    del m
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True,
                          text=True, timeout=120)
    if "clear_refs" in done.stderr:
        pytest.skip("this kernel does not let a process reset its VmHWM")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    grown = r["peak"] - r["base"]
    assert r["store"] == 128 * m_slot(spec)
    # the store, one layer of mapped file pages and a few MiB of numpy temporaries
    assert grown <= r["store"] + layer_bytes + (4 << 20), (grown, r)
    assert grown < 1.3 * r["store"], (grown, r)   # the old load held every expert twice


def m_slot(spec: MoESpec) -> int:
    return registry()["iq3_xxs"].layout(spec.hidden, spec.ffn).slot_bytes


# ---------------------------------------------------------------------------- bad files
def _expect(path, model, pattern, fmt="iq3_xxs", **kw):
    write_moe_gguf(path, model, **kw)
    with pytest.raises(GGUFError, match=pattern):
        ExpertStore(Model.from_gguf(path, fmt))


def test_missing_tensor(tmp_path, model):
    _expect(tmp_path / "a.gguf", model, r"tensor blk\.1\.ffn_up_exps\.weight is missing",
            omit=["blk.1.ffn_up_exps.weight"])


def test_wrong_shape(tmp_path, model):
    bad = np.zeros((4, 256, 128), np.float32)  # down must be [4, 256, 256]
    _expect(tmp_path / "b.gguf", model,
            r"tensor blk\.0\.ffn_down_exps\.weight has shape \[4, 256, 128\]; "
            r"expected \[4, 256, 256\]",
            tensors={"blk.0.ffn_down_exps.weight": (bad, None)})


def test_unsupported_type(tmp_path, model):
    ints = np.zeros((4, 256, 256), np.int32)
    _expect(tmp_path / "c.gguf", model,
            r"tensor blk\.0\.ffn_gate_exps\.weight has type I32",
            tensors={"blk.0.ffn_gate_exps.weight": (ints, None)})


def test_unsupported_router_type(tmp_path, model):
    _expect(tmp_path / "c2.gguf", model, r"tensor blk\.1\.ffn_gate_inp\.weight has type I32",
            tensors={"blk.1.ffn_gate_inp.weight": (np.zeros((4, 256), np.int32), None)})


def test_inconsistent_expert_count(tmp_path, model):
    _expect(tmp_path / "d.gguf", model,
            r"tensor blk\.0\.ffn_gate_inp\.weight holds 4 experts but key "
            r"qwen3moe\.expert_count = 5", keys={"qwen3moe.expert_count": 5})


def test_missing_key(tmp_path, model):
    _expect(tmp_path / "e.gguf", model, r"key qwen3moe\.expert_feed_forward_length is missing",
            keys={"qwen3moe.expert_feed_forward_length": None})


def test_top_k_above_expert_count(tmp_path, model):
    _expect(tmp_path / "f.gguf", model, r"expert_used_count = 9 exceeds",
            keys={"qwen3moe.expert_used_count": 9})


def test_dims_the_format_cannot_take(tmp_path):
    m = Model.synthetic(MoESpec(1, 128, 128, 2, 1, format="fp16"), 3, registry()["fp16"])
    _expect(tmp_path / "g.gguf", m, r"do not fit format iq3_xxs", fmt="iq3_xxs")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        Model.from_gguf(p, "iq3_xxs")
    with pytest.raises(GGUFError, match="no such GGUF file"):
        Model.from_gguf(tmp_path / "nope.gguf", "iq3_xxs")


def test_expert_type_written_raw(good):
    types = {t.name: int(t.tensor_type) for t in GGUFReader(str(good)).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == GGMLQuantizationType.IQ3_XXS
    assert types["blk.0.ffn_gate_inp.weight"] == GGMLQuantizationType.F32
