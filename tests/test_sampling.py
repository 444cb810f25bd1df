"""The numpy sampler (strata_rt.text.sampling, the definition the CUDA kernel reproduces): its
exact arithmetic against independent implementations, each filter and the penalty, the edge
cases (ties, -inf, NaN, saturation), the parameters' checks, seeded reproducibility and the
distribution it draws from against the analytic filtered softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strata_rt.errors import ConfigError, StrataError
from strata_rt.text.sampling import (
    MAX_CANDIDATES,
    SamplingParams,
    adjusted,
    candidates,
    choice_index,
    describe,
    distinct_ids,
    filtered_probabilities,
    plan,
    sample,
)
from strata_rt.text.sampling_math import (
    exp_nonpositive,
    inclusive_scan,
    key_values,
    ordered_keys,
    random_bits,
    uniform,
)

MASK = (1 << 64) - 1


def splitmix_reference(seed: int, step: int) -> int:
    """splitmix64's mixer over mix(seed) + (step + 1) * gamma, in Python integers."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    return mix((mix(seed) + (step + 1) * 0x9E3779B97F4A7C15) & MASK)


# ----------------------------------------------------------------------------- arithmetic
def test_random_bits_equal_python_integers(rng) -> None:
    seeds = [0, 1, MASK, 1 << 63, *(int(s) for s in rng.integers(0, 2**63, 20))]
    for seed in seeds:
        for step in (0, 1, 7, 65535, 2**31 - 1):
            assert int(random_bits(seed, step)) == splitmix_reference(seed, step)
            u = float(uniform(seed, step))
            assert u == (splitmix_reference(seed, step) >> 11) * 2.0 ** -53 and 0 <= u < 1


def test_uniform_is_uniform() -> None:
    u = uniform(np.arange(200_000) % 97, np.arange(200_000) // 97)
    hist = np.histogram(u, bins=20, range=(0, 1))[0]
    assert abs(u.mean() - 0.5) < 0.003
    assert (np.abs(hist - 10_000) < 600).all()


def test_exp_nonpositive_is_exp(rng) -> None:
    x = -np.concatenate([rng.exponential(5.0, 50_000), rng.uniform(0, 700, 5_000),
                         [0.0, 1e-300, 0.5 * math.log(2), 699.999]])
    got, want = exp_nonpositive(x), np.exp(x)
    assert np.max(np.abs(got - want) / want) < 4e-15
    assert exp_nonpositive(np.array([0.0]))[0] == 1.0
    assert (exp_nonpositive(np.array([-700.001, -1e9, -np.inf])) == 0).all()


def test_inclusive_scan_order_and_padding(rng) -> None:
    w = rng.random(1000)
    c = inclusive_scan(w)
    assert np.allclose(c, np.cumsum(w), rtol=1e-13)
    padded = inclusive_scan(np.concatenate([w, np.zeros(1048)]))
    assert np.array_equal(padded[:1000], c)  # a sum's additions depend on its index only
    # Hillis-Steele by hand for 4 values: ((a + b) + (c + d)) at index 3
    a, b, cc, d = 0.1, 0.2, 0.3, 0.4
    assert inclusive_scan(np.array([a, b, cc, d]))[3] == (d + cc) + (b + a)


def test_ordered_keys_sort_like_floats(rng) -> None:
    v = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 1e3,
                        np.array([0.0, -np.inf, np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38],
                                 np.float32)])
    keys = ordered_keys(v)
    assert np.array_equal(np.argsort(keys, kind="stable"), np.argsort(v, kind="stable"))
    assert np.array_equal(key_values(keys).view(np.uint32), v.view(np.uint32))


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("kw, message", [
    ({"temperature": -0.1}, "temperature: got -0.1; expected a number >= 0"),
    ({"temperature": float("nan")}, "temperature: got nan"),
    ({"temperature": float("inf")}, "temperature: got inf"),
    ({"top_k": -1}, "top_k: got -1; expected an integer 0..2048"),
    ({"top_k": MAX_CANDIDATES + 1}, "top_k: got 2049"),
    ({"top_k": 2.0}, "top_k: got 2.0; expected an integer"),
    ({"top_k": True}, "top_k: got True"),
    ({"top_p": 0}, "top_p: got 0; expected a number > 0 and <= 1"),
    ({"top_p": 1.01}, "top_p: got 1.01"),
    ({"min_p": 1}, "min_p: got 1; expected a number >= 0 and < 1"),
    ({"min_p": -0.5}, "min_p: got -0.5"),
    ({"repetition_penalty": 0}, "repeat_penalty: got 0; expected a number > 0"),
    ({"seed": -1}, "seed: got -1; expected an integer 0..2**64-1"),
    ({"seed": 1 << 64}, "seed: got 18446744073709551616"),
    ({"seed": "7"}, "seed: got '7'"),
])
def test_bad_parameters_are_named(kw, message) -> None:
    with pytest.raises(ConfigError, match="sampling") as info:
        SamplingParams(**kw)
    assert message in str(info.value)


