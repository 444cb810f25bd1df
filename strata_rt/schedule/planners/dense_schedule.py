"""Where a whole model's Attention ops go in a chunk's plan, and, when the dense weights stream,
the DenseCopy ops that bring each layer's dense slot into a small ring ahead of its Attention.

Resident dense weights: each layer's ops open with Attention(layer, start). Streamed (a ring of
R slots): the chunk opens with the copies of layers 0..R-1; layer l waits for its copy, runs its
Attention, records that the slot is free, and the copy stream then refills the slot with layer
l + R (after waiting for that record). So R - 1 layers of dense weights arrive while earlier
layers compute, and a slot is never overwritten while an Attention may read it (the hazard
checker verifies both).
"""

from __future__ import annotations

from ..plan import Attention, DenseCopy, InputKind, Op, Record, Wait, dense_copied, dense_used

#: dense ring slots when the dense weights stream (one computing, one arriving)
DENSE_RING_SLOTS = 2


class DenseSchedule:
    """The dense ops of one chunk at absolute position `start` (None: the position is read on
    the device, a decode plan); ring None: dense resident. Layers first..n_layers-1: a layer
    split's part streams its own layers' dense weights through its own ring (first 0: all).
    `input_kind`: what the chunk's ChunkInput brings (a whole model's token ids, when the
    executor looks their embedding rows up itself; else the hidden states)."""

    def __init__(self, n_layers: int, start: int | None, ring: int | None = None,
                 first: int = 0, input_kind: InputKind = "hidden"):
        if ring is not None and ring < 1:
            raise ValueError(f"dense ring of {ring} slots; at least 1")
        self.n_layers, self.start, self.ring, self.first = n_layers, start, ring, first
        self.input_kind: InputKind = input_kind

    def _copy(self, layer: int) -> list[Op]:
        assert self.ring is not None
        s = (layer - self.first) % self.ring
        ops: list[Op] = []
        if layer - self.first >= self.ring:  # the slot's previous layer must be done with it
            ops.append(Wait(dense_used(s), "copy"))
        ops += [DenseCopy(layer, s), Record(dense_copied(s), "copy")]
        return ops

    def chunk_ops(self) -> list[Op]:
        """Ops before the chunk's first layer (the first copies)."""
        if self.ring is None:
            return []
        return [op for layer in range(self.first, min(self.first + self.ring, self.n_layers))
                for op in self._copy(layer)]

    def layer_ops(self, layer: int) -> list[Op]:
        """The layer's Attention with what orders it against its dense copy."""
        return self.attention(layer, self.start) + self.layer_done(layer)

    def attention(self, layer: int, start: int | None) -> list[Op]:
        """The layer's Attention over the chunk at `start`, after its dense copy landed (a
        layer pass runs one per chunk of the prompt, all before the layer's layer_done)."""
        if self.ring is None:
            return [Attention(layer, start)]
        s = (layer - self.first) % self.ring
        return [Wait(dense_copied(s), "compute"), Attention(layer, start, s)]

    def layer_done(self, layer: int) -> list[Op]:
        """After the layer's last Attention: its dense slot is free, and the copy stream
        refills it with layer + ring."""
        if self.ring is None:
            return []
        ops: list[Op] = [Record(dense_used((layer - self.first) % self.ring), "compute")]
        if layer + self.ring < self.n_layers:
            ops += self._copy(layer + self.ring)
        return ops
