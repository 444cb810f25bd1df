"""Runs one fuzz case through the `strata` command and checks what the README promises.

A case is a set of input files (the seeds, one of them mutated), a command line and what is
known of the mutant's validity. Most cases run in this process (`strata_rt.cli.main` with
stdout and stderr captured: about a twentieth of a fresh interpreter's cost), a few as the user
runs them, in a fresh interpreter (`run_subprocess`). Each case gets a folder of its own, so
nothing is shared between cases through paths.

Checked for every case (`Outcome.problems` lists what failed):
  - the exit code is 1 or 2, or 0 with a correct result (`strata run`: its JSON complete,
    every run finite; an invalid prompt the run accepted is a silent wrong answer);
  - a failure prints one message, which names the mutated input, and nothing else: no
    traceback, no numpy or Python warning;
  - under 10 s and 1 GiB (the peak resident memory the case added);
  - no file changed but the named outputs, and the inputs never.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SECONDS = 10.0
MEMORY_BYTES = 1 << 30
#: what the output.json of every seed config names (a run may write it)
OUTPUTS = frozenset({"out.json"})


@dataclass(frozen=True)
class Case:
    """One input set: file name -> bytes, the mutated file, the command and what the run must
    show for a valid mutant."""

    index: int
    kind: str
    files: dict[str, bytes]
    mutated: str
    what: str
    argv: tuple[str, ...]
    #: whether the mutant is still valid: True, False, or None (unknown)
    valid: bool | None = None
    #: outputs the (mutated) config names besides the seeds' own
    outputs: frozenset[str] = frozenset()
    #: ids a generated token must lie below (whole models)
    vocab: int | None = None

    def describe(self) -> str:
        return (f"case {self.index} ({self.kind}): {self.mutated}: {self.what}; "
                f"strata {' '.join(self.argv)}")


@dataclass
class Outcome:
    case: Case
    rc: int | None
    seconds: float
    peak_bytes: int
    stdout: str
    stderr: str
    problems: list[str] = field(default_factory=list)
    #: the reason from known.py when every problem is a known failure in another area
    known: str | None = None


class CaseTimeout(BaseException):
    """Raised into a case that ran past SECONDS (a BaseException: the CLI must not catch it)."""


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "<dir>" for p in sorted(folder.rglob("*"))}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Resets this process's peak resident size (Linux: clear_refs 5); False when it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _on_alarm(signum: int, frame: object) -> None:
    raise CaseTimeout()


def _write_inputs(case: Case, folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, data in case.files.items():
        (folder / name).write_bytes(data)


def run_in_process(case: Case, folder: Path) -> Outcome:
    """The case through strata_rt.cli.main in this process, in `folder` (created)."""
    from strata_rt.cli import main

    _write_inputs(case, folder)
    before = _snapshot(folder)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    limits = resource.getrlimit(resource.RLIMIT_AS)
    # a guard for the machine, well above the bound checked below: an allocation past it
    # fails as MemoryError, which the CLI reports as "out of host memory"
    cap = _status_kib("VmSize") * 1024 + 2 * MEMORY_BYTES
    rss0 = _status_kib("VmRSS") * 1024
    peak_known = _reset_peak()
    rc: int | None = None
    problems: list[str] = []
    old_alarm = signal.signal(signal.SIGALRM, _on_alarm)
    t0 = time.perf_counter()
    try:
        os.chdir(folder)
        if limits[1] == resource.RLIM_INFINITY or limits[1] > cap:
            resource.setrlimit(resource.RLIMIT_AS, (cap, limits[1]))
        signal.setitimer(signal.ITIMER_REAL, SECONDS)
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                rc = main(list(case.argv))
            except SystemExit as e:  # argparse's usage errors exit 2 with their message
                rc = e.code if isinstance(e.code, int) else 1
            except CaseTimeout:
                problems.append(f"ran past {SECONDS:g} s")
            except BaseException as e:  # noqa: B036  (what escaped the CLI is the finding)
                import traceback

                problems.append("traceback: " + "".join(
                    traceback.format_exception_only(type(e), e)).strip()[:300]
                    + f" (at {_innermost(e)})")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        seconds = time.perf_counter() - t0
        resource.setrlimit(resource.RLIMIT_AS, limits)
        os.chdir(cwd)
    peak = (_status_kib("VmHWM") * 1024 - rss0) if peak_known else 0
    for w in caught:
        problems.append(f"a Python warning reached the user: {w.category.__name__}: "
                        f"{str(w.message)[:120]} ({Path(w.filename).name}:{w.lineno})")
    outcome = Outcome(case, rc, seconds, peak, out.getvalue(), err.getvalue(), problems)
    check(outcome, folder, before)
    return outcome


def _innermost(e: BaseException) -> str:
    tb = e.__traceback__
    where = "?"
    while tb is not None:
        code = tb.tb_frame.f_code
        if "strata_rt" in code.co_filename or "site-packages" in code.co_filename:
            where = f"{Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return where


def _high_water(pid: int) -> int:
    """Bytes of the process's peak resident memory so far (VmHWM: its own address space's,
    so unlike wait4's ru_maxrss it does not count the parent's pages a fork copied before
    exec - a test process grown large would make every child look large), 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_subprocess(case: Case, folder: Path) -> Outcome:
    """The case as a user runs it: `python -m strata_rt.cli` in a fresh interpreter, its peak
    resident memory sampled from /proc every 20 ms while it runs."""
    _write_inputs(case, folder)
    before = _snapshot(folder)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    streams = folder.parent / f"{folder.name}.streams"
    streams.mkdir()
    with open(streams / "out", "w+b") as fo, open(streams / "err", "w+b") as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "strata_rt.cli", *case.argv], cwd=folder,
                             stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env)
        timer = threading.Timer(SECONDS, p.kill)
        timer.start()
        peak = 0
        try:
            while p.poll() is None:  # the child's own high-water mark, while it lives
                peak = max(peak, _high_water(p.pid))
                time.sleep(0.02)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        stdout, stderr = fo.read().decode(errors="replace"), fe.read().decode(errors="replace")
    problems = [f"ran past {SECONDS:g} s (killed)"] if p.returncode == -signal.SIGKILL else []
    if "Traceback (most recent call last)" in stderr:
        problems.append("traceback: " + stderr.strip().splitlines()[-1][:300])
    outcome = Outcome(case, p.returncode, seconds, peak, stdout, stderr, problems)
    check(outcome, folder, before)
    return outcome


