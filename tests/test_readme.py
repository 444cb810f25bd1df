"""The README's library example is run as written, so the first code a reader copies works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"README section {title!r} has no python block"
    return blocks[0]


def test_library_example_runs(capsys, monkeypatch):
    monkeypatch.delenv("STRATA_WALK_MIN_TOKENS", raising=False)  # as a reader runs it
    exec(compile(_section_code("Using strata_rt as a library"), str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "'tokens': 1100" in printed and "'experts_streamed': 96" in printed


def test_tokenizer_example_runs(capsys, monkeypatch):
    """The README's tokenizer example, run from the checkout as written."""
    pytest.importorskip("tokenizers", reason="the `text` extra (tokenizers) is not installed")
    monkeypatch.chdir(README.parent)
    section = README.read_text().split("### Tokenizer", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.strip() == "['', '', '', '🎉']"
