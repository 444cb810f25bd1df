"""The token embedding looked up on the GPU (kernels/ggml/rows.cu, strata_rt.gemm.ggml_rows).

The row gather of every GGML type: a matrix the gguf package quantizes (random values at
scales 1e-3 .. 1e3) or, for the types it cannot quantize, random valid blocks (finite scales),
uploaded at an odd address, rows picked by random int32 ids on the device (repeats, the first
and the last row among them) into a float32 buffer poisoned with a NaN no decoder gives, and
compared with gguf.quants.dequantize of those rows byte for byte; nothing past the rows is
written; an id outside the matrix gives a NaN row and reads nothing. Then whole models: a
prefill (several chunks, all logits) and decode steps whose token ids are looked up on the
GPU give the logits of the host path (rows decoded on the host and uploaded) byte for byte, on
GGUF fixtures written by llama.cpp (Q4_K, Q3_K, IQ3_S and BF16 embeddings) and on a synthetic
tied model (the rows read from the head's bytes), on one device and split over two parts.

Run: python -m pytest -q -m gpu tests/test_embedding_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from _ggml_blocks import row_ids, row_matrix

from strata_rt.engine import Engine, EngineConfig
from strata_rt.formats.ggml_types import TYPES, GgmlType, ggml_type
from strata_rt.gemm.ggml_rows import GgmlRows, rows_reference
from strata_rt.models.qwen3 import Qwen3Model
from strata_rt.models.qwen3.spec import TINY_SPEC
from strata_rt.schedule.plan import ChunkInput

sys.path.insert(0, str(Path(__file__).parent / "tools"))
from ggml_fixture_checks import FIXTURES  # noqa: E402

pytestmark = pytest.mark.gpu
#: every output word starts as this NaN (no decoder writes its payload): a value the gather
#: did not write is never mistaken for one it did
POISON = np.uint32(0x7FBADBAD)
IDS = [t.name for t in TYPES]


@pytest.fixture(scope="module")
def rows(rt) -> GgmlRows:
    return GgmlRows(rt)


def run_rows(rt, rows: GgmlRows, t: GgmlType, table: np.ndarray, ids: np.ndarray, cols: int,
             pad: int = 64) -> np.ndarray:
    """One launch over `table` uploaded 3 bytes past an allocation's start (the gather reads
    bytes: any alignment) into a poisoned buffer of len(ids) * cols + pad words; returns the
    buffer as uint32."""
    stream = rt.stream("test")
    vocab = table.shape[0]
    flat = np.ascontiguousarray(table).view(np.uint8).reshape(-1)
    src = np.zeros(flat.size + 19, np.uint8)
    src[3: 3 + flat.size] = flat
    ids32 = np.ascontiguousarray(ids, dtype=np.int32)
    out = np.full(ids32.size * cols + pad, POISON, np.uint32)
    bufs = [rt.alloc(a.nbytes) for a in (src, ids32, out)]
    try:
        for b, a in zip(bufs, (src, ids32, out)):
            rt.memcpy_htod(b.ptr, a, stream)
        rows.rows(stream, t, bufs[0].ptr + 3, bufs[1].ptr, bufs[2].ptr, ids32.size, vocab, cols)
        rt.memcpy_dtoh(out, bufs[2].ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    return out


def assert_rows(t: GgmlType, out: np.ndarray, table: np.ndarray, ids: np.ndarray,
                cols: int) -> None:
    n = ids.size * cols
    want = rows_reference(t, table, ids, cols).reshape(-1)
    got = out[:n]
    inside = np.repeat((ids >= 0) & (ids < table.shape[0]), cols)
    bad = np.flatnonzero(got[inside] != want[inside].view(np.uint32))
    assert bad.size == 0, (f"{t.name}: {bad.size} of {int(inside.sum())} values differ; first: "
                           f"got {got[inside][bad[0]]:#x}, gguf "
                           f"{want[inside].view(np.uint32)[bad[0]]:#x}")
    assert np.isnan(got[~inside].view(np.float32)).all()
    assert (got[~inside] != POISON).all(), f"{t.name}: a row outside the matrix was not written"
    assert (out[n:] == POISON).all(), f"{t.name}: words past the rows written"


@pytest.mark.parametrize("name", IDS)
def test_rows_of_every_type_are_gguf_bit_for_bit(rt, rows, rng, name):
    t = ggml_type(name)
    vocab, cols = 300, 512
    table = row_matrix(rng, t, vocab, cols)
    ids = row_ids(rng, vocab, 200)
    out = run_rows(rt, rows, t, table, ids, cols)
    assert_rows(t, out, table, ids, cols)
    assert np.isfinite(out[: ids.size * cols].view(np.float32)).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS", "BF16"])
def test_an_id_outside_the_matrix_gives_a_nan_row_and_no_fault(rt, rows, rng, name):
    t = ggml_type(name)
    vocab, cols = 64, 256
    table = row_matrix(rng, t, vocab, cols)
    ids = np.concatenate([row_ids(rng, vocab, 20), [-1, vocab, 2**31 - 1, -(2**31)]])
    ids = rng.permutation(ids)
    assert_rows(t, run_rows(rt, rows, t, table, ids, cols), table, ids, cols)


def test_more_rows_than_one_launch_has_threads(rt, rows, rng):
    """5,000 rows of 2,048 values: more 8-value steps than ROWS_MAX_BLOCKS blocks of threads,
    so each thread strides over several."""
    t = ggml_type("Q4_K")
    vocab, cols = 64, 2048
    table = row_matrix(rng, t, vocab, cols)
    ids = row_ids(rng, vocab, 5000)
    assert_rows(t, run_rows(rt, rows, t, table, ids, cols), table, ids, cols)


# ---------------------------------------------------------------------------- whole models
def _run(model: object, embedding: str, prompt: np.ndarray, **kw) -> dict:
    """A prefill of several chunks (all logits) and four decode steps on the CUDA backend,
    every plan checked."""
    cfg = EngineConfig(model=model, backend="cuda", embedding=embedding, prefill=64,
                       check_plan=True, **kw)  # type: ignore[arg-type]
    with Engine.open(cfg) as eng:
        assert eng.backend is not None
        kind = eng.backend.input_kind
        logits, _ = eng.prefill(prompt, all_logits=True)
        plan = eng.driver.last_plan  # a split's: the last part's, which receives
        inputs = ([op for _, op in plan.ops() if isinstance(op, ChunkInput)]
                  if len(kw.get("devices", [0])) == 1 else None)
        steps = [eng.prefill(np.array([t]))[0] for t in (0, 511, 17, 17)]
    return {"kind": kind, "logits": logits, "steps": steps, "inputs": inputs}


def _assert_same(dev: dict, host: dict) -> None:
    assert (dev["kind"], host["kind"]) == ("tokens", "hidden")
    if dev["inputs"] is not None:
        assert dev["inputs"] == [ChunkInput("tokens")] and host["inputs"] == [ChunkInput()]
    assert dev["logits"].tobytes() == host["logits"].tobytes()
    for i, (a, b) in enumerate(zip(dev["steps"], host["steps"])):
        assert a.tobytes() == b.tobytes(), f"decode step {i}"


@pytest.mark.parametrize("fname", ["Q4_K_M.gguf", "Q3_K_M.gguf", "IQ2_M-imatrix.gguf",
                                   "BF16.gguf"])
def test_a_gguf_prefill_gives_the_host_paths_logits_byte_for_byte(rng, fname):
    """Q4_K_M.gguf holds a Q4_K embedding (and a Q6_K head of its own), Q3_K_M a Q3_K one,
    IQ2_M an IQ3_S one, BF16 a BF16 one."""
    model = {"gguf": str(FIXTURES / fname)}
    prompt = rng.integers(0, 512, 150)
    _assert_same(_run(model, "device", prompt), _run(model, "host", prompt))


@pytest.mark.parametrize("devices", [[0], [0, 0]])
def test_a_tied_model_reads_its_rows_from_the_head(rng, devices):
    """Tied: on one device the rows come from the head's bytes; split over two parts the first
    part (which holds no head) keeps its own copy. Both give the host path's bytes."""
    model = Qwen3Model.synthetic(TINY_SPEC, 5, "fp16", tied=True, dense_type="Q8_0")
    prompt = rng.integers(0, TINY_SPEC.vocab, 150)
    kw = {"context": 512, "devices": devices, "repeat_devices": len(devices) > 1}
    _assert_same(_run(model, "device", prompt, **kw), _run(model, "host", prompt, **kw))
