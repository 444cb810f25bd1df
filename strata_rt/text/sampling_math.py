"""The arithmetic the sampler and its CUDA kernel share, written so both compute the same bits.

Sampling on the device is only checkable if the kernel and numpy agree exactly, not within a
tolerance: a tolerance on probabilities still lets the two pick different ids when the random
number falls near a boundary. So every step here is built from operations IEEE 754 rounds the
same way everywhere (float32 and float64 +, -, *, / rounded to nearest, shifts and xors of
uint64), each written as one operation, never left to a compiler that could fuse a multiply
and an add; kernels/model/sampling.cu repeats them with explicit rounding intrinsics.

- `uniform(seed, step)`: a counter-based random number in [0, 1), a function of the seed and
  the step only (no generator state to carry or to copy to the device): splitmix64's mixer over
  mix(seed) + (step + 1) * golden gamma, its top 53 bits scaled by 2**-53.
- `exp_nonpositive(x)`: exp(x) for x <= 0 in float64 without the platform's libm (whose last
  bit differs between glibc and CUDA): x = k ln2 + r with k = rint(x / ln2), a degree-13 Taylor
  polynomial of exp(r) by Horner, times 2**k built from its bits. Below -700 it is 0 (the
  weight of a candidate e**-700 times less likely than the best is nothing a double sum sees).
  Relative error about 1e-15: the distribution is the softmax's to far better than any test of
  it can see.
- `inclusive_scan(w)`: prefix sums in the order of a Hillis-Steele scan (step d adds the value
  d places back, d = 1, 2, 4, ...), which a block of GPU threads computes in the same order.
- `ordered_keys(values)`: float32 as uint32 keys whose unsigned order is the floats' order.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
#: splitmix64's increment (2**64 / golden ratio) and its two multipliers
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB

#: 1 / ln 2, and ln 2 split into a high part with zero low bits (k * LN2_HI is exact for the
#: |k| <= 1010 used) and the rest; the same hex literals are in sampling.cu
INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
#: 1/n! for n = 13 down to 1 (Horner's order)
EXP_COEFFS = tuple(float.fromhex(h) for h in (
    "0x1.6124613a86d09p-33", "0x1.1eed8eff8d898p-29", "0x1.ae64567f544e4p-26",
    "0x1.27e4fb7789f5cp-22", "0x1.71de3a556c734p-19", "0x1.a01a01a01a01ap-16",
    "0x1.a01a01a01a01ap-13", "0x1.6c16c16c16c17p-10", "0x1.1111111111111p-7",
    "0x1.5555555555555p-5", "0x1.5555555555555p-3", "0x1.0000000000000p-1",
    "0x1.0000000000000p+0"))
#: where exp_nonpositive gives 0
EXP_CUTOFF = -700.0


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping multiplication)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_2)
    return z ^ (z >> np.uint64(31))


def random_bits(seed: int | np.ndarray, step: int | np.ndarray) -> np.ndarray:
    """uint64 random bits of (seed, step): mix(mix(seed) + (step + 1) * GOLDEN_GAMMA), all
    arithmetic modulo 2**64. Broadcasts over arrays of seeds and steps."""
    with np.errstate(over="ignore"):
        s = np.asarray(np.asarray(seed, dtype=object) & MASK64, dtype=np.uint64)
        t = np.asarray((np.asarray(step, dtype=object) + 1) & MASK64, dtype=np.uint64)
        return _mix64(_mix64(s) + t * np.uint64(GOLDEN_GAMMA))


def uniform(seed: int | np.ndarray, step: int | np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) per (seed, step): the top 53 random bits times 2**-53 (exact)."""
    return (random_bits(seed, step) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def exp_nonpositive(x: np.ndarray) -> np.ndarray:
    """exp(x) for float64 x <= 0 (-inf included), bit for bit what sampling.cu computes; 0
    below EXP_CUTOFF. exp(0) is exactly 1."""
    x = np.asarray(x, dtype=np.float64)
    live = x >= EXP_CUTOFF
    xs = np.where(live, x, 0.0)
    k = np.rint(xs * INV_LN2)
    r = (xs - k * LN2_HI) - k * LN2_LO
    p = np.full_like(r, EXP_COEFFS[0])
    for c in EXP_COEFFS[1:]:
        p = p * r + c
    p = p * r + 1.0
    scale = ((k.astype(np.int64) + 1023) << 52).view(np.float64)
    return np.where(live, p * scale, 0.0)


def inclusive_scan(w: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums of float64 w in Hillis-Steele order: for d = 1, 2, 4, ... below
    len(w), every c[i] with i >= d becomes c[i] + c[i - d] at once. c[i]'s additions depend on
    i only, not on the length, so padding with zeros changes no sum."""
    c = np.array(w, dtype=np.float64)
    d = 1
    while d < c.size:
        c[d:] = c[d:] + c[:-d]
        d *= 2
    return c


def ordered_keys(values: np.ndarray) -> np.ndarray:
    """uint32 keys of float32 values (no NaN) in the same order: a non-negative float's bits
    with the sign bit set, a negative float's bits inverted. +0 and -0 differ here; callers add
    +0.0 first, which makes every zero +0."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    return np.where(bits >> np.uint32(31) == 1, ~bits, bits | np.uint32(0x80000000))


def key_values(keys: np.ndarray) -> np.ndarray:
    """The float32 values of ordered_keys' keys."""
    keys = np.asarray(keys, dtype=np.uint32)
    bits = np.where(keys >> np.uint32(31) == 1, keys ^ np.uint32(0x80000000), ~keys)
    return bits.astype(np.uint32).view(np.float32)
