"""How an engine's output on the llama.cpp-made fixtures (tests/fixtures/ggml_mixes) is judged
against transformers' (make_ggml_fixtures.py goldens). Not a test yet: the engine's readers for
several of these types are being written; a test wires `compare_with_golden` to the engine.

Both sides read the same file and dequantize the same blocks, so what differs is arithmetic
only (summation order, fp16 activations on the GPU), and the bounds are those of the other
transformers parity tests:

- logits: NMSE (sum of squared differences over sum of squares, over every position and token
  of a prompt) at most 1e-5 on the reference backend, 1e-4 on the GPU (fp16 activations).
  Positions at or after a routing near-tie (transformers' float64 gap between the k-th and
  k+1-th router logit below ROUTE_TIE of the token's router-logit RMS, at some layer) are left
  out and counted: there rounding may pick another expert, a different model from there on,
  which no kernel can prevent (tests/test_routing_parity_gpu.py measured this);
- argmax: equal at every kept position where transformers' float64 top-2 margin exceeds 1e-3
  (below that either token is a right answer);
- greedy: the 24 greedy tokens after the 64-token prompt equal transformers', up to the first
  step whose float64 margin is at most 1e-3 (after a legitimate fork the continuations differ);
- perplexity of eval.txt in llama-perplexity's scheme (chunks of 128 tokens from an empty
  cache, the second half of each scored): within 1e-4 relative of transformers'. (The
  manifest also holds llama-perplexity's own estimate; it is not a bound: llama.cpp's CPU
  rounds activations to 8 bits for quantized products, 0.1-0.5 % off transformers here.)

Wiring it to the engine takes an open engine and two closures, e.g.:

    eng = Engine.open({"model": {"gguf": str(FIXTURES / fname), "format": "fp16"},
                       "backend": "reference"})
    def logits_fn(ids):
        eng.reset()
        return eng.prefill(np.asarray(ids, np.int64), all_logits=True)[0]
    def greedy_fn(ids, n):
        return greedy(EngineSession(eng), ids, n, eos_id=None).ids   # strata_rt.text.generate
    compare_with_golden(fname, logits_fn, greedy_fn, backend="reference").check()
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ggml_mixes"
NMSE_BOUND = {"reference": 1e-5, "gpu": 1e-4}
#: routing gaps (relative to the router-logit RMS) within reach of each backend's rounding
ROUTE_TIE = {"reference": 1e-4, "gpu": 2e-3}
MARGIN = 1e-3
PPL_RTOL = 1e-4


@dataclass
class Comparison:
    """What `compare_with_golden` found: `problems` empty means the engine passes; `notes`
    say what was left out and the measured errors."""

    fixture: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.problems:
            raise AssertionError(f"{self.fixture}: " + "; ".join(self.problems))


def manifest(fixtures: Path = FIXTURES) -> dict:
    return json.loads((fixtures / "manifest.json").read_text())


def load_golden(fname: str, fixtures: Path = FIXTURES) -> dict[str, np.ndarray]:
    """The arrays of one fixture's golden (`fname` as the manifest names the GGUF)."""
    with np.load(fixtures / (Path(fname).stem + ".npz")) as z:
        return {k: z[k] for k in z.files}


def prompts(golden: dict[str, np.ndarray]) -> list[str]:
    return sorted(k.removeprefix("ids_") for k in golden if k.startswith("ids_"))


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    return float(((np.asarray(got, np.float64) - want) ** 2).sum() / (want * want).sum())