def test_every_bad_parameter_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(temperature=-1, top_p=2, min_p=3)
    assert len(info.value.problems) == 3


def test_defaults_are_greedy_and_a_seed_is_resolved() -> None:
    p = SamplingParams()
    assert p.is_greedy and describe(p) == "greedy"
    assert not SamplingParams(repetition_penalty=1.1).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    r = SamplingParams(temperature=1.0).resolved()
    assert r.seed is not None and r.resolved() is r
    assert SamplingParams(seed=5).resolved().seed == 5
    assert "seed 5" in describe(SamplingParams(temperature=0.7, top_k=40, seed=5))
    with pytest.raises(StrataError, match="needs a seed"):
        sample(np.zeros(4, np.float32), SamplingParams(temperature=1.0), [], 0)


def test_plan() -> None:
    assert plan(SamplingParams(), 100).candidates == 1
    assert plan(SamplingParams(temperature=0.5), 100).candidates == 100
    assert plan(SamplingParams(temperature=0.5), 10**6).candidates == MAX_CANDIDATES
    assert plan(SamplingParams(temperature=0.5, top_k=7), 100).candidates == 7
    assert plan(SamplingParams(temperature=0.5, top_k=7), 5).candidates == 5
    assert plan(SamplingParams(temperature=0.0, top_k=7), 100).temperature == 1


# ----------------------------------------------------------------------------- the filters
def draw(logits, seen=(), step=0, seed=1, **kw) -> int:
    return sample(np.asarray(logits, np.float32), SamplingParams(seed=seed, **kw), seen, step)


def test_temperature_zero_is_the_argmax_lowest_id_on_ties(rng) -> None:
    for _ in range(20):
        row = rng.integers(-3, 3, 50).astype(np.float32)
        assert draw(row, temperature=0.0, seed=int(rng.integers(1 << 32))) == int(row.argmax())
    assert draw([1, 5, 5, 2]) == 1  # greedy defaults through the sampler
    assert draw([1, 5, 5, 2], temperature=3.0, top_k=1, seed=9) == 1


def test_repetition_penalty_as_transformers_applies_it() -> None:
    row = np.array([2.0, -1.0, 1.5, 0.0, 1.9], np.float32)
    sp = plan(SamplingParams(temperature=1.0, repetition_penalty=2.0), row.size)
    got = adjusted(row, sp, distinct_ids([0, 1, 0, 0, 3], row.size))
    assert np.array_equal(got, np.array([1.0, -2.0, 1.5, 0.0, 1.9], np.float32))  # once each
    # greedy with a penalty: the penalised argmax
    assert draw(row, seen=[0], repetition_penalty=2.0) == 4
    assert draw(row, seen=[0, 4], repetition_penalty=1.5) == 2
    with pytest.raises(StrataError, match="outside the vocabulary"):
        draw(row, seen=[5], repetition_penalty=2.0)


def test_top_k_keeps_the_k_best_by_value_then_id() -> None:
    row = np.array([0.0, 3.0, 1.0, 3.0, 2.0, 3.0], np.float32)
    assert candidates(row, 3).tolist() == [1, 3, 5]
    assert candidates(row, 5).tolist() == [1, 3, 5, 4, 2]
    got = {draw(row, temperature=1.0, top_k=2, seed=s) for s in range(300)}
    assert got == {1, 3}


