"""Stand-ins for prepared kernels that record their launches, so launch logic (grids, blocks,
arguments, shared memory) is tested without a device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Launch:
    grid: tuple
    block: tuple
    args: tuple
    shared: int


class RecordingKernel:
    def __init__(self):
        self.calls: list[Launch] = []

    def launch(self, grid, block, stream, args, shared=0):
        self.calls.append(Launch(tuple(grid), tuple(block), tuple(args), shared))
