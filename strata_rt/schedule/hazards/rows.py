"""What the hazard checker asks of a layer pass's chunks (plan.PromptRows,
schedule.planners.layer_pass): the order of the rows, which no ring event shows.

- A PromptRows may switch chunks only between layers: with no layer of the current chunk routed
  and not yet combined (its routing and product rows would be the next chunk's).
- Each chunk brings its input once (its ChunkInput), before any op that reads its rows.
- A chunk's layers run one after another from the pass's first (none skipped), each after the
  previous one's combine; at the plan's end the chunks tile the prompt's rows, each has
  combined the plan's last layer and (a whole model) attended at every layer (`finish`).
- Attention of layer l over a chunk's rows [a, b) needs the keys and values of every earlier
  row of the prompt at layer l: the pass's chunks of each layer run in prompt order, so the
  layer's Attention of rows [a, b) follows the one of the rows just before a.

An ordinary chunk plan has no PromptRows; its rows are "the chunk" (window None) and only the
input rule applies (a second ChunkInput is refused). Each check returns its problem as text
(None when there is none); the checker raises it.
"""

from __future__ import annotations

from ..plan import Attention, ChunkPlan, LayerBegin, LayerEnd, PromptRows

#: the chunk a plan's ops act on: (first row, rows) of a layer pass, None for a plain chunk
Window = tuple[int, int] | None


def _rows(w: Window) -> str:
    return "the chunk" if w is None else f"rows [{w[0]}, {w[0] + w[1]})"


class PromptWindows:
    """The current chunk, where each chunk's input arrived, the last layer each chunk
    combined, and per layer the prompt row its Attention has reached."""

    def __init__(self, input_arrived: bool = False):
        self.window: Window = None
        #: window -> op index of its ChunkInput (-1: before the ops fed here)
        self.inputs: dict[Window, int] = {None: -1} if input_arrived else {}
        self.last_layer: dict[Window, tuple[int, bool]] = {}  # window -> (layer, combined)
        self.origin: int | None = None  # the prompt's first position (a pass's)
        self.first_layer: int | None = None  # the layer every chunk of a pass starts at
        self.kv_row: dict[int, int] = {}  # layer -> rows of the prompt its Attention has run

    def switch(self, i: int, op: PromptRows, open_layers: list[int]) -> str | None:
        """Op #i makes `op`'s rows the current chunk; open_layers: layers routed in the
        current chunk and not yet combined."""
        if op.first < 0 or op.tokens < 1:
            return f"op #{i} {op!r}: rows must start at 0 or later and hold at least one row"
        if open_layers:
            return (f"op #{i} PromptRows({op.first}, {op.tokens}) switches chunks while layer "
                    f"{open_layers[0]} of {_rows(self.window)} is routed and not combined: its "
                    "LayerEnd must come first")
        self.window = (op.first, op.tokens)
        return None

    def arrive(self, i: int, what: str) -> str | None:
        """The current chunk's input arrives at op #i."""
        earlier = self.inputs.get(self.window)
        if earlier is not None:
            whose = ("the chunk's input" if self.window is None
                     else f"the input of {_rows(self.window)}")
            return (f"op #{i} {what}: {whose} already arrived"
                    + (f" at op #{earlier}" if earlier >= 0 else ""))
        self.inputs[self.window] = i
        return None

    def has_input(self) -> bool:
        return self.window in self.inputs

    def enter(self, i: int, op: Attention | LayerBegin) -> str | None:
        """A layer's first op in a layer pass's chunk (its Attention, or its LayerBegin)."""
        if self.window is None:
            return None  # a plain chunk's layers follow the order its plan lists them in
        last = self.last_layer.get(self.window)
        if last is not None and last[0] == op.layer and not last[1]:
            return None  # the LayerBegin after the layer's Attention
        if self.first_layer is None:
            self.first_layer = op.layer
        if last is None and op.layer != self.first_layer:
            return (f"op #{i} {op!r} opens {_rows(self.window)} at layer {op.layer}: every "
                    f"chunk of the pass starts at its first layer, {self.first_layer}")
        if last is not None and (op.layer != last[0] + 1 or not last[1]):
            state = "combined" if last[1] else "not combined yet"
            return (f"op #{i} {op!r} runs on {_rows(self.window)} after its layer {last[0]} "
                    f"({state}): a chunk's layers run one after another, none skipped, each "
                    "after the previous one's LayerEnd")
        self.last_layer[self.window] = (op.layer, False)
        return None

    def finish(self, plan: ChunkPlan) -> str | None:
        """After a plan's last op: a layer pass's chunks (none: a plain chunk) must tile its
        prompt rows (plan.tokens), each run from the plan's first layer and combined through
        its last, with an Attention at every layer (a whole model's)."""
        if not plan.layers:
            return None
        first_layer, last_layer, row = plan.layers[0].layer, plan.layers[-1].layer, 0
        if self.first_layer not in (None, first_layer):
            return (f"the layer pass's chunks start at layer {self.first_layer}, not at the "
                    f"plan's first, {first_layer}")
        for w in sorted(w for w in self.last_layer if w is not None):
            if w[0] != row:
                return (f"the layer pass's chunks leave rows [{row}, {w[0]}) of the prompt to "
                        "no chunk, or run rows twice")
            if self.last_layer[w] != (last_layer, True):
                layer, combined = self.last_layer[w]
                return (f"{_rows(w)} end at layer {layer} ({'' if combined else 'not '}"
                        f"combined), not after the LayerEnd of the plan's last layer "
                        f"{last_layer}")
            row = w[0] + w[1]
        if row not in (0, plan.tokens):
            return f"the layer pass's chunks run rows [0, {row}) of the prompt's {plan.tokens}"
        short = [layer for layer in range(first_layer, last_layer + 1)
                 if self.origin is not None and self.kv_row.get(layer, 0) != row]
        if short:  # a whole model's chunk ran a layer without its Attention
            return (f"layer {short[0]}'s Attention reaches row {self.kv_row.get(short[0], 0)} "
                    f"of the prompt's {row}: every chunk attends at every layer")
        return None

    def combined(self, op: LayerEnd) -> None:
        self.last_layer[self.window] = (op.layer, True)

    def attention(self, i: int, op: Attention) -> str | None:
        """A layer pass's Attention must follow its layer's Attention of the rows before."""
        if self.window is None or op.start is None:
            return None
        first, tokens = self.window
        if self.origin is None:
            self.origin = op.start - first
        if op.start != self.origin + first:
            return (f"op #{i} {op!r} on rows [{first}, {first + tokens}) starts at position "
                    f"{op.start}, not the prompt's {self.origin} + {first}")
        reached = self.kv_row.get(op.layer, 0)
        if reached != first:
            return (f"op #{i} {op!r} attends over rows [{first}, {first + tokens}) while layer "
                    f"{op.layer}'s keys and values reach row {reached} of the prompt: its "
                    "chunks must run in prompt order, each once")
        self.kv_row[op.layer] = first + tokens
        return None
