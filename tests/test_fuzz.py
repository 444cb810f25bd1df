"""The hostile-input fuzzer (tests/_fuzz): seeded mutants of GGUF files (header, key table,
tensor table, data), run configs and prompt files through `strata run` and `strata inspect`,
each checked for the README's promises (see tests/_fuzz/harness.py).

2,000 cases per run by default, in process, plus a few in fresh interpreters; FUZZ_PROFILE=long
runs 50,000 (FUZZ_CASES=N any other count; FUZZ_SEED=S another stream: the default is fixed, so
CI runs the same cases every time). A failure prints each case's description, enough to rebuild
it alone with `_fuzz.cases.case(index, seed)`. Failures in areas other branches are fixing are
listed in tests/_fuzz/known.py and pass as known."""

from __future__ import annotations

import collections
import os
import random
import shutil
import time
from pathlib import Path

import pytest
from _fuzz import known
from _fuzz.cases import case, seeds
from _fuzz.harness import Case, Outcome, check, run_in_process, run_subprocess

LONG = os.environ.get("FUZZ_PROFILE") == "long"
CASES = int(os.environ.get("FUZZ_CASES") or (50_000 if LONG else 2_000))
SEED = int(os.environ.get("FUZZ_SEED") or 20261201)
#: cases that also run as a user runs them, in a fresh interpreter (about 1 s each)
SUBPROCESS_CASES = 100 if LONG else 6
#: failing cases shown in full
SHOWN = 15


def _report(outcomes: list[Outcome], seconds: float, label: str) -> str:
    by_kind = collections.Counter((o.case.kind, o.rc) for o in outcomes)
    known_n = sum(o.known is not None for o in outcomes)
    slowest = max(outcomes, key=lambda o: o.seconds)
    lines = [f"{label}: {len(outcomes)} cases (seed {SEED}) in {seconds:.1f} s; {known_n} "
             f"known failures; slowest {slowest.seconds:.2f} s (case {slowest.case.index}); "
             f"largest peak {max(o.peak_bytes for o in outcomes) / 2**20:.0f} MiB",
             "exit codes: " + ", ".join(f"{k} {rc}: {n}" for (k, rc), n in sorted(
                 by_kind.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))))]
    return "\n".join(lines)


def _failures(outcomes: list[Outcome]) -> list[str]:
    bad = [o for o in outcomes if o.problems and o.known is None]
    return [f"{o.case.describe()}\n  exit {o.rc}; " + "\n  ".join(o.problems)
            + f"\n  stderr: {o.stderr[:400]!r}" for o in bad[:SHOWN]] + (
        [f"... and {len(bad) - SHOWN} more"] if len(bad) > SHOWN else [])


def _run(cases: list[Case], runner, root: Path) -> list[Outcome]:
    outcomes = []
    for c in cases:
        folder = root / f"case{c.index}"
        o = runner(c, folder)
        o.known = known.known_reason(c.what, o.problems)
        outcomes.append(o)
        if not o.problems:  # keep what failed for a look afterwards
            shutil.rmtree(folder)
            shutil.rmtree(root / f"case{c.index}.streams", ignore_errors=True)
    return outcomes


def test_fuzz_cases_in_process(tmp_path, capsys):
    """Every case keeps every promise, or fails in a way known.py lists."""
    seeds()  # built once, outside the timing
    t0 = time.perf_counter()
    outcomes = _run([case(i, SEED) for i in range(CASES)], run_in_process, tmp_path)
    seconds = time.perf_counter() - t0
    stale = set(range(len(known.KNOWN))) - set().union(
        *(known.used(o.case.what, o.problems) for o in outcomes))
    with capsys.disabled():
        print("\n" + _report(outcomes, seconds, "fuzz, in process"))
        for i in sorted(stale):  # a fix landed: the entry can go
            print(f"known failure no longer seen (remove it from known.py): "
                  f"{known.KNOWN[i].area}: {known.KNOWN[i].reason}")
    failures = _failures(outcomes)
    assert not failures, "\n".join(failures)
    kinds = {o.case.kind for o in outcomes}
    assert len(kinds) == 6 or CASES < 100, kinds