def test_top_p_and_min_p_cut_the_tail() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits in ln 2 steps)
    row = np.log(np.array([4.0, 2.0, 1.0, 1.0])).astype(np.float32)
    kept = lambda **kw: {draw(row, temperature=1.0, seed=s, **kw) for s in range(400)}  # noqa: E731
    assert kept(top_p=0.5) == {0}
    assert kept(top_p=0.6) == {0, 1}
    assert kept(top_p=0.8) == {0, 1, 2}
    assert kept(top_p=1.0) == {0, 1, 2, 3}
    assert kept(min_p=0.45) == {0, 1}
    assert kept(min_p=0.3) == {0, 1}
    assert kept(min_p=0.2) == {0, 1, 2, 3}
    assert kept(top_p=1e-300) == {0}


def test_minus_infinity_is_never_drawn_and_bad_logits_are_errors() -> None:
    row = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)
    assert {draw(row, temperature=2.0, seed=s) for s in range(200)} == {1, 3}
    with pytest.raises(StrataError, match="every logit is -inf"):
        draw(np.full(4, -np.inf), temperature=1.0)
    for bad in (np.nan, np.inf):
        with pytest.raises(StrataError, match="NaN or \\+inf"):
            draw([0.0, bad, 1.0], temperature=1.0)


def test_overflow_saturates_and_stays_drawable() -> None:
    row = np.array([3e38, -3e38, 1e38, -np.inf], np.float32)
    sp = plan(SamplingParams(temperature=1e-3, repetition_penalty=1e-3), row.size)
    got = adjusted(row, sp, distinct_ids([0, 2], row.size))
    big = np.finfo(np.float32).max
    assert got.tolist() == [big, -big, big, -np.inf]
    # 3e38 and 1e38 both saturate: a tie, drawn half and half
    assert {draw(row, temperature=1e-3, seed=s) for s in range(50)} == {0, 2}


def test_negative_zero_ties_with_zero() -> None:
    row = np.array([-0.0, 0.0, -1.0], np.float32)
    assert candidates(adjusted(row, plan(SamplingParams(temperature=1.0), 3),
                               np.zeros(0, np.int32)), 3).tolist() == [0, 1, 2]


def test_seeded_draws_repeat_and_steps_differ(rng) -> None:
    row = rng.standard_normal(3000).astype(np.float32)
    kw = {"temperature": 1.5, "top_p": 0.95}
    a = [draw(row, step=t, seed=11, **kw) for t in range(30)]
    assert a == [draw(row, step=t, seed=11, **kw) for t in range(30)]
    assert len(set(a)) > 10
    assert a != [draw(row, step=t, seed=12, **kw) for t in range(30)]


# ----------------------------------------------------------------------------- distribution
def chi2_bound(df: int, z: float = 5.0) -> float:
    """The chi-square value a deviation of z sigmas reaches (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DISTRIBUTIONS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 0.9, "top_k": 8, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.3},
]


@pytest.mark.parametrize("kw", DISTRIBUTIONS)
def test_draws_follow_the_filtered_softmax(kw) -> None:
    """4,000 seeds on a 12-token vocabulary (fixed: the test is deterministic), a chi-square
    at 5 sigmas against the analytic distribution; filtered tokens never drawn."""
    row = np.array([2.0, 1.5, 1.5, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -1.5, -np.inf, -3.0],
                   np.float32)
    seen = [0, 3, 8]
    want = filtered_probabilities(row, SamplingParams(**kw), seen)
    n = 4000
    counts = np.bincount([sample(row, SamplingParams(seed=s, **kw), seen, s % 5)
                          for s in range(n)], minlength=row.size)
    live = want > 0
    assert counts[~live].sum() == 0
    expected = n * want[live]
    chi2 = float(np.sum((counts[live] - expected) ** 2 / expected))
    assert chi2 < chi2_bound(max(1, int(live.sum()) - 1)), (counts, expected)


def test_the_draw_maps_u_onto_the_probabilities(rng) -> None:
    """Over a fine grid of u the chosen index's frequency is its probability within the grid's
    step: choice_index is the inverse of the filtered distribution's CDF."""
    row = (rng.standard_normal(40) * 2).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=25, top_p=0.9)
    sp = plan(params, row.size)
    values = adjusted(row, sp, np.zeros(0, np.int32))
    ids = candidates(values, sp.candidates)
    m = 20_000
    picks = np.array([choice_index(values[ids], sp, (j + 0.5) / m) for j in range(m)])
    freq = np.bincount(ids[picks], minlength=row.size) / m
    assert np.abs(freq - filtered_probabilities(row, params)).max() <= 1 / m + 1e-9
