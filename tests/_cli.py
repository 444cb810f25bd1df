"""The `strata` command as a user runs it (a fresh interpreter in the repository root), shared
by the CLI test modules so both run it the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def strata(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "strata_rt.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
