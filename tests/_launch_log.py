"""A runtime double for launcher tests: every kernel launch is logged as (name, grid, block,
args), modules record the sources asked for, and each kernel checks its argument codes."""

from __future__ import annotations


class LoggedKernel:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def launch(self, grid, block, stream, args, shared=0):
        self.log.append((self.name, tuple(grid), tuple(block), tuple(args)))


class LoggedModule:
    def __init__(self, log: list, arg_types: str):
        self.log, self.arg_types = log, arg_types

    def kernel(self, name: str, arg_types: str, overlap: bool = False) -> LoggedKernel:
        assert arg_types == self.arg_types, (name, arg_types)
        return LoggedKernel(self.log, name)


class LoggingRuntime:
    """`arg_types`: the argument codes every kernel of the launcher under test must use."""

    def __init__(self, arg_types: str):
        self.arg_types = arg_types
        self.log: list = []
        self.sources: list = []

    def module(self, source, defines=None, extra_flags=(), *, arch=None):
        self.sources.append(source)
        return LoggedModule(self.log, self.arg_types)
