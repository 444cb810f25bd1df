"""The decode step's split attention (kernels/model/attention_decode.cu): one query row per
head over the KV cache, split over the cache length and merged, against the float64 twin."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.attention.decode import DECODE_SOURCE, DECODE_WARPS, DecodeAttention
from strata_rt.backends.cuda.attention.kernels import AttentionKernels, attention_reference
from strata_rt.backends.cuda.attention.shapes import (
    DECODE_GROUPS,
    check_decode_shape,
    decode_part_bytes,
)
from strata_rt.errors import ConfigError
from strata_rt.formats.numerics import nmse

gpu = pytest.mark.gpu

#: NMSE against the float64 twin (fp16 out, float32 probabilities)
NMSE_BOUND = 1e-5
#: (n_heads, n_kv_heads, head_dim): the tiny model, Qwen3-30B and Qwen3-235B layouts, hd 64
LAYOUTS = [(4, 2, 64), (8, 1, 64), (32, 4, 128), (64, 4, 128), (4, 4, 128)]


# ============================================================================ CPU
def test_every_group_and_head_dim_has_its_kernels():
    text = DECODE_SOURCE.read_text()
    assert f"#define DEC_WARPS {DECODE_WARPS}\n" in text
    for hd in (64, 128):
        assert f"DECODE_MERGE_KERNEL({hd})" in text
        for g in DECODE_GROUPS:
            assert f"DECODE_SPLIT_KERNEL({hd}, {g})" in text
    # the launchers' argument strings follow the kernels' parameter lists
    split = re.search(r"decode_split_hd##HD##_g##G\((.*?)\)\s*\{", text, re.S)
    assert split is not None and split.group(1).count(",") + 1 == len("PPPPiifP")


def test_shape_check_names_every_problem():
    with pytest.raises(ConfigError) as e:
        check_decode_shape(24, 8, 96, 0)
    text = str(e.value)
    assert "head_dim=96" in text and "splits=0" in text
    with pytest.raises(ConfigError, match="group=3"):
        check_decode_shape(12, 4, 128, 32)
    check_decode_shape(64, 4, 128, 32)
    assert decode_part_bytes(32, 128, 32) == 32 * 32 * 130 * 4


def test_launches_grids_and_arguments_without_a_gpu():
    """A decode step's two launches: the split over (KV heads, splits) blocks of DECODE_WARPS
    warps with the position and the device position, then the merge per head; addresses the
    vector loads cannot take and positions past the cache are refused before a launch."""
    from strata_rt.formats.testing_abi import Recorder

    rt = Recorder()
    dec = DecodeAttention(rt, 32, 4, 128, context=1024)
    dec.attend(None, q=0x1000, k_cache=0x2000, v_cache=0x3000, start=300, part=0x4000,
               out=0x5004, start_dev=0x6000)
    (n1, g1, b1, _, a1), (n2, g2, b2, _, a2) = rt.calls
    assert (n1, g1, b1) == ("decode_split_hd128_g8", (4, 32, 1), (32 * DECODE_WARPS, 1, 1))
    assert a1[:6] == (0x1000, 0x2000, 0x3000, 0x4000, 300, 4) and a1[7] == 0x6000
    assert (n2, g2, b2) == ("decode_merge_hd128", (32, 1, 1), (128, 1, 1))
    assert a2 == (0x4000, 32, a1[6], 0x5004)
    with pytest.raises(ConfigError, match="part = 16392"):
        dec.attend(None, q=0x1000, k_cache=0x2000, v_cache=0x3000, start=3, part=0x4008,
                   out=0x5000)
    with pytest.raises(ConfigError, match="out = 20482"):
        dec.attend(None, q=0x1000, k_cache=0x2000, v_cache=0x3000, start=3, part=0x4000,
                   out=0x5002)
    with pytest.raises(ConfigError, match="holds 1024 positions"):
        dec.attend(None, q=0x1000, k_cache=0x2000, v_cache=0x3000, start=1024, part=0x4000,
                   out=0x5000)
    assert len(rt.calls) == 2


# ============================================================================ GPU
@pytest.fixture
def stream(rt):
    return rt.stream("decode attention test")


def _case(rt, s, rng, layout, start, ctx):
    n_heads, n_kv, hd = layout
    q = (rng.standard_normal((1, n_heads, hd)) * 1.5).astype(np.float16)
    keys = (rng.standard_normal((start + 1, n_kv, hd)) * 1.5).astype(np.float16)
    vals = rng.standard_normal((start + 1, n_kv, hd)).astype(np.float16)
    caches = []
    for rows in (keys, vals):  # rows past `start` stay poisoned (fp16 NaN): never read
        buf = poisoned(rt, s, ctx * n_kv * hd * 2)
        rt.memcpy_htod(buf.ptr, np.ascontiguousarray(rows), s)
        caches.append(buf)
    return q, keys, vals, upload(rt, s, q), caches


def _attend(rt, s, kern, dq, dk, dv, start, start_dev=0):
    part = poisoned(rt, s, kern.part_bytes)
    out = poisoned(rt, s, kern.n_heads * kern.head_dim * 2)
    kern.attend(s, q=dq.ptr, k_cache=dk.ptr, v_cache=dv.ptr, start=start, part=part.ptr,
                out=out.ptr, start_dev=start_dev)
    return download(rt, s, out, np.float16, (1, kern.n_heads * kern.head_dim))


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("start", [0, 1, 6, 127, 511, 4100])
@pytest.mark.parametrize("splits", [1, 7, 32])
def test_decode_attention_matches_the_twin(rt, stream, rng, layout, start, splits):
    """Splits with no rows (start + 1 < splits), one row each, and many rows each."""
    s, ctx = stream, start + 9
    kern = DecodeAttention(rt, *layout, splits=splits, context=ctx)
    q, keys, vals, dq, (dk, dv) = _case(rt, s, rng, layout, start, ctx)
    got = _attend(rt, s, kern, dq, dk, dv, start)
    assert np.isfinite(got).all()
    err = nmse(got, attention_reference(q, keys, vals, start))
    assert err <= NMSE_BOUND, f"NMSE {err:.2e}"


@gpu
@pytest.mark.parametrize("layout", LAYOUTS[1:4])
def test_position_from_the_device_gives_the_same_bytes_and_runs_repeat(rt, stream, rng,
                                                                       layout):
    s, start = stream, 300
    kern = DecodeAttention(rt, *layout, context=start + 1)
    _, _, _, dq, (dk, dv) = _case(rt, s, rng, layout, start, start + 1)
    pos = upload(rt, s, np.array([start], np.int32))
    a = _attend(rt, s, kern, dq, dk, dv, start)
    b = _attend(rt, s, kern, dq, dk, dv, 0, start_dev=pos.ptr)
    c = _attend(rt, s, kern, dq, dk, dv, start)
    assert a.tobytes() == b.tobytes() == c.tobytes()


@gpu
@pytest.mark.parametrize("layout", [(32, 4, 128), (64, 4, 128)])
def test_decode_attention_agrees_with_the_prefill_kernel(rt, stream, rng, layout):
    """The same query through attend_hd* (fp16 probabilities): within fp16 rounding."""
    s, start = stream, 700
    n_heads, n_kv, hd = layout
    q, keys, vals, dq, (dk, dv) = _case(rt, s, rng, layout, start, start + 1)
    got = _attend(rt, s, DecodeAttention(rt, *layout, context=start + 1), dq, dk, dv, start)
    out = poisoned(rt, s, n_heads * hd * 2)
    AttentionKernels(rt, n_heads, n_kv, hd, context=start + 1).attend(
        s, dq.ptr, dk.ptr, dv.ptr, start, 1, out.ptr)
    prefill = download(rt, s, out, np.float16, (1, n_heads * hd))
    assert nmse(got, prefill) <= 2 * NMSE_BOUND


def test_a_whole_model_sizes_the_split_parts_only_where_its_kernels_exist():
    """The arena's decode_part region holds every head's parts for the split layouts (the
    30B layout: 32 heads over 4 KV heads) and nothing for a group without kernels (3)."""
    from dataclasses import replace

    from strata_rt.models.qwen3 import TINY_SPEC
    from strata_rt.models.qwen3.whole_memory import DenseTypes, WholeSizing, whole_fixed_regions

    types = DenseTypes.uniform(TINY_SPEC.n_layers, "F16")
    for heads, kv, want in ((32, 4, decode_part_bytes(32, 128)), (12, 4, 0)):
        spec = replace(TINY_SPEC, n_heads=heads, n_kv_heads=kv, head_dim=128)
        assert whole_fixed_regions(WholeSizing(spec, types, 64))["decode_part"] == want