def _messages(stderr: str) -> list[str]:
    """The messages on stderr: lines that start with `strata`, warnings left out (the lines
    after one continue it: a config's problems, the YAML parser's account of a syntax error).
    Tracebacks and Python warnings are caught on their own."""
    return [line for line in stderr.splitlines()
            if line.startswith("strata") and not line.startswith("strata: warning:")]


def check(o: Outcome, folder: Path, before: dict[str, str]) -> None:
    """Adds to o.problems every promise the case broke."""
    case = o.case
    after = _snapshot(folder)
    allowed = OUTPUTS | case.outputs
    # the folders an output names are made for it (as `mkdir -p` would)
    allowed |= {str(parent) for out in allowed for parent in Path(out).parents
                if str(parent) != "."}
    for name in sorted(set(before) | set(after)):
        if before.get(name) == after.get(name):
            continue
        if name in case.files:
            o.problems.append(f"input {name} was changed or removed")
        elif name not in allowed:
            o.problems.append(f"file {name} was {'left' if name in after else 'removed'}")
    if o.seconds > SECONDS and not any("ran past" in p for p in o.problems):
        o.problems.append(f"took {o.seconds:.1f} s")
    if o.peak_bytes > MEMORY_BYTES:
        o.problems.append(f"peak memory grew by {o.peak_bytes / 2**20:,.0f} MiB")
    if "out of host memory" in o.stderr:
        o.problems.append("an allocation failed (over the memory bound): " + o.stderr[:200])
    if "Traceback" in o.stderr and not any(p.startswith("traceback") for p in o.problems):
        o.problems.append("traceback printed: " + o.stderr.strip().splitlines()[-1][:300])
    if o.rc is None:
        return
    if o.rc == 0:
        _check_success(o, folder)
        return
    if o.rc not in (1, 2):
        o.problems.append(f"exit {o.rc}")
    messages = _messages(o.stderr)
    if len(messages) != 1:
        o.problems.append(f"{len(messages)} messages on stderr: {messages[:3]}")
    if messages and not messages[0].startswith("strata"):
        o.problems.append(f"the message is not strata's: {messages[0][:200]!r}")
    # a config's mutant may point a key at another input: naming that one names the input
    names = set(case.files) if case.kind.startswith("config") else {case.mutated}
    if not any(n in o.stderr for n in names):
        o.problems.append(f"the message does not name {case.mutated}: {o.stderr[:300]!r}")


def _check_success(o: Outcome, folder: Path) -> None:
    """Exit 0: the mutant must have been valid and the result correct."""
    case = o.case
    if case.valid is False:
        o.problems.append(f"exit 0 on an invalid input {case.mutated} ({case.what}): a "
                          "silent wrong answer")
    if "run" in case.argv:
        doc_path = folder / "out.json"
        if doc_path.exists():
            try:
                doc = json.loads(doc_path.read_text())
            except ValueError as e:
                o.problems.append(f"out.json is not JSON: {e}")
                return
            runs = doc.get("runs") or []
            if doc.get("complete") is not True or not runs:
                o.problems.append("exit 0 but out.json is not complete")
            for r in runs:
                ids = r.get("generated_ids") or []
                if case.vocab is not None and any(not 0 <= i < case.vocab for i in ids):
                    o.problems.append(f"generated ids outside the vocabulary: {ids}")
        elif "| prompt |" not in o.stdout:
            o.problems.append("exit 0 without a result table or JSON")
