"""Attention kernels of the full model (kernels/model/attention.cu, and attention_sm90.cu's
wgmma attend for head dim 128 on sm_90 devices).

CPU: the float64 twins against direct definitions, the shape check, the launch shapes and
argument lists against the kernel signatures, check-kernels' job list, and a numpy emulation
of the kernel's tile loop (online softmax over KV tiles at absolute positions, -inf masking,
alpha exactly 1 on a fully masked tile) that must match the twin and be chunk invariant.
GPU: both kernels against the twins on fresh random inputs with outputs poisoned first
(asserted bound: NMSE <= 1e-5), chunk invariance byte for byte, the same bytes on a second run;
each attend kernel (mma, and wgmma where the device runs it) on its own.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.attention import kernels as ak
from strata_rt.backends.cuda.attention.kernels import (
    ATTENTION_SM90_SOURCE,
    ATTENTION_SOURCE,
    BLOCK_ROWS,
    KV_TILE,
    AttentionKernels,
    attend_shared_bytes,
    attention_reference,
    check_attention_shape,
    pick_attention,
    qk_norm_rope_reference,
    rope_cos_sin,
    wgmma_runs,
    wgmma_shared_bytes,
)
from strata_rt.backends.cuda.attention.shapes import HEAD_DIMS
from strata_rt.errors import ConfigError
from strata_rt.formats.numerics import nmse
from strata_rt.formats.testing_abi import Recorder
from strata_rt.models.qwen3.spec import Qwen3Spec
from strata_rt.resources import KERNELS_ROOT
from strata_rt.runtime.compile import ARCH_SPECIFIC, compile_cubin, kernel_jobs, nvcc_available

gpu = pytest.mark.gpu

#: NMSE asserted against the float64 twins (fp16 outputs: measured about 1e-7)
NMSE_BOUND = 1e-5
#: (n_heads, n_kv_heads, head_dim)
LAYOUTS = [(4, 2, 64), (8, 2, 64), (32, 4, 128), (64, 4, 128)]
#: layouts only the wgmma kernel adds: group 3 (126 rows of a block), group 1 (128 positions)
WGMMA_LAYOUTS = [(6, 2, 128), (8, 8, 128)]
EPS = 1e-6
#: the attend kernels a GPU test runs (a wgmma case skips where the device cannot run it)
KERNELS = ("mma", "wgmma")


def _kernel_or_skip(rt, kernel, hd):
    if kernel == "wgmma" and not wgmma_runs(rt.arch, hd):
        pytest.skip(f"the wgmma attend runs on sm_90 with head dim 128; this is {rt.arch}, "
                    f"head dim {hd}")
    return kernel


def _spec(n_heads, n_kv, hd, context=4096):
    return Qwen3Spec(n_layers=1, hidden=256, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                     vocab=16, ffn=64, n_experts=2, top_k=1, context=context)


def _qkv(rng, T, n_heads, n_kv, hd, scale=2.0):
    return (rng.standard_normal((T, (n_heads + 2 * n_kv) * hd)) * scale).astype(np.float16)


def _norms(rng, hd):
    return ((1 + 0.3 * rng.standard_normal(hd)).astype(np.float32),
            (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32))


# ============================================================================ CPU
def test_check_kernels_compiles_the_model_kernels():
    jobs = kernel_jobs([])
    model = [p for owner, p in jobs if owner == "model"]
    assert ATTENTION_SOURCE.resolve() in model
    assert sorted(model) == sorted(p.resolve() for p in (KERNELS_ROOT / "model").glob("*.cu"))
    assert len({p for _, p in jobs}) == len(jobs)  # each source once


def test_shape_check_names_every_problem():
    for layout in LAYOUTS:
        check_attention_shape(*layout, tokens=32768, start=0, context=32768)
    check_attention_shape(48, 3, 128)  # group 16, the largest
    with pytest.raises(ConfigError) as e:
        check_attention_shape(34, 2, 96, tokens=0, start=-1)
    text = str(e.value)
    assert "group=17" in text and "head_dim=96" in text and "tokens=0" in text
    assert "start=-1" in text
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        check_attention_shape(6, 4, 64)
    with pytest.raises(ConfigError, match="holds 1000 positions"):
        check_attention_shape(4, 2, 64, tokens=10, start=995, context=1000)


def _signature(src: str, name: str) -> list[str]:
    """Argument types of the kernel macro behind `name` (e.g. attend_hd128)."""
    macro = {"attend": "ATTEND_KERNEL", "qk_norm_rope": "QK_NORM_ROPE_KERNEL"}[
        name.rsplit("_hd", 1)[0]]
    m = re.search(rf"#define {macro}\(HD\).*?##HD\((.*?)\)\s*\{{", src, re.S)
    assert m, name
    args = [a.strip() for a in m.group(1).replace("\\", " ").split(",")]
    return ["P" if "*" in a else {"int": "i", "float": "f"}[a.split()[0]] for a in args]


def test_launch_shapes_and_argument_lists_match_the_source():
    src = ATTENTION_SOURCE.read_text()
    assert re.search(r"#define AT_ROWS (\d+)", src).group(1) == str(BLOCK_ROWS)
    assert re.search(r"#define AT_KV (\d+)", src).group(1) == str(KV_TILE)
    assert re.search(r"#define AT_WARPS (\d+)", src).group(1) == str(ak.ATTEND_THREADS // 32)
    assert re.search(r"#define NR_WARPS (\d+)", src).group(1) == str(ak.NORM_ROPE_WARPS)
    for hd in HEAD_DIMS:
        assert f"ATTEND_KERNEL({hd})" in src and f"QK_NORM_ROPE_KERNEL({hd})" in src
    rt = Recorder()
    kern = AttentionKernels(rt, 32, 4, 128, context=40000)
    for name, types in rt.kernels.items():
        assert "".join(_signature(src, name)) == types, name
    kern.qk_norm_rope(None, 0x1000, 8192, 300, 0x2000, 0x3000, 0x4000, 0x5000, 1e-6, 0x6000,
                      0x7000, 0x8000)
    kern.attend(None, 0x6000, 0x7000, 0x8000, 300, 8192, 0x9000)
    (n1, g1, b1, s1, a1), (n2, g2, b2, s2, a2) = rt.calls
    assert (n1, g1, b1, s1) == ("qk_norm_rope_hd128", (8192 * 40 // 8, 1, 1), (256, 1, 1), 0)
    assert a1 == (0x1000, 8192, 300, 0x2000, 0x3000, 0x4000, 0x5000, 1e-6, 0x6000, 0x7000,
                  0x8000, 32, 4, 0)  # last: no device position register (start given)
    assert (n2, g2, b2) == ("attend_hd128", (8192 // 16, 4, 1), (128, 1, 1))
    assert s2 == attend_shared_bytes(128) == 96 * 1024
    assert a2[:8] == (0x6000, 0x7000, 0x8000, 0x9000, 8192, 300, 32, 4)
    assert a2[8] == pytest.approx(128 ** -0.5 / np.log(2), rel=1e-7) and a2[9] == 0
    kern.attend(None, 0x6000, 0x7000, 0x8000, 300, 1, 0x9000, start_dev=0xA000)
    assert rt.calls[-1][4][9] == 0xA000  # a decode step's kernels read the start from there
    # group 3: 42 positions per block, rows 126 of 128
    assert AttentionKernels(Recorder(), 6, 2, 64).attend_grid(100) == (3, 2, 1)
    with pytest.raises(ConfigError, match=r"q = 24584 \(0x6008\) is not a multiple of 16"):
        kern.attend(None, 0x6008, 0x7000, 0x8000, 0, 7, 0x9000)
    with pytest.raises(ConfigError, match="holds 40000 positions"):
        kern.attend(None, 0x6000, 0x7000, 0x8000, 39000, 1001, 0x9000)


def test_wgmma_launch_matches_the_source_and_the_choice():
    src = ATTENTION_SM90_SOURCE.read_text()
    const = {k: int(v) for k, v in re.findall(r"constexpr int (\w+) = (\d+);", src)}
    assert const["ROWS"] == BLOCK_ROWS and const["KT"] == ak.WGMMA_KV_TILE
    assert const["THREADS"] == ak.WGMMA_THREADS and const["HD"] in ak.WGMMA_HEAD_DIMS
    m = re.search(r"#define ATTEND_SM90_KERNEL\(NAME, STAGES\).*?NAME\((.*?)\)\s*\{", src, re.S)
    assert m
    types = ["P" if "*" in a else {"int": "i", "float": "f"}[a.split()[0]]
             for a in (x.replace("\\", " ").strip() for x in m.group(1).split(","))]
    for stages, name in ak.WGMMA_NAMES.items():
        assert f"ATTEND_SM90_KERNEL({name.format(hd=128)}, {stages})" in src
    name = ak.WGMMA_NAMES[ak.WGMMA_STAGES].format(hd=128)
    # the default is mma, on sm_90 too (wgmma is asked for)
    assert AttentionKernels(Recorder(arch="sm_90"), 64, 4, 128).kernel == "mma"
    rt = Recorder(arch="sm_90")
    kern = AttentionKernels(rt, 64, 4, 128, context=40000, kernel="auto")
    assert kern.kernel == "wgmma" and rt.kernels[name] == "".join(types)
    kern.attend(None, 0x6000, 0x7000, 0x8000, 300, 8192, 0x9000)
    got, grid, block, shared, args = rt.calls[-1]
    # the mma kernel's grid and arguments: 8 positions of the 16-head group per block
    assert (got, grid, block) == (name, (8192 // 8, 4, 1), (256, 1, 1))
    assert shared == wgmma_shared_bytes(128) == (32 + 64 * ak.WGMMA_STAGES + 1) * 1024
    assert shared <= 227 * 1024  # sm_90's opt-in limit
    assert args[:8] == (0x6000, 0x7000, 0x8000, 0x9000, 8192, 300, 64, 4)
    # auto takes wgmma only where it runs; asking for it elsewhere names why
    assert pick_attention("auto", "sm_90", 64) == "mma"
    assert pick_attention("auto", "sm_80", 128) == "mma"
    assert pick_attention("mma", "sm_90", 128) == "mma"
    assert AttentionKernels(Recorder(arch="sm_90"), 32, 4, 128, kernel="mma").kernel == "mma"
    with pytest.raises(ConfigError, match="wgmma runs on sm_90 devices with head dim 128; "
                                          "this is sm_89 with head dim 128"):
        AttentionKernels(Recorder(arch="sm_89"), 32, 4, 128, kernel="wgmma")
    with pytest.raises(ConfigError, match="allowed mma, auto, wgmma"):
        pick_attention("fast", "sm_90", 128)


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
@pytest.mark.parametrize("defines", [{"ATTN_V_DESC_SWAP": 1}, {"ATTN_PV_N64": 1},
                                     {"ATTN_PV_N64": 1, "ATTN_V_DESC_SWAP": 1}])
def test_the_probe_builds_of_the_wgmma_attend_compile(defines):
    """bench/probe_attention_sm90.py settles the p.v descriptor on the first sm_90 device by
    building the kernel with these switches: each must compile for sm_90a (the source as
    written is compiled by check-kernels)."""
    src = ATTENTION_SM90_SOURCE.read_text()
    for name in defines:
        assert f"defined({name})" in src, name
    assert compile_cubin(ATTENTION_SM90_SOURCE, ARCH_SPECIFIC, defines).stat().st_size > 0


def test_attention_reference_by_definition(rng):
    T, start, n_heads, n_kv, hd = 9, 4, 6, 2, 64
    q = rng.standard_normal((T, n_heads, hd)).astype(np.float16)
    keys = rng.standard_normal((start + T + 3, n_kv, hd)).astype(np.float16)
    vals = rng.standard_normal((start + T + 3, n_kv, hd)).astype(np.float16)
    keys[start + T:] = np.nan  # rows past the chunk are never read
    got = attention_reference(q, keys, vals, start).reshape(T, n_heads, hd)
    for t in range(T):
        for j in range(n_heads):
            kk, vv = keys[: start + t + 1, j // 3].astype(float), vals[: start + t + 1, j // 3]
            s = kk @ q[t, j].astype(float) / np.sqrt(hd)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, j], p @ vv.astype(float) / p.sum(), rtol=1e-12,
                                       atol=1e-14)


def test_qk_norm_rope_reference_by_definition(rng):
    T, start, n_heads, n_kv, hd = 5, 11, 4, 2, 64
    spec = _spec(n_heads, n_kv, hd, context=64)
    cos, sin = rope_cos_sin(spec)
    qkv = _qkv(rng, T, n_heads, n_kv, hd)
    qn, kn = _norms(rng, hd)
    q, k, v = qk_norm_rope_reference(qkv, start, qn, kn, cos, sin, EPS, n_heads, n_kv)
    x = qkv.astype(float)
    t, j = 3, 1  # k head 1
    h = x[t, (n_heads + j) * hd: (n_heads + j + 1) * hd]
    n = h / np.sqrt(np.mean(h * h) + EPS) * kn
    ang = (start + t) * 1e6 ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    want = np.concatenate([n[:32] * c - n[32:] * s, n[32:] * c + n[:32] * s])
    np.testing.assert_allclose(k[t, j], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(v[t, 1], x[t, (n_heads + n_kv + 1) * hd:])
    assert q.shape == (T, n_heads, hd) and k.shape == v.shape == (T, n_kv, hd)


def _emulate(q, keys, vals, start, step=KV_TILE):
    """The kernel's tile loop in numpy: per block of positions of one KV head's group, KV
    steps of `step` keys at absolute positions up to the block's last query, float32 scores,
    -inf masking, running max m (alpha exactly 1 when m does not move), probabilities
    exp2(s*c - m*c) rounded to fp16 for both l and p.v, out = fp16(acc * (1/l))."""
    T, n_heads, hd = q.shape
    n_kv = keys.shape[1]
    group = n_heads // n_kv
    P = BLOCK_ROWS // group
    c = np.float32(hd ** -0.5 / np.log(2))
    out = np.empty((T, n_heads, hd), np.float16)
    for kvh in range(n_kv):
        for p0 in range(0, T, P):
            np_ = min(P, T - p0)
            qb = q[p0: p0 + np_, kvh * group:(kvh + 1) * group].astype(np.float32)
            qb = qb.reshape(np_ * group, hd)
            qpos = start + p0 + np.repeat(np.arange(np_), group)
            m = np.full(len(qb), -np.inf, np.float32)
            lsum = np.zeros(len(qb), np.float32)
            acc = np.zeros((len(qb), hd), np.float32)
            for key0 in range(0, qpos.max() + 1, step):
                kt = keys[key0: key0 + step, kvh].astype(np.float32)
                vt = vals[key0: key0 + step, kvh].astype(np.float32)
                s = np.einsum("rd,kd->rk", qb, kt)  # row sums in a fixed order
                kp = key0 + np.arange(len(kt))
                s = np.where(kp[None, :] > qpos[:, None], np.float32(-np.inf), s)
                m_new = np.maximum(m, s.max(axis=1))
                with np.errstate(invalid="ignore"):
                    alpha = np.where(m_new == m, np.float32(1),
                                     np.exp2((m - m_new) * c)).astype(np.float32)
                p = np.exp2(s * c - (m_new * c)[:, None]).astype(np.float16).astype(np.float32)
                lsum = lsum * alpha + p.sum(axis=1, dtype=np.float32)
                acc = acc * alpha[:, None] + np.einsum("rk,kd->rd", p, vt)
                m = m_new
            o = (acc * (np.float32(1) / lsum)[:, None]).astype(np.float16)
            out[p0: p0 + np_, kvh * group:(kvh + 1) * group] = o.reshape(np_, group, hd)
    return out.reshape(T, n_heads * hd)


@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 2, 64), (12, 2, 64), (16, 1, 64), (8, 1, 128)])
def test_tile_loop_emulation_matches_twin_and_is_chunk_invariant(rng, n_heads, n_kv, hd):
    n = 300
    q = (rng.standard_normal((n, n_heads, hd)) * 2).astype(np.float16)
    keys = (rng.standard_normal((n, n_kv, hd)) * 2).astype(np.float16)
    vals = rng.standard_normal((n, n_kv, hd)).astype(np.float16)
    step = 32 if hd == 128 else 64  # the kernel's softmax step (AttnCfg::SUB)
    whole = _emulate(q, keys, vals, 0, step)
    assert nmse(whole, attention_reference(q, keys, vals, 0)) <= NMSE_BOUND
    parts, at = [], 0
    for size in (1, 130, 169):
        kv = keys.copy(), vals.copy()
        for a in kv:
            a[at + size:] = 0  # rows not yet written: the kernel zero-fills them
        parts.append(_emulate(q[at: at + size], *kv, at, step))
        at += size
    np.testing.assert_array_equal(np.concatenate(parts).view(np.uint16),
                                  whole.view(np.uint16))


# ============================================================================ GPU


@pytest.fixture
def stream(rt):
    return rt.stream("attention test")


def _cache(rt, s, rows, n_kv, hd, fill=None):
    """A K or V cache of `rows` positions: poisoned (0xFF = fp16 NaN), rows of `fill` at 0.."""
    buf = poisoned(rt, s, rows * n_kv * hd * 2)
    if fill is not None:
        rt.memcpy_htod(buf.ptr, np.ascontiguousarray(fill, np.float16), s)
    return buf


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", LAYOUTS + WGMMA_LAYOUTS)
@pytest.mark.parametrize("start", [0, 5, 300])
@pytest.mark.parametrize("T", [1, 7, 64, 129, 1000])
def test_attend_matches_twin(rt, stream, rng, kernel, layout, start, T):
    n_heads, n_kv, hd = layout
    if layout in WGMMA_LAYOUTS and kernel == "mma":
        pytest.skip("a wgmma-only layout")
    s, ctx = stream, start + T + 70  # rows past start+T stay NaN: never read
    kern = AttentionKernels(rt, n_heads, n_kv, hd, context=ctx,
                            kernel=_kernel_or_skip(rt, kernel, hd))
    q = (rng.standard_normal((T, n_heads, hd)) * 1.5).astype(np.float16)
    keys = (rng.standard_normal((start + T, n_kv, hd)) * 1.5).astype(np.float16)
    vals = rng.standard_normal((start + T, n_kv, hd)).astype(np.float16)
    dq = upload(rt, s, q)
    dk, dv = _cache(rt, s, ctx, n_kv, hd, keys), _cache(rt, s, ctx, n_kv, hd, vals)
    out = poisoned(rt, s, T * n_heads * hd * 2)
    kern.attend(s, dq.ptr, dk.ptr, dv.ptr, start, T, out.ptr)
    got = download(rt, s, out, np.float16, (T, n_heads * hd))
    assert np.isfinite(got).all()
    err = nmse(got, attention_reference(q, keys, vals, start))
    assert err <= NMSE_BOUND, f"NMSE {err:.2e}"


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,start", [(1, 0), (7, 5), (129, 300), (1000, 5)])
def test_qk_norm_rope_matches_twin(rt, stream, rng, layout, T, start):
    n_heads, n_kv, hd = layout
    s, ctx = stream, start + T + 9
    kern = AttentionKernels(rt, n_heads, n_kv, hd, context=ctx)
    cos, sin = rope_cos_sin(_spec(n_heads, n_kv, hd), ctx)
    qkv = _qkv(rng, T, n_heads, n_kv, hd)
    qn, kn = _norms(rng, hd)
    d = {name: upload(rt, s, a) for name, a in
         (("qkv", qkv), ("qn", qn), ("kn", kn), ("cos", cos), ("sin", sin))}
    q_out = poisoned(rt, s, T * n_heads * hd * 2)
    kc, vc = _cache(rt, s, ctx, n_kv, hd), _cache(rt, s, ctx, n_kv, hd)
    kern.qk_norm_rope(s, d["qkv"].ptr, T, start, d["qn"].ptr, d["kn"].ptr, d["cos"].ptr,
                      d["sin"].ptr, EPS, q_out.ptr, kc.ptr, vc.ptr)
    q = download(rt, s, q_out, np.float16, (T, n_heads, hd))
    kall = download(rt, s, kc, np.uint16, (ctx, n_kv, hd))
    vall = download(rt, s, vc, np.uint16, (ctx, n_kv, hd))
    # rows outside start..start+T-1 untouched
    for a in (kall, vall):
        assert (a[:start] == 0xFFFF).all() and (a[start + T:] == 0xFFFF).all()
    wq, wk, wv = qk_norm_rope_reference(qkv, start, qn, kn, cos, sin, EPS, n_heads, n_kv)
    k = kall[start: start + T].view(np.float16)
    for name, got, want in (("q", q, wq), ("k", k, wk)):
        assert nmse(got, want) <= NMSE_BOUND, name
        # one fp16 rounding (at most one ulp, 2^-10 relative) after float32 arithmetic,
        # whose rounding errors (RoPE's differences can cancel) stay below 1e-6 of the head's
        # RMS; a wrong table row, half or weight would be off by about the RMS itself
        err = np.abs(got.astype(np.float64) - want)
        rms = np.sqrt(np.mean(want ** 2, axis=-1, keepdims=True))
        assert (err <= 2.0 ** -10 * np.abs(want) + 1e-6 * rms).all(), name
    np.testing.assert_array_equal(vall[start: start + T].view(np.float16),
                                  wv.astype(np.float16))


def _prefill(rt, s, kern, d, qkv, chunks, ctx, hd):
    """qk_norm_rope + attend chunk by chunk over one fresh cache; (out, k cache, v cache)."""
    n_heads, n_kv = kern.n_heads, kern.n_kv_heads
    kc, vc = _cache(rt, s, ctx, n_kv, hd), _cache(rt, s, ctx, n_kv, hd)
    outs, start = [], 0
    for T in chunks:
        dqkv = upload(rt, s, qkv[start: start + T])
        q = poisoned(rt, s, T * n_heads * hd * 2)
        out = poisoned(rt, s, T * n_heads * hd * 2)
        kern.qk_norm_rope(s, dqkv.ptr, T, start, d["qn"].ptr, d["kn"].ptr, d["cos"].ptr,
                          d["sin"].ptr, EPS, q.ptr, kc.ptr, vc.ptr)
        kern.attend(s, q.ptr, kc.ptr, vc.ptr, start, T, out.ptr)
        outs.append(download(rt, s, out, np.uint16, (T, n_heads * hd)))
        start += T
    n = start
    return (np.concatenate(outs), download(rt, s, kc, np.uint16, (ctx, n_kv, hd))[:n],
            download(rt, s, vc, np.uint16, (ctx, n_kv, hd))[:n])


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", [(32, 4, 128), (64, 4, 128), (8, 2, 64), (6, 2, 64)])
def test_chunk_invariance_and_determinism(rt, stream, rng, kernel, layout):
    n_heads, n_kv, hd = layout
    s, n, ctx = stream, 1300, 1400
    kern = AttentionKernels(rt, n_heads, n_kv, hd, context=ctx,
                            kernel=_kernel_or_skip(rt, kernel, hd))
    spec = _spec(n_heads, n_kv, hd)
    cos, sin = rope_cos_sin(spec, ctx)
    qkv = _qkv(rng, n, n_heads, n_kv, hd)
    qn, kn = _norms(rng, hd)
    d = {name: upload(rt, s, a) for name, a in (("qn", qn), ("kn", kn), ("cos", cos),
                                             ("sin", sin))}
    whole = _prefill(rt, s, kern, d, qkv, [n], ctx, hd)
    again = _prefill(rt, s, kern, d, qkv, [n], ctx, hd)
    chunked = _prefill(rt, s, kern, d, qkv, [1, 600, 699], ctx, hd)
    odd = _prefill(rt, s, kern, d, qkv, [77, 1, 1024, 198], ctx, hd)
    for other in (again, chunked, odd):
        for a, b in zip(whole, other, strict=True):
            np.testing.assert_array_equal(a, b)
    # and the whole chain against the twins
    wq, wk, wv = qk_norm_rope_reference(qkv, 0, qn, kn, cos, sin, EPS, n_heads, n_kv)
    keys = whole[1].view(np.float16)
    vals = whole[2].view(np.float16)
    assert nmse(keys, wk) <= NMSE_BOUND
    # attention of the GPU's own fp16 q (recomputed by the twin, rounded as the kernel does)
    want = attention_reference(wq.astype(np.float16), keys, vals, 0)
    err = nmse(whole[0].view(np.float16), want)
    assert err <= NMSE_BOUND, f"NMSE {err:.2e}"


@gpu
@pytest.mark.parametrize("layout", [(32, 4, 128), (64, 4, 128), (6, 2, 128)])
def test_wgmma_stages_give_the_same_bytes(rt, stream, rng, layout, monkeypatch):
    """The pipelined wgmma attend (q.k of a tile beside p.v of the one before) does the same
    operations on o in the same order as the two-stage one: the same bytes."""
    n_heads, n_kv, hd = layout
    _kernel_or_skip(rt, "wgmma", hd)
    s, T, start = stream, 777, 300
    ctx = start + T
    q = (rng.standard_normal((T, n_heads, hd)) * 1.5).astype(np.float16)
    keys = (rng.standard_normal((ctx, n_kv, hd)) * 1.5).astype(np.float16)
    vals = rng.standard_normal((ctx, n_kv, hd)).astype(np.float16)
    dq = upload(rt, s, q)
    dk, dv = _cache(rt, s, ctx, n_kv, hd, keys), _cache(rt, s, ctx, n_kv, hd, vals)
    got = {}
    for stages in ak.WGMMA_NAMES:
        monkeypatch.setattr(ak, "WGMMA_STAGES", stages)
        kern = AttentionKernels(rt, n_heads, n_kv, hd, context=ctx, kernel="wgmma")
        out = poisoned(rt, s, T * n_heads * hd * 2)
        kern.attend(s, dq.ptr, dk.ptr, dv.ptr, start, T, out.ptr)
        got[stages] = download(rt, s, out, np.uint16, (T, n_heads * hd))
    first, *others = got.values()
    for other in others:
        np.testing.assert_array_equal(first, other)
    assert nmse(first.view(np.float16), attention_reference(q, keys, vals, start)) <= NMSE_BOUND
