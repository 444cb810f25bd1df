"""CPU tests of the IQ3_XXS MMQ contract: the numpy reference against float64 on the Qwen3-30B
shapes and against a literal per-element reading of the contract, the grid header, variant and
tile choice. The reference on the shared row cases, the compile and launch-ABI checks run in
test_conformance.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _iq3_blocks import QWEN3_30B, SMALL, case, group_of

from strata_rt.errors import FormatError
from strata_rt.formats.numerics import nmse
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.iq3_xxs_device import (
    MMQ_TILES,
    MMQ_VARIANTS,
    mmq_smem_bytes,
    tile_rows_for,
)
from strata_rt.resources import KERNELS_ROOT


def test_reference_matches_float64_qwen3_shape(rng):
    counts, ids = group_of([0], [19, 70], rng, n_layer=8)
    for part in ("gate_up", "down"):
        c = case(rng, QWEN3_30B, part, counts, ids)
        got = c.reference()
        mask = c.group_rows()
        assert got.dtype == np.float32 and not got[~mask].any()
        assert nmse(got[mask], c.float64_product()[mask]) <= 5e-4


def literal_contract(fmt, image, m, k, q, d, r, i):
    """One output element, read off the contract with Python scalars and np.float32 ops."""
    dd, s, wq = fmt.decode(image, (m, k))
    acc = np.float32(0)
    for j in range(k // 32):
        idot = int(np.dot(wq[i, 32 * j: 32 * j + 32].astype(np.int64),
                          q[r, 32 * j: 32 * j + 32].astype(np.int64)))
        rint = (2 * int(s[i, j // 8, j % 8]) + 1) * idot
        assert abs(rint) < 2 ** 23
        scale = np.float32(dd[i, j // 8] * np.float32(0.25)) * np.float32(d[r, j])
        acc = np.float32(acc + np.float32(scale * np.float32(rint)))
    return acc


def test_reference_is_the_contract_bit_for_bit(rng):
    counts, ids = [4, 3], (0, 1)
    c = case(rng, SMALL, "down", counts, ids)
    acts = c.acts
    got = c.fmt.mmq_reference(c.image, ids, acts, c.bounds, c.m, c.k)
    for _ in range(12):
        p = int(rng.integers(2))
        r = int(rng.integers(c.bounds[p], c.bounds[p + 1]))
        i = int(rng.integers(c.m))
        want = literal_contract(c.fmt, c.image[p], c.m, c.k, acts.q, acts.d, r, i)
        assert got[r, i].tobytes() == want.tobytes(), (r, i, got[r, i], want)


def gguf_grid_words() -> np.ndarray:
    from gguf.quants import IQ3_XXS

    IQ3_XXS.init_grid()
    mags = np.asarray(IQ3_XXS.grid, dtype=np.float32).reshape(256, 4).astype(np.uint8)
    return mags.view("<u4").reshape(256)


def test_grid_header_equals_gguf_grid():
    text = (KERNELS_ROOT / "iq3_xxs" / "grid.cuh").read_text()
    words = [int(w, 16) for w in re.findall(r"0x([0-9a-f]{8})u", text)]
    assert np.array_equal(np.array(words, dtype=np.uint32), gguf_grid_words())


def test_grid_header_is_current_generator_output():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_grid",
                                                  KERNELS_ROOT / "iq3_xxs" / "make_grid.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEADER.read_text() == gen.render(gen.grid_words())


def test_variant_selection():
    """The format object runs f16_gemm unless told another variant, and refuses a name that is
    none of them; for_variant reaches every variant by name, the fastest exact one first."""
    assert IQ3XXS().variant == "f16_gemm"
    assert IQ3XXS("int8").variant == "int8"
    assert IQ3XXS().for_variant("int8").variant == "int8"
    valid = ("f16_gemm", "f16_fused", *MMQ_VARIANTS)
    with pytest.raises(FormatError, match="bf16x.*valid: " + ", ".join(valid)):
        IQ3XXS("bf16x")
    assert IQ3XXS().mmq_variants() == valid and MMQ_VARIANTS[0] == "f16_pipe"


def test_tiles_and_shared_memory_fit():
    hints = (0, 1, 32, 33, 64, 65, 100000)
    assert [tile_rows_for("f16", n) for n in hints] == [32, 32, 32, 64, 64, 128, 128]
    assert [tile_rows_for("int8_occ2", n) for n in hints] == [32, 32, 32, 64, 64, 64, 64]
    for v in MMQ_VARIANTS:
        for tm in MMQ_TILES[v]:
            assert mmq_smem_bytes(v, tm) <= 163 * 1024  # sm_80's opt-in limit
            if v.endswith("_occ2"):  # two blocks (+1 KiB reserved each) in sm_90's 228 KiB
                assert 2 * (mmq_smem_bytes(v, tm) + 1024) <= 228 * 1024
