"""IQ3_XXS host side on the CPU: exact dequantization against the gguf package, the quantizer
against a plain scalar transcription of llama.cpp's algorithm and on Gaussian weights, random
valid blocks, and expert packing from GGUF files."""

from __future__ import annotations

import os
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from strata_rt.errors import FormatError, GGUFError
from strata_rt.formats.activations import Q8_1
from strata_rt.formats.numerics import nmse
from strata_rt.quants.iq3_xxs import GRID_MAG, IQ3XXS, MAX_WEIGHT, SIGN_MASK, strata_rt_formats

FMT = IQ3XXS("f16_pipe")  # native images and the exact reference
f32 = np.float32


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"numpy seed: {seed}")  # pytest shows captured output of a failing test
    return np.random.default_rng(seed)


def gguf_grid() -> np.ndarray:
    gguf.quants.IQ3_XXS.init_grid()
    return np.asarray(gguf.quants.IQ3_XXS.grid).reshape(256, 4)


def gguf_dequant(raw: np.ndarray, rows: int) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), GT.IQ3_XXS), dtype=f32)


def random_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Arbitrary bytes with a finite fp16 d: every other byte pattern is a valid block. d covers
    the whole finite fp16 range (signs, zero, subnormals) so exactness is tested everywhere."""
    raw = rng.integers(0, 256, (rows * cols // 256, 98), dtype=np.uint8)
    d = raw[:, :2].copy().view("<u2")
    d[(d & 0x7C00) == 0x7C00] &= 0x83FF  # inf/NaN exponent -> zero/subnormal instead
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


# ---------------------------------------------------------------------- tables and identity
def test_grid_and_sign_tables_match_gguf():
    assert np.array_equal(GRID_MAG.astype(np.float32), gguf_grid())
    assert np.array_equal(SIGN_MASK, np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8))


def test_identity_and_hook():
    (fmt,) = strata_rt_formats()
    assert isinstance(fmt, IQ3XXS)
    assert fmt.ggml_type == 18 == int(GT.IQ3_XXS)
    assert (fmt.block_values, fmt.block_bytes) == gguf.constants.GGML_QUANT_SIZES[GT.IQ3_XXS]
    assert fmt.native and fmt.name == "iq3_xxs" and fmt.variant == "f16_gemm"
    assert FMT.activation is Q8_1 and FMT.exact and fmt.quantizes


# ---------------------------------------------------------------------- dequantization
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (64, 2048), (2048, 768)])
def test_dequantize_bit_exact_with_gguf(rng, shape):
    raw = random_blocks(rng, *shape)
    ours = FMT.dequantize(raw, shape)
    assert ours.dtype == np.float32 and ours.shape == shape
    assert ours.tobytes() == gguf_dequant(raw, shape[0]).tobytes()


def test_decode_recomposes_dequantize(rng):
    shape = (9, 768)
    raw = random_blocks(rng, *shape)
    d, s, q = FMT.decode(raw, shape)
    assert d.shape == (9, 3) and s.shape == (9, 3, 8) and q.shape == shape
    assert d.dtype == np.float32 and s.dtype == np.uint8 and q.dtype == np.int8
    assert s.max() <= 15
    db = np.repeat((d[..., None] * (f32(0.5) + s) * f32(0.5)).reshape(9, -1), 32, axis=1)
    assert (db * q.astype(f32)).tobytes() == FMT.dequantize(raw, shape).tobytes()
    # every group of 8 carries an even number of negatives
    assert ((q.reshape(-1, 8) < 0).sum(1) % 2 == 0).all()


def test_decode_hand_built_block():
    """One block assembled field by field, read back through the documented positions."""
    blk = np.zeros(98, np.uint8)
    blk[:2] = np.array([0.5], "<f2").view(np.uint8)
    blk[2 + 8 * 3 + 5] = 1  # sub-block 3, group-of-four 5 -> grid point 1
    word = (0b0000011 << 7) | (9 << 28)  # sub-block 3: sign index 3 for weights 8..15, s = 9
    blk[66 + 4 * 3: 66 + 4 * 4] = np.array([word], "<u4").view(np.uint8)
    d, s, q = FMT.decode(blk, (1, 256))
    assert d[0, 0] == 0.5 and s[0, 0, 3] == 9 and s.sum() == 9
    sub = q[0, 96:128]
    assert list(sub[20:24]) == list(GRID_MAG[1])
    negative = np.flatnonzero(sub < 0)
    assert list(negative) == [8, 9]  # mask 0b00000011, parity bit clear
    assert set(np.abs(sub[:20]).tolist() + np.abs(sub[24:]).tolist()) == {4}


def test_dequantize_rejects_wrong_byte_count():
    with pytest.raises(FormatError, match="97 bytes"):
        FMT.dequantize(np.zeros(97, np.uint8), (1, 256))
    with pytest.raises(FormatError, match="multiple of the block size"):
        FMT.dequantize(np.zeros(98, np.uint8), (1, 200))


# ---------------------------------------------------------------------- scalar reference
_LEVEL_OF = {4: 0, 12: 1, 20: 2, 28: 3, 36: 4, 44: 5, 52: 6, 62: 7}


class ScalarIQ3:
    """llama.cpp's IQ3_XXS quantizer written as plain loops over float32 scalars, with the grid
    and its neighbour lists built from gguf's grid by brute force. Slow; a few blocks only."""

    def __init__(self):
        self.levels = np.vectorize(_LEVEL_OF.get)(gguf_grid().astype(int))
        self.index = {tuple(lv): i for i, lv in enumerate(self.levels.tolist())}
        self.odd = 2 * self.levels + 1
        self._nbrs: dict[tuple, list[int]] = {}

    def neighbours(self, lv: tuple) -> list[int]:
        if lv not in self._nbrs:
            dist = ((self.odd - (2 * np.array(lv) + 1)) ** 2).sum(1)
            second = sorted(set(dist.tolist()))[1]
            order = sorted(range(256), key=lambda j: (dist[j], j))
            self._nbrs[lv] = [j for j in order if dist[j] <= second]
        return self._nbrs[lv]

    def snap(self, xv, wa, scale, lv4):
        best, best_d2 = -1, f32(np.finfo(f32).max)
        for j in self.neighbours(tuple(lv4)):
            d2 = f32(0)
            for i in range(4):
                diff = scale * f32(self.odd[j, i]) - xv[i]
                d2 = d2 + wa[i] * diff * diff
            if d2 < best_d2:
                best, best_d2 = j, d2
        return list(self.levels[best])

    @staticmethod
    def nearest(v) -> int:
        return int(np.rint(v))

    def group_levels(self, xval, inv, k):
        return [max(0, min(7, self.nearest(f32(0.5) * (inv * xval[4 * k + i] - f32(1)))))
                for i in range(4)]

    def sums(self, wt, xval, lv):
        sqx, sq2 = f32(0), f32(0)
        for i in range(32):
            q = f32(2 * lv[i] + 1)
            sqx = sqx + wt[i] * xval[i] * q
            sq2 = sq2 + wt[i] * q * q
        return sqx, sq2

    def block(self, x, qw):
        sumx2 = f32(0)
        for v in x:
            sumx2 = sumx2 + v * v
        sigma2 = f32(2) * sumx2 / f32(256)
        scales, grid_bytes, words = [], [], []
        for ib in range(8):
            xb = x[32 * ib: 32 * ib + 32]
            if qw is None:
                wt = [v * v for v in xb]
            else:
                wt = [qw[32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i]) for i in range(32)]
            wa = [np.sqrt(w) for w in wt]
            xval, signs = [abs(v) for v in xb], []
            for k in range(4):
                s = sum(1 << i for i in range(8) if xb[8 * k + i] < 0)
                if bin(s).count("1") % 2:
                    imp = [wt[8 * k + i] * xb[8 * k + i] * xb[8 * k + i] for i in range(8)]
                    imin = min(range(8), key=lambda i: (imp[i], i))
                    xval[8 * k + imin] = -xval[8 * k + imin]
                    s ^= 1 << imin
                signs.append(s & 127)
            vmax = max(xval)
            if vmax < f32(1e-8):
                scales.append(f32(0))
                grid_bytes += [0] * 8
                words.append(0)
                continue
            best, scale, lv, on_grid = f32(0), vmax / f32(15), [0] * 32, [True] * 8
            for t in range(-15, 16):
                inv = (f32(15) + f32(t) * f32(0.2)) / vmax
                trial, on = [], []
                for k in range(8):
                    g = self.group_levels(xval, inv, k)
                    on.append(tuple(g) in self.index)
                    if not on[-1]:
                        g = self.snap(xval[4 * k: 4 * k + 4], wa[4 * k: 4 * k + 4],
                                      f32(1) / inv, g)
                    trial += g
                sqx, sq2 = self.sums(wt, xval, trial)
                if sq2 > 0 and sqx * sqx > best * sq2:
                    scale = sqx / sq2
                    best = scale * sqx
                    lv, on_grid = trial, on
            if not all(on_grid) and scale > 0:
                for k in range(8):
                    if on_grid[k]:
                        continue
                    g = self.group_levels(xval, f32(1) / scale, k)
                    if tuple(g) not in self.index:
                        g = self.snap(xval[4 * k: 4 * k + 4], wa[4 * k: 4 * k + 4], scale, g)
                    lv[4 * k: 4 * k + 4] = g
                sqx, sq2 = self.sums(wt, xval, lv)
                if sq2 > 0:
                    scale = sqx / sq2
            if scale < 0:
                scale = -scale
                signs = [~s & 127 for s in signs]
            grid_bytes += [self.index[tuple(lv[4 * k: 4 * k + 4])] for k in range(8)]
            words.append(signs[0] | signs[1] << 7 | signs[2] << 14 | signs[3] << 21)
            scales.append(scale)
        max_scale = max(scales)
        if max_scale == 0:
            return np.zeros(98, np.uint8)
        d = max_scale / f32(31)
        inv = f32(1) / d
        for ib in range(8):
            words[ib] |= max(0, min(15, self.nearest(f32(0.5) * (inv * scales[ib] - f32(1))))) << 28
        head = np.array([d * f32(1.0125)], "<f2").view(np.uint8)
        return np.concatenate([head, np.array(grid_bytes, np.uint8),
                               np.array(words, "<u4").view(np.uint8)])

    def quantize(self, w, qw=None):
        rows, cols = w.shape
        out = [self.block(w[r, c: c + 256], None if qw is None else qw[c: c + 256])
               for r in range(rows) for c in range(0, cols, 256)]
        return np.concatenate(out).reshape(rows, -1)


