"""The hazard checker, which replays a Plan under CUDA's stream and event rules (`checker`),
with its parts: the messages that name ops and slots (`messages`), where a product's experts
are read from (`sources`) and the dense ring (`dense`)."""

from .checker import Checker, check

__all__ = ["Checker", "check"]
