"""Every loaded format (plugins.yaml and entry points, the test plugin included) against the
conformance suite: CPU checks always, GPU checks with a device."""

from __future__ import annotations

import pytest

from strata_rt.errors import PluginError
from strata_rt.registry import registry
from strata_rt.testing import ConformanceSkip, Subject, conformance_cases, run_conformance


def _loaded():
    try:
        reg = registry()
    except PluginError as e:
        return [], str(e)
    return [reg[name] for name in reg.names()], ""


FORMATS, LOAD_ERROR = _loaded()
_SUBJECTS: dict[str, Subject] = {}


def _subject(fmt) -> Subject:
    """One subject per format per session, so the checks share their inputs."""
    if fmt.name not in _SUBJECTS:
        _SUBJECTS[fmt.name] = Subject(fmt)
    return _SUBJECTS[fmt.name]


def _params(gpu: bool):
    return [pytest.param(fmt, case, id=f"{fmt.name}-{case.name}")
            for fmt in FORMATS for case in conformance_cases(fmt) if case.gpu == gpu]


def _run(subject: Subject, case) -> None:
    try:
        detail = case.run(subject)
    except ConformanceSkip as e:
        pytest.skip(str(e))
    print(f"{subject.fmt.name} {case.name}: {detail}")


def test_registry_loads_with_test_plugin():
    assert not LOAD_ERROR, LOAD_ERROR
    assert "test_i8" in [f.name for f in FORMATS], "the entry point test plugin did not load"


@pytest.mark.parametrize("fmt, case", _params(gpu=False))
def test_conformance_cpu(fmt, case):
    _run(_subject(fmt), case)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, case", _params(gpu=True))
def test_conformance_gpu(fmt, case, rt):
    subject = _subject(fmt)
    subject.runtime = rt
    _run(subject, case)


def test_report_counts_failures_and_skips():
    """run_conformance keeps going past a failing check and says which one failed."""
    test_i8 = next(f for f in FORMATS if f.name == "test_i8")

    class Broken(type(test_i8)):
        name = "broken_i8"
        roundtrip_nmse = 1e-12  # no int8 format meets this

    report = run_conformance(Broken(), seed=7)
    status = {r.name: r.status for r in report.results}
    assert status["roundtrip"] == "fail" and status["sizes"] == "pass"
    assert status["gpu_gather"] == "skip"
    assert not report.ok
    assert "broken_i8 FAILS" in str(report) and "seed 7" in str(report)
