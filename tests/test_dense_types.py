"""The dense part in its GGUF types, without a GPU (strata_rt/models/qwen3/whole_memory.py,
strata_rt/backends/cuda/whole.py, strata_rt/backends/cuda/dense/decode.py): slot layouts and
sizes per type, layers of different types, the fp16 scratch, the memory plan, the types read
from a file's header, and the slot images decoded by the gather's numpy twin into exactly the
fp16 matrices the fp16 slot held. On a GPU: tests/test_dense_types_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from _dense_models import MATRICES, TYPES, dense_model, fp16_images, uniform
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata_rt.backends.cuda.dense.decode import head_slices
from strata_rt.backends.cuda.dense.slots import dense_slot_bytes
from strata_rt.formats.registry import registry
from strata_rt.gemm.ggml_gather import images_reference
from strata_rt.models.qwen3 import Qwen3Spec, write_qwen3_gguf
from strata_rt.models.qwen3.gguf_full import read_dense_types
from strata_rt.models.qwen3.whole_memory import (
    HEAD_SLICE_ROWS,
    DenseLayout,
    DenseSlot,
    DenseTypes,
    LayerTypes,
    WholeSizing,
    tensor_bytes,
    whole_fixed_regions,
)
from strata_rt.schedule.planners.dense_schedule import DENSE_RING_SLOTS
from strata_rt.schedule.vram.memory_plan import plan_memory

SPEC = Qwen3Spec(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=300,
                 ffn=128, n_experts=4, top_k=2, context=256)
#: the three layer kinds of a Q4_K_M file: v in Q6_K on some layers, the rest Q4_K
Q4_K_M = [dict.fromkeys(MATRICES, "Q4_K"), {**dict.fromkeys(MATRICES, "Q4_K"), "attn_v": "Q6_K"},
          {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "BF16", "attn_output": "F32"}]
#: the Qwen3-30B-A3B shape
A3B = Qwen3Spec(n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                vocab=151936, ffn=768, n_experts=128, top_k=8, context=40960)


def _bytes(type_name: str, rows: int, cols: int) -> int:
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return rows * cols // values * nbytes


@pytest.mark.parametrize("t", TYPES)
def test_slot_holds_the_file_bytes_of_each_type(t: str) -> None:
    s = DenseSlot.of(SPEC, LayerTypes(t, t, t, t))
    H, q, kv, hd = SPEC.hidden, SPEC.q_dim, SPEC.kv_dim, SPEC.head_dim
    assert (s.q, s.k, s.v) == (0, _bytes(t, q, H), _bytes(t, q, H) + _bytes(t, kv, H))
    assert s.o == -(-(s.v + _bytes(t, kv, H)) // 256) * 256
    assert [s.attn_norm, s.q_norm, s.k_norm] == sorted([s.attn_norm, s.q_norm, s.k_norm])
    assert all(o % 256 == 0 for o in (s.o, s.attn_norm, s.q_norm, s.k_norm, s.nbytes))
    assert s.attn_norm >= s.o + _bytes(t, H, q) and s.q_norm >= s.attn_norm + 4 * H
    assert s.nbytes - 256 < s.k_norm + 4 * hd <= s.nbytes
    assert s.qkv_direct == s.o_direct == (t == "F16")
    assert tensor_bytes(t, q, H) == _bytes(t, q, H)


def test_layers_of_different_types_and_the_scratch() -> None:
    model = dense_model(SPEC, 1, Q4_K_M, "Q6_K")
    types = DenseTypes.of_model(model)
    assert types.layers[1] == LayerTypes("Q4_K", "Q4_K", "Q6_K", "Q4_K") and types.head == "Q6_K"
    lay = DenseLayout.of(SPEC, types)
    sizes = [s.nbytes for s in lay.slots]
    assert len(set(sizes)) == 3 and lay.slot_bytes == max(sizes)
    assert [lay.resident_offset(i) for i in range(3)] == [0, sizes[0], sizes[0] + sizes[1]]
    assert lay.resident_bytes == sum(sizes)
    H = SPEC.hidden
    wqkv = (SPEC.q_dim + 2 * SPEC.kv_dim) * H * 2
    assert lay.scratch_bytes(SPEC) == max(wqkv, SPEC.vocab * H * 2)
    f16 = DenseLayout.of(SPEC, DenseTypes.uniform(3, "F16"))
    assert f16.scratch_bytes(SPEC) == 0 and f16.head_direct  # read in place, nothing decoded
    only_o = DenseTypes((LayerTypes("F16", "F16", "F16", "Q8_0"),) * 3, "F16")
    assert DenseLayout.of(SPEC, only_o).scratch_bytes(SPEC) == H * SPEC.q_dim * 2
    big = DenseLayout.of(A3B, DenseTypes.uniform(A3B.n_layers, "Q6_K"))
    assert big.scratch_bytes(A3B) == HEAD_SLICE_ROWS * A3B.hidden * 2  # a slice, not the head


def test_fixed_regions_and_the_memory_plan_count_the_stored_bytes() -> None:
    model = dense_model(SPEC, 2, Q4_K_M, "Q6_K")
    types = DenseTypes.of_model(model)
    lay = DenseLayout.of(SPEC, types)
    w = WholeSizing(SPEC, types, 128)
    fixed = whole_fixed_regions(w)
    assert fixed["dense"] == lay.resident_bytes
    assert fixed["head"] == _bytes("Q6_K", SPEC.vocab, SPEC.hidden) == model.output_weight.nbytes
    assert fixed["dense_scratch"] == lay.scratch_bytes(SPEC)
    assert whole_fixed_regions(w.streamed())["dense"] == DENSE_RING_SLOTS * lay.slot_bytes
    spec = SPEC.moe_spec("fp16")
    fmt = registry()["fp16"]
    lay_e = fmt.layout(spec.hidden, spec.ffn)
    plan = plan_memory(spec, lay_e, fmt.activation, 1 << 40, 8, 64, 0, whole=w)
    for name in ("dense", "head", "dense_scratch"):
        assert plan.regions[name] == fixed[name]
    assert lay.resident_bytes + fixed["head"] < sum(t.nbytes for _, t in model.named_roles())


def test_a3b_shape_in_q4_k_and_q6_k_saves_most_of_the_fp16_dense_part() -> None:
    """Qwen3-30B-A3B: what the dense slots and the head take in VRAM per type, against the
    fp16 slots and head they replace (the fp16 scratch included)."""
    def on_gpu(t: str) -> int:
        r = whole_fixed_regions(WholeSizing(A3B, DenseTypes.uniform(A3B.n_layers, t), 4096))
        return r["dense"] + r["head"] + r["dense_scratch"]

    L, H = A3B.n_layers, A3B.hidden
    fp16 = on_gpu("F16")
    per_layer = (A3B.q_dim + 2 * A3B.kv_dim) * H * 2 + H * A3B.q_dim * 2
    assert fp16 >= L * per_layer + A3B.vocab * H * 2
    for t, bits in (("Q4_K", 4.5), ("Q6_K", 6.5625)):
        stored = L * per_layer * bits / 16 + A3B.vocab * H * bits / 8
        scratch = HEAD_SLICE_ROWS * H * 2
        assert 0 <= on_gpu(t) - stored - scratch < L * 16384, t  # + norms and alignment
        assert fp16 - on_gpu(t) > 1 << 30, t


@pytest.mark.parametrize("t", TYPES)
def test_slot_images_decode_to_the_fp16_matrices(t: str) -> None:
    """The gather's numpy twin over the slot image's q, k, v and o bytes gives the fp16
    Wqkv and Wo the fp16 slot held, bit for bit; the head in slices gives its fp16 rows."""
    model = uniform(SPEC, 3, t)
    lay = DenseLayout.of(SPEC, DenseTypes.of_model(model))
    H = SPEC.hidden
    for layer, slot in enumerate(lay.slots):
        image = dense_slot_bytes(model, layer, slot)
        assert image.size == slot.nbytes
        parts = [(slot.q, slot.k, SPEC.q_dim), (slot.k, slot.v, SPEC.kv_dim),
                 (slot.v, slot.v + _bytes(t, SPEC.kv_dim, H), SPEC.kv_dim)]
        got = np.concatenate([images_reference(t, image[a:b], rows, H) for a, b, rows in parts])
        o = images_reference(t, image[slot.o: slot.o + _bytes(t, H, SPEC.q_dim)], H, SPEC.q_dim)
        want_qkv, want_o = fp16_images(model.dense.layers[layer])
        assert got.view(np.uint16).tobytes() == want_qkv.view(np.uint16).tobytes()
        assert o.view(np.uint16).tobytes() == want_o.view(np.uint16).tobytes()
        norms = image[slot.attn_norm: slot.attn_norm + 4 * H].view(np.float32)
        assert np.array_equal(norms, model.dense.layers[layer].attn_norm.f32())
    head = model.output_weight
    raw = np.ascontiguousarray(head.data).view(np.uint8).reshape(-1)
    row = _bytes(t, 1, H)
    slices = [(0, 128), (128, 128), (256, 44)]
    decoded = np.concatenate([images_reference(t, raw[v0 * row:(v0 + n) * row], n, H)
                              for v0, n in slices])
    assert decoded.tobytes() == head.f32().astype(np.float16).tobytes()


def test_head_slices() -> None:
    assert head_slices(300, True) == [(0, 300)]
    assert head_slices(300, False) == [(0, 300)]
    V = 2 * HEAD_SLICE_ROWS + 5
    assert head_slices(V, False) == [(0, HEAD_SLICE_ROWS), (HEAD_SLICE_ROWS, HEAD_SLICE_ROWS),
                                     (2 * HEAD_SLICE_ROWS, 5)]
    assert head_slices(V, True) == [(0, V)]


@pytest.mark.parametrize("tied", [False, True])
def test_types_read_from_a_file_header(tmp_path, tied: bool) -> None:
    model = dense_model(SPEC, 4, Q4_K_M, "Q8_0", tied=tied)
    path = write_qwen3_gguf(tmp_path / "mix.gguf", model)
    types = read_dense_types(path)
    assert types == DenseTypes.of_model(model)
    assert types.head == "Q8_0" and types.layers[2].o == "F32"
