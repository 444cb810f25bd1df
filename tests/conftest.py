"""Shared fixtures: one CUDA runtime per session, fresh seeded randomness per test, and the
test plugin published through an entry point.

GPU tests carry `@pytest.mark.gpu`; without a device they are skipped with the reason (shown
by `-ra`), never silently deselected.
"""

from __future__ import annotations

import os

# The reference backend does many small matrix products; on a 2-core machine a multi-threaded
# BLAS fights the test process for the cores and runs them many times slower. Set before numpy
# loads its BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Conversions a test asks for are cached in a folder of the session, never the user's cache
# (the CLI tests' fresh interpreters inherit it).
os.environ.setdefault("STRATA_CONVERT_CACHE", __import__("tempfile").mkdtemp(
    prefix="strata-convert-"))

import sys  # noqa: E402
import tempfile  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest
from hypothesis import settings

from strata_rt.runtime import Runtime, cuda_available

# Property tests draw this many examples unless they fix their own count: 2,000 per CI run;
# `pytest --hypothesis-profile strata-long tests/test_plan_hazards.py` draws 20,000.
settings.register_profile("strata", max_examples=2000)
settings.register_profile("strata-long", max_examples=20000)
settings.load_profile("strata")

TESTFMT_PROJECT = Path(__file__).resolve().parent / "plugins" / "strata_testfmt"
TESTFMT_DIST = "strata-testfmt"


def _publish_testfmt() -> str:
    """Makes the test plugin's entry point visible to importlib.metadata.

    CI installs it (`pip install ./tests/plugins/strata_testfmt`); where it is not installed
    the same distribution metadata an install would write is placed on sys.path, so the
    registry still finds it only through the entry point group. Returns how it was found."""
    try:
        metadata.distribution(TESTFMT_DIST)
        return "installed"
    except metadata.PackageNotFoundError:
        pass
    site = Path(tempfile.mkdtemp(prefix="strata_testfmt_site_"))
    info = site / "strata_testfmt-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {TESTFMT_DIST}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[strata_rt.quants]\ntest_i8 = strata_testfmt\n")
    sys.path[:0] = [str(site), str(TESTFMT_PROJECT)]
    return "metadata on sys.path"


TESTFMT_HOW = _publish_testfmt()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", type=int, default=None,
                     help="seed the `rng` fixture (default: fresh from os.urandom per test)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    ok, why = cuda_available()
    return [f"strata_rt CUDA: {why}" if ok else f"strata_rt CUDA: none ({why})",
            f"strata_rt test plugin: {TESTFMT_HOW}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, why = cuda_available()
    if not ok:
        skip = pytest.mark.skip(reason=f"no CUDA: {why}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rt():
    """The session's Runtime (one context for all GPU tests)."""
    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA: {why}")
    runtime = Runtime.open()
    yield runtime
    runtime.close()


#: the original fixed streaming rule (staging ring below 1,024 tokens, the walk from there)
FIXED_WALK_TOKENS = 1024


@pytest.fixture
def fixed_walk_rule(monkeypatch: pytest.MonkeyPatch) -> int:
    """For tests that name prompt sizes by the fixed rule instead of the engine's default
    (the routed share, planner.takes_walk): STRATA_WALK_MIN_TOKENS=1024 for this test only."""
    monkeypatch.setenv("STRATA_WALK_MIN_TOKENS", str(FIXED_WALK_TOKENS))
    return FIXED_WALK_TOKENS


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded freshly per test; the seed is attached to the test's report (shown
    when it fails) and `--seed N` replays it."""
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for key, value in item.user_properties:
            if key == "seed":
                report.sections.append(("rng seed", f"seed={value} (replay: --seed {value})"))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> dict:
    """The recording fake CUDA runtime (tests/_fake_runtime.py) installed for SMALL_SPEC: the
    CUDA backend's control flow on a machine without a GPU."""
    from _fake_runtime import install

    from strata_rt.weights.model import SMALL_SPEC

    return install(monkeypatch, rng, SMALL_SPEC)


@pytest.fixture(scope="module")
def golden_models() -> dict:
    """The tiny seeded whole models of tests/tools/make_qwen3_golden.py by case name (the models
    transformers' golden ids, logits and perplexities were computed from)."""
    from _generate_cases import CASES, build_case

    return {name: build_case(case)[0] for name, case in CASES.items()}
