"""The hazard checker, which replays a Plan under CUDA's stream and event rules (`checker`;
a whole plan through it: `plan_check`), with its parts: the messages that name ops and slots
(`messages`), where a product's experts are read from (`sources`), the dense ring (`dense`)
and a routed walk's switched copies (`routed_copies`)."""

from .checker import Checker
from .plan_check import check

__all__ = ["Checker", "check"]