def edge_case_weights(rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((3, 512)).astype(f32)
    w[0, 32:64] = 0  # an all-zero sub-block inside a live block
    w[1, :256] = 0  # an all-zero block
    w[2, 256:288] = -np.abs(w[2, 256:288])  # all negative: odd groups get a flipped sign
    w[2, 300:310] *= 40  # outliers
    return w


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_quantizer_matches_scalar_reference_bytes(rng, with_imatrix):
    w = edge_case_weights(rng)
    qw = rng.uniform(0.05, 3.0, 512).astype(f32) if with_imatrix else None
    assert FMT.quantize(w, qw).tobytes() == ScalarIQ3().quantize(w, qw).tobytes()


def test_quantizer_parity_rule_flips_least_important_sign(rng):
    w = rng.standard_normal((4, 256)).astype(f32)
    _, _, q = FMT.decode(FMT.quantize(w), w.shape)
    for x8, q8 in zip(w.reshape(-1, 8), q.reshape(-1, 8)):
        wrong = np.flatnonzero((x8 < 0) != (q8 < 0))
        if (x8 < 0).sum() % 2:  # the smallest |x| (least x^4) keeps the wrong sign
            assert list(wrong) == [int(np.argmin(np.abs(x8)))]
        else:
            assert wrong.size == 0


def test_quantizer_zero_weights_give_zero_bytes():
    raw = FMT.quantize(np.zeros((2, 512), f32))
    assert raw.shape == (2, 196) and not raw.any()
    assert not FMT.dequantize(raw, (2, 512)).any()


# ---------------------------------------------------------------------- quantizer quality
@pytest.mark.slow
def test_quantizer_gaussian_2048x768(rng):
    w = rng.standard_normal((2048, 768)).astype(f32) * f32(768 ** -0.5)
    t0 = time.process_time()  # CPU time: other work on a shared machine does not count
    raw = FMT.quantize(w)
    seconds = time.process_time() - t0
    err = nmse(FMT.dequantize(raw, w.shape), w)
    print(f"iq3_xxs quantize 2048x768: {seconds:.2f} s, NMSE {err:.4f}")
    assert raw.shape == (2048, 3 * 98)
    assert 0.02 < err < FMT.roundtrip_nmse
    assert seconds < 20

    # random valid blocks of the same scale are no approximation at all
    baseline = FMT.dequantize(FMT._random_matrix(rng, 2048, 768), w.shape)
    assert nmse(baseline, w) > 1.5 and err < nmse(baseline, w) / 20

    # an importance vector moves the error towards the important columns
    imp = rng.uniform(0.05, 4.0, 768).astype(f32)
    raw_imp = FMT.quantize(w, imp)
    w_err_imp = nmse(FMT.dequantize(raw_imp, w.shape), w, imp)
    w_err = nmse(FMT.dequantize(raw, w.shape), w, imp)
    print(f"iq3_xxs importance-weighted NMSE: {w_err_imp:.4f} with imatrix, {w_err:.4f} without")
    assert w_err_imp < 0.9 * w_err and w_err_imp < FMT.roundtrip_nmse


def test_quantizer_errors():
    with pytest.raises(FormatError, match="300 values is not a multiple"):
        FMT.quantize(np.ones((2, 300), f32))
    bad = np.ones((2, 256), f32)
    bad[1, 7] = np.nan
    with pytest.raises(FormatError, match="NaN/Inf.*row 1, column 7"):
        FMT.quantize(bad)
    bad[1, 7] = np.inf
    with pytest.raises(FormatError, match="NaN/Inf"):
        FMT.quantize(bad)
    with pytest.raises(FormatError, match=r"shape \(255,\).*\(256,\)"):
        FMT.quantize(np.ones((2, 256), f32), np.ones(255, f32))
    with pytest.raises(FormatError, match="finite and >= 0"):
        FMT.quantize(np.ones((2, 256), f32), -np.ones(256, f32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantizer_rejects_non_finite_weights_naming_row_and_column(rng, bad):
    w = rng.standard_normal((3, 512)).astype(f32)
    w[2, 300] = bad
    w[2, 400] = bad
    with pytest.raises(FormatError, match=r"2 NaN/Inf value\(s\), first at row 2, column 300"):
        FMT.quantize(w)


@pytest.mark.parametrize("big", [1.02 * MAX_WEIGHT, -1e8, 1e12, 3e19, -3.4e38])
def test_quantizer_rejects_a_block_scale_beyond_fp16(rng, big):
    """A weight beyond what a block can hold (fp16 d * 480.5 ~ 3.1e7) used to give an infinite
    scale (from ~1e8) or a bare numpy ValueError (from ~3e19); now one message names it."""
    w = rng.standard_normal((4, 768)).astype(f32)
    w[3, 600] = big
    w[3, 700] = big / 2  # same block, not the largest
    with pytest.raises(FormatError, match=(r"block at row 3, columns 512-767 needs a scale beyond "
                                           r"fp16's range: its largest weight, .* at row 3, "
                                           r"column 600, is too large")) as info:
        FMT.quantize(w)
    assert f"{big:.4g}" in str(info.value)
    with pytest.raises(FormatError, match="row 3, column 600"):
        FMT.quantize(w, rng.uniform(0.1, 2.0, 768).astype(f32))


def test_quantizer_keeps_large_weights_that_fit(rng):
    """Below the limit (the search's largest scale, max/12 per sub-block, keeps d finite up to
    ~2.4e7) the block is stored and dequantizes near its largest weight; of two offending
    blocks the first is named."""
    w = rng.standard_normal((2, 512)).astype(f32)
    w[0, 10] = f32(0.7 * MAX_WEIGHT)
    raw = FMT.quantize(w)
    d = raw.reshape(2, 2, 98)[:, :, :2].copy().view("<f2")
    assert np.isfinite(d).all()
    back = FMT.dequantize(raw, w.shape)
    assert abs(back[0, 10] - w[0, 10]) < 0.1 * abs(w[0, 10])
    w[1, 300] = f32(1e9)
    w[0, 200] = f32(5e7)
    with pytest.raises(FormatError, match="row 0, column 200"):
        FMT.quantize(w)


# ---------------------------------------------------------------------- experts
def test_random_expert_qwen3_30b_size_and_scale(rng):
    blob = FMT.random_expert(rng, 2048, 768)
    lay = FMT.layout(2048, 768)
    assert blob.dtype == np.uint8 and blob.size == lay.blob_bytes == 1_806_336
    gate, up, down = FMT.unpack_expert(blob, 2048, 768)
    for m, cols in ((gate, 2048), (up, 2048), (down, 768)):
        assert np.isfinite(m).all()
        assert 0.8 < m.std() * cols ** 0.5 < 1.25
    assert gate.tobytes() == gguf_dequant(blob[: lay.gate_up_bytes // 2], 768).tobytes()
    assert not np.array_equal(blob, FMT.random_expert(rng, 2048, 768))


def test_pack_unpack_expert_equals_quantize_dequantize(rng):
    hidden, ffn = 512, 256
    gate, up = (rng.standard_normal((ffn, hidden)).astype(f32) for _ in range(2))
    down = rng.standard_normal((hidden, ffn)).astype(f32)
    blob = FMT.pack_expert(gate, up, down)
    assert blob.size == FMT.layout(hidden, ffn).blob_bytes
    for got, m in zip(FMT.unpack_expert(blob, hidden, ffn), (gate, up, down)):
        assert got.tobytes() == FMT.dequantize(FMT.quantize(m), m.shape).tobytes()


def write_gguf(path, tensors: dict[str, np.ndarray], raw_types: dict[str, GT]):
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_types.get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


NAMES = [f"blk.0.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]


def test_pack_gguf_experts_copies_iq3_xxs_bytes(rng, tmp_path, capsys):
    n, ffn, hidden = 3, 256, 512
    raws = [random_blocks(rng, n * r, c).reshape(n, r, -1)
            for r, c in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    t = write_gguf(tmp_path / "m.gguf", dict(zip(NAMES, raws)), dict.fromkeys(NAMES, GT.IQ3_XXS))
    blobs = FMT.pack_gguf_experts(*(t[k] for k in NAMES))
    assert blobs.shape == (n, FMT.layout(hidden, ffn).blob_bytes)
    for e in range(n):
        assert blobs[e].tobytes() == b"".join(r[e].tobytes() for r in raws)
    assert capsys.readouterr().err == ""


def test_pack_gguf_experts_requantizes_other_types(rng, tmp_path):
    n, ffn, hidden = 2, 256, 256
    gate_raw = random_blocks(rng, n * ffn, hidden).reshape(n, ffn, -1)
    up = rng.standard_normal((n, ffn, hidden)).astype(f32)
    down = rng.standard_normal((n, hidden, ffn)).astype(np.float16)
    t = write_gguf(tmp_path / "m.gguf", dict(zip(NAMES, [gate_raw, up, down])),
                   {NAMES[0]: GT.IQ3_XXS})
    blobs = FMT.pack_gguf_experts(*(t[k] for k in NAMES))
    for e in range(n):
        want = [gate_raw[e], FMT.quantize(up[e]), FMT.quantize(down[e].astype(f32))]
        assert blobs[e].tobytes() == b"".join(m.tobytes() for m in want)


def test_pack_gguf_experts_errors(rng, tmp_path):
    n, ffn, hidden = 2, 256, 512
    gate = random_blocks(rng, n * ffn, hidden).reshape(n, ffn, -1)
    wrong_down = random_blocks(rng, n * hidden, 2 * ffn).reshape(n, hidden, -1)
    t = write_gguf(tmp_path / "a.gguf", dict(zip(NAMES, [gate, gate, wrong_down])),
                   dict.fromkeys(NAMES, GT.IQ3_XXS))
    with pytest.raises(GGUFError, match=r"ffn_down_exps.weight has shape \[2, 512, 512\]"):
        FMT.pack_gguf_experts(*(t[k] for k in NAMES))

    down = random_blocks(rng, n * hidden, ffn).reshape(n, hidden, -1)
    t = write_gguf(tmp_path / "c.gguf",
                   {NAMES[0]: gate, NAMES[1]: np.zeros((n, ffn, hidden), np.int32),
                    NAMES[2]: down},
                   {NAMES[0]: GT.IQ3_XXS, NAMES[2]: GT.IQ3_XXS})
    with pytest.raises(FormatError, match="ffn_up_exps.weight has type I32"):
        FMT.pack_gguf_experts(*(t[k] for k in NAMES))