def test_fuzz_cases_as_a_user_runs_them(tmp_path, capsys):
    """A spread of the same cases in fresh interpreters: the same promises, with the peak
    memory of the whole process (interpreter and imports included) under 1 GiB."""
    step = max(1, CASES // SUBPROCESS_CASES)
    picked = [case(i, SEED) for i in range(0, CASES, step)][:SUBPROCESS_CASES]
    t0 = time.perf_counter()
    outcomes = _run(picked, run_subprocess, tmp_path)
    with capsys.disabled():
        print("\n" + _report(outcomes, time.perf_counter() - t0, "fuzz, subprocesses"))
    failures = _failures(outcomes)
    assert not failures, "\n".join(failures)
    assert all(o.peak_bytes > 0 for o in outcomes), "wait4 reported no memory"


def test_the_seeds_run_clean(tmp_path):
    """Unmutated, every seed passes with exit 0 (else each mutant's verdict means nothing)."""
    files = seeds().files
    for i, argv in enumerate([("-q", "run", "run.yaml"), ("-q", "run", "whole.yaml"),
                              ("-q", "inspect", "m.gguf"), ("-q", "inspect", "w.gguf")]):
        c = Case(i, "seed", dict(files), argv[-1], "unmutated", argv, True, vocab=64)
        o = run_in_process(c, tmp_path / f"seed{i}")
        assert o.rc == 0 and not o.problems, (argv, o.problems, o.stderr)


#: cases of other seeds that once broke a promise (each mended in the product or the harness)
REGRESSIONS = [(20261207, 718), (20261207, 2167), (20261207, 3070), (20261207, 3316),
               (20261207, 8413), (20261208, 5300), (20261211, 3821), (20261211, 5701),
               (20261211, 9903), (20261212, 3717), (20261213, 2330),
               (20261219, 961), (20261222, 8275)]


@pytest.mark.parametrize("seed, index", REGRESSIONS)
def test_cases_that_once_failed(tmp_path, seed, index):
    c = case(index, seed)
    o = run_in_process(c, tmp_path / "case")
    assert not o.problems, f"{c.describe()}: {o.problems} {o.stderr[:300]!r}"


def test_a_text_edit_of_a_config_cut_to_nothing():
    """An edit after a cut to nothing: duplicating a line found none to copy, and building
    the case raised (the whole run of a seed stopped there)."""
    from _fuzz.text_mutators import _text_edit

    for s in range(64):
        assert isinstance(_text_edit("", random.Random(s)), str)


def test_cases_are_reproducible():
    """A case is a function of (index, seed): a failure's description rebuilds it alone."""
    a, b = case(17, SEED), case(17, SEED)
    assert a.files == b.files and a.what == b.what and a.argv == b.argv
    assert case(17, SEED + 1).files != a.files or case(17, SEED + 1).what != a.what


@pytest.mark.parametrize("rc, stderr, files, want", [
    (3, "strata run: x.gguf: bad\n", {}, "exit 3"),
    (1, "strata run: x.gguf: bad\nstrata run: again x.gguf\n", {}, "2 messages"),
    (1, "strata run: something else\n", {}, "does not name x.gguf"),
    (1, "Traceback (most recent call last):\nValueError: x.gguf\n", {}, "traceback"),
    (1, "strata run: x.gguf: bad\n", {"stray.tmp": b"x"}, "file stray.tmp was left"),
    (1, "strata run: x.gguf: bad\n", {"x.gguf": b"changed"}, "input x.gguf was changed"),
    (0, "", {}, "exit 0 on an invalid input"),
])
def test_the_checks_catch_each_broken_promise(tmp_path, rc, stderr, files, want):
    """The harness's verdict on made-up outcomes: each broken promise is reported."""
    c = Case(0, "gguf-moe", {"x.gguf": b"GGUF"}, "x.gguf", "made up", ("-q", "inspect",
                                                                          "x.gguf"), False)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    from _fuzz.harness import _snapshot

    before = _snapshot(tmp_path)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    o = Outcome(c, rc, 0.1, 0, "", stderr)
    check(o, tmp_path, before)
    assert any(want in p for p in o.problems), o.problems
    o = Outcome(c, 1, 0.1, 0, "", "strata inspect: x.gguf: bad magic\n")
    check(o, tmp_path, _snapshot(tmp_path))
    assert o.problems == [], "a good refusal passes"
