"""What the Q2 blob and FP16 tests share: layers of sorted activation rows with chosen per-expert
counts, device round trips of a format's gather and MMQ on poisoned buffers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata_rt.formats import QuantFormat
from strata_rt.testing import nmse

__all__ = ["GPU_ROW_CASES", "ROW_CASES", "GroupCase", "make_case", "nmse", "run_mmq", "untouched"]

NAN_BITS = np.uint32(0x7FC00000)


@dataclass
class GroupCase:
    """One MMQ call: a group buffer of n images, the layer's activations and bounds."""

    fmt: QuantFormat
    hidden: int
    ffn: int
    m: int
    k: int
    expert_ids: tuple[int, ...]
    bounds: np.ndarray       # int32 [n_layer_experts + 1]
    x: np.ndarray            # float32 [rows, k], sorted by expert
    image: np.ndarray        # uint8 [n, image_bytes]
    weights: list[np.ndarray]  # float32 [m, k] per group position (the dequantized image)

    @property
    def acts(self):
        return self.fmt.prepare_activations(self.x)

    def rows_hint(self) -> int:
        return int(max((self.bounds[e + 1] - self.bounds[e] for e in self.expert_ids),
                       default=0))

    def group_rows(self) -> np.ndarray:
        """Mask of the activation rows the group's experts own."""
        mask = np.zeros(self.x.shape[0], dtype=bool)
        for e in self.expert_ids:
            mask[self.bounds[e]: self.bounds[e + 1]] = True
        return mask

    def float64_product(self) -> np.ndarray:
        """The exact product of the dequantized weights and the float activations."""
        out = np.zeros((self.x.shape[0], self.m), dtype=np.float64)
        for p, e in enumerate(self.expert_ids):
            r0, r1 = self.bounds[e], self.bounds[e + 1]
            out[r0:r1] = self.x[r0:r1].astype(np.float64) @ self.weights[p].astype(np.float64).T
        return out


def make_case(fmt: QuantFormat, rng: np.random.Generator, hidden: int, ffn: int, part: str,
              counts: list[int], expert_ids: tuple[int, ...]) -> GroupCase:
    """counts: rows of every expert of the layer; expert_ids: the group (ascending ids)."""
    bounds = np.zeros(len(counts) + 1, dtype=np.int32)
    bounds[1:] = np.cumsum(counts)
    images, weights = [], []
    m, k = (2 * ffn, hidden) if part == "gate_up" else (hidden, ffn)
    for _ in expert_ids:
        gu, dn = fmt.images(fmt.random_expert(rng, hidden, ffn), hidden, ffn)
        img = gu if part == "gate_up" else dn
        images.append(np.array(img))
        weights.append(fmt.image_matrix(img, m, k))
    x = rng.standard_normal((int(bounds[-1]), k), dtype=np.float32)
    # a few rows with large outliers and an all-zero 32-group exercise the q8_1 edge cases
    if x.shape[0]:
        x[rng.integers(x.shape[0])] *= 40.0
        x[rng.integers(x.shape[0]), :32] = 0.0
    return GroupCase(fmt, hidden, ffn, m, k, tuple(expert_ids), bounds, x, np.stack(images), weights)


def device_acts(acts) -> np.ndarray:
    """The device bytes of prepared activations (q8_1 blocks, or fp16 rows)."""
    if hasattr(acts, "to_device_bytes"):
        return np.ascontiguousarray(acts.to_device_bytes())
    return np.ascontiguousarray(acts).view(np.uint8).reshape(-1)


def upload(rt, stream, host: np.ndarray):
    buf = rt.alloc(max(host.nbytes, 16))
    if host.nbytes:
        rt.memcpy_htod(buf.ptr, np.ascontiguousarray(host), stream)
    return buf


def run_mmq(rt, case: GroupCase) -> np.ndarray:
    """Runs the format's MMQ on the case, output poisoned with NaN first; returns the output."""
    stream = rt.stream("test")
    kern = case.fmt.kernels(rt, case.fmt.layout(case.hidden, case.ffn))
    out = np.full((max(case.x.shape[0], 1), case.m), np.nan, dtype=np.float32)
    bufs = [upload(rt, stream, a) for a in (case.image.reshape(-1), device_acts(case.acts),
                                            case.bounds, out)]
    try:
        kern.mmq(stream, bufs[0].ptr, case.expert_ids, bufs[1].ptr, bufs[2].ptr, bufs[3].ptr,
                 case.m, case.k, case.rows_hint())
        rt.memcpy_dtoh(out, bufs[3].ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    return out[: case.x.shape[0]]


def untouched(out: np.ndarray, rows: np.ndarray) -> bool:
    """Whether the given output rows still hold the NaN poison bit for bit."""
    return bool((out[rows].view(np.uint32) == NAN_BITS).all())


#: (hidden, ffn, part, rows of each of the layer's experts, the group's expert ids): zero rows,
#: one row, rows not a multiple of a tile, a group of 16 and experts outside the group
ROW_CASES = [
    (256, 128, "gate_up", [5, 0, 1, 70, 3], (0, 1, 2, 3)),
    (128, 256, "down", [0, 64, 17, 2, 1, 0], (1, 2, 5)),
    (256, 128, "down", [3] * 20, tuple(range(2, 18))),
    (384, 256, "gate_up", [130, 1], (0,)),
]
#: plus a group with nothing to do (its output must stay untouched) and a full group of 16
GPU_ROW_CASES = ROW_CASES + [
    (256, 128, "gate_up", [0, 0, 0], (0, 1, 2)),
    (256, 256, "gate_up", list(range(1, 17)) + [0], tuple(range(16))),
]

