"""Logging for the `strata` command: library modules log, the CLI decides what is shown.

Every module of strata_rt logs through `logging.getLogger(__name__)` (children of the
`strata_rt` logger) and never prints to stderr, so a program that embeds the library routes or
silences its messages like any other library's. The CLI calls `configure` once per command:
notices (INFO) and warnings go to stderr prefixed `strata:`; `-q` keeps warnings and errors,
`-qq` errors only, `-v` adds debug messages with the module that logged them.

Progress bars are not log records: they redraw one terminal line (see report/progress.py). A record
logged while a bar is drawn first clears the bar's line so the two never share a line.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from . import progress

ROOT = "strata_rt"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (a test's capture, a
    redirection set up after configure), clearing a drawn progress line first."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass

    def emit(self, record: logging.LogRecord) -> None:
        progress.clear_line(sys.stderr)
        super().emit(record)


class _Formatter(logging.Formatter):
    """`strata: message`, `strata: warning: message`; with -v also the logger's name."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and self.verbose:
            text += "\n" + self.formatException(record.exc_info)
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        where = f"[{record.name}] " if self.verbose else ""
        return f"strata: {where}{level}{text}"


def level_for(verbosity: int) -> int:
    """-2 and below: errors only; -1: warnings; 0: notices; 1 and above: debug."""
    if verbosity <= -2:
        return logging.ERROR
    return {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)


def configure(verbosity: int = 0) -> logging.Logger:
    """Points the `strata_rt` logger at stderr with the level `verbosity` picks. Calling it
    again replaces the handler it installed (one per process, not one per call)."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(verbose=verbosity > 0))
    logger.addHandler(handler)
    logger.setLevel(level_for(verbosity))
    return logger


@contextmanager
def configured(verbosity: int = 0) -> Iterator[logging.Logger]:
    """`configure` for the length of one command, then the logger's handlers and level as
    they were: `strata.cli.main` called in-process (tests, a host program) leaves no trace."""
    logger = logging.getLogger(ROOT)
    handlers, level = list(logger.handlers), logger.level
    try:
        yield configure(verbosity)
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
