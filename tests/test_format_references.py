"""The numpy matmul references of the per-expert formats against a float64 product of the
dequantized weights, on the shared row-count cases (the IQ3_XXS reference has its own file)."""

from __future__ import annotations

import pytest
from _format_harness import ROW_CASES, make_case, nmse

from strata_rt.quants.fp16 import FP16
from strata_rt.quants.q2_blob import Q2Blob


@pytest.mark.parametrize("fmt", [Q2Blob(), FP16()], ids=lambda f: f.name)
@pytest.mark.parametrize("hidden,ffn,part,counts,ids", ROW_CASES)
def test_reference_against_float64(fmt, rng, hidden, ffn, part, counts, ids):
    case = make_case(fmt, rng, hidden, ffn, part, counts, ids)
    got = fmt.mmq_reference(case.image, case.expert_ids, case.acts, case.bounds, case.m, case.k)
    mask = case.group_rows()
    assert (got[~mask] == 0).all()
    err = nmse(got[mask], case.float64_product()[mask])
    assert err <= 5e-4, err