def perplexity(logits_fn: Callable[[np.ndarray], np.ndarray], ids: np.ndarray,
               ctx: int) -> float:
    """llama-perplexity's scheme through `logits_fn` (ids -> float logits [tokens, vocab] from
    an empty cache): whole chunks of `ctx`, positions ctx/2 .. ctx-2 predicting the next."""
    first, nll, count = ctx // 2, 0.0, 0
    for c in range(len(ids) // ctx):
        chunk = np.asarray(ids[c * ctx:(c + 1) * ctx])
        lg = np.asarray(logits_fn(chunk), np.float64)[first:ctx - 1]
        lg = lg - lg.max(axis=-1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=-1, keepdims=True))
        nll -= lp[np.arange(len(lp)), chunk[first + 1:ctx]].sum()
        count += len(lp)
    return float(np.exp(nll / count))


def compare_with_golden(fname: str, logits_fn: Callable[[np.ndarray], np.ndarray],
                        greedy_fn: Callable[[np.ndarray, int], np.ndarray], *,
                        backend: str = "reference", ppl: float | None = None,
                        fixtures: Path = FIXTURES) -> Comparison:
    """Judges an engine on one fixture by the criteria of the module doc. `logits_fn(ids)`:
    float logits [tokens, vocab] of a prompt from an empty cache; `greedy_fn(ids, n)`: n
    greedy tokens after it; `ppl`: the engine's own perplexity of eval.txt (its perplexity
    command) or None to compute it through `logits_fn`. `backend` picks the bounds:
    "reference" or "gpu"."""
    golden = load_golden(fname, fixtures)
    info = manifest(fixtures)
    out = Comparison(fname)
    bound, tie = NMSE_BOUND[backend], ROUTE_TIE[backend]
    for p in prompts(golden):
        ids, want = golden[f"ids_{p}"], golden[f"logits_{p}"]
        got = np.asarray(logits_fn(ids))
        if got.shape != want.shape:
            out.problems.append(f"{p}: logits of shape {got.shape}, expected {want.shape}")
            continue
        ties = np.flatnonzero(golden[f"route_gap64_{p}"] < tie)
        keep = int(ties[0]) if len(ties) else len(ids)
        if keep < len(ids):
            out.notes.append(f"{p}: positions {keep}.. left out (routing near-tie, gap "
                             f"{golden[f'route_gap64_{p}'][keep]:.2e})")
        if keep == 0:
            continue
        err = nmse(got[:keep], want[:keep])
        out.notes.append(f"{p}: NMSE {err:.2e} over {keep} positions")
        if not err <= bound:
            out.problems.append(f"{p}: logits NMSE {err:.2e} > {bound:g}")
        decisive = np.flatnonzero(golden[f"margin64_{p}"][:keep] > MARGIN)
        wrong = decisive[np.argmax(got[decisive], axis=-1) != golden[f"argmax64_{p}"][decisive]]
        if len(wrong):
            out.problems.append(f"{p}: argmax differs at positions {wrong.tolist()} (float64 "
                                f"margins > {MARGIN:g})")
    want_greedy = golden["greedy"]
    steps = np.flatnonzero(golden["greedy_margin64"] <= MARGIN)
    n_strict = int(steps[0]) if len(steps) else len(want_greedy)
    got_greedy = np.asarray(greedy_fn(golden[f"ids_{info['greedy']['prompt']}"],
                                      len(want_greedy)))
    if got_greedy.shape != want_greedy.shape or \
            not np.array_equal(got_greedy[:n_strict], want_greedy[:n_strict]):
        out.problems.append(f"greedy tokens {got_greedy.tolist()}, transformers "
                            f"{want_greedy.tolist()} (compared up to step {n_strict})")
    if ppl is None:
        ppl = perplexity(logits_fn, golden["ppl_ids"], info["perplexity"]["ctx"])
    want_ppl = float(golden["ppl"])
    rel = abs(ppl - want_ppl) / want_ppl
    out.notes.append(f"perplexity {ppl:.6f} vs {want_ppl:.6f} ({rel:.1e} relative)")
    if not rel <= PPL_RTOL:
        out.problems.append(f"perplexity {ppl:.6f}, transformers {want_ppl:.6f} ({rel:.1e} "
                            f"relative > {PPL_RTOL:g})")
    return out
