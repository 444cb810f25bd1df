"""YAML as strata_rt reads it (run configs, plugins.yaml): PyYAML's safe loader, bounded and
strict where the plain one is silent or unbounded.

- Nesting: the composer recurses once per level, so a file nested a few thousand levels deep
  ended in RecursionError. Nesting deeper than MAX_DEPTH is refused with the line.
- Size and aliases: anchors and aliases share nodes, so nine lines can stand for a billion
  values ("billion laughs"). Nothing in strata_rt walks a document with that in mind (the
  problem messages print values), so a document of more than MAX_NODES values, or standing
  for more with its aliases expanded, or whose alias refers to itself, is refused before
  anything is built from it.
- Duplicate keys: the plain loader keeps the last one, so `format: fp16` above a forgotten
  `format: iq3_xxs` silently ran the other format. A key given twice is refused, naming both
  lines (keys brought in by a `<<` merge may still be overridden: that is what merges are).
- Integers: YAML 1.1 reads `1_000` as 1000, `1:30` as 90 (base 60) and `010` as 8 (octal).
  None is what a reader of a config sees, so numbers written that way are refused.
- Messages: PyYAML's name the text `in "<unicode string>"`; here each names the line (and
  column). A key that is a list or mapping, a value its tag cannot read (`!!int x`) and a date
  that is none (`2024-02-30`) were a traceback or PyYAML's words; each is a problem here.
"""

from __future__ import annotations

import datetime
import re
import reprlib
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .numbers import MAX_INT_DIGITS

#: levels of nested lists and mappings a document may have (configs use about five)
MAX_DEPTH = 64
#: values a document may hold, and stand for with its aliases expanded (a config holds a
#: few dozen; a parsed value costs PyYAML a few hundred bytes)
MAX_NODES = 100_000

_MERGE = "tag:yaml.org,2002:merge"
#: what YAML 1.1 reads as octal: a leading 0 and more digits (`010` is 8)
_OCTAL = re.compile(r"[-+]?0[0-7]+")


class _Shown(reprlib.Repr):
    """Python's repr, but null, true, false and dates as YAML spells them (`got null`)."""

    def repr1(self, x: Any, level: int) -> str:
        if x is None or isinstance(x, bool):
            return {None: "null", True: "true", False: "false"}[x]
        if isinstance(x, datetime.date):  # YAML reads `2024-01-31` as a date
            return x.isoformat()
        return super().repr1(x, level)


_SHOWN = _Shown()
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist, _SHOWN.maxstring = 3, 6, 8, 120
_SHOWN.maxother = 120


def shown_value(value: Any) -> str:
    """A value as a problem message shows it: its repr, bounded in length and depth (a YAML
    list of a million prompts, or a path of 100,000 characters, would otherwise fill the
    message), with null, true and false (also inside lists and mappings) as YAML writes them."""
    return _SHOWN.repr(value)


class YamlProblem(Exception):
    """Why a text is not a YAML document strata_rt reads; the message names the line."""


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _tag(node: Node) -> str:
    """A node's tag as a YAML file writes it (`!!int`)."""
    return str(node.tag).replace("tag:yaml.org,2002:", "!!")


def _yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's complaint in strata_rt's words: the line and column first (PyYAML names the
    text `"<unicode string>"`), then what is wrong and where the value it read started."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return f"not valid YAML: {e}"
    mark = e.problem_mark or e.context_mark
    where = "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "
    problem, context = e.problem or e.context or "", e.context if e.problem else None
    problem = problem.replace("tag:yaml.org,2002:", "!!")  # as the file writes a tag
    if context and e.context_mark is not None and e.context_mark is not mark:
        context += f" from line {e.context_mark.line + 1}"
    return f"{where}not valid YAML: {problem}" + (f" ({context})" if context else "")


class _Loader(yaml.SafeLoader):
    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        self._nodes += 1
        try:
            mark = self.peek_event().start_mark
            if self._depth > MAX_DEPTH:
                raise YamlProblem(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels "
                                  "deep; a config is a few levels of keys and lists")
            if self._nodes > MAX_NODES:
                raise YamlProblem(f"line {mark.line + 1}: more than {MAX_NODES:,} values; a "
                                  "config holds a few dozen")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
            # a value its tag cannot read (`!!int x`, `!!bool maybe`, a 30th of February)
            tag, mark = _tag(node), node.start_mark
            what = shown_value(node.value) if isinstance(node, ScalarNode) else "this value"
            if mark.buffer is None or mark.buffer[mark.pointer:mark.pointer + 1] != "!":
                raise YamlProblem(f"line {_line(node)}: {what} is read by YAML as a date, and "
                                  "there is no such date; quote it to mean text") from None
            raise YamlProblem(f"line {_line(node)}: {what} cannot be read as {tag}; write a "
                              f"value of that kind, or leave the tag {tag} out") from None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict:
        if not isinstance(node, MappingNode):  # `!!set [1]`, `!!map x`
            raise YamlProblem(f"line {_line(node)}: the tag {_tag(node)} needs a mapping "
                              "(key: value lines, or {key: value}) here")
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # a list or mapping: no key of a Python dict
                raise YamlProblem(f"line {_line(key_node)}: the key {shown_value(key)} is a "
                                  f"{'list' if isinstance(key, list) else 'mapping'}; a key is "
                                  "a name, a number or quoted text") from None
            if first is not None:
                raise YamlProblem(f"line {_line(key_node)}: duplicate key {shown_value(key)} "
                                  f"(first at line {first}); a key may appear once in a mapping")
            seen[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)

    def _plain_number(self, node: Node, what: str) -> None:
        if not isinstance(node, ScalarNode):  # `!!int [1]`: the base class names the line
            return
        text = str(node.value)
        if "_" in text or ":" in text:
            raise YamlProblem(f"line {_line(node)}: {text!r} is read by YAML as {what} "
                              "(with `_` separators or base-60 `:` parts); write the number "
                              "with digits only, or quote it to mean text")
        if _OCTAL.fullmatch(text):
            raise YamlProblem(f"line {_line(node)}: {text!r} is read by YAML as an octal "
                              f"number ({int(text, 8)}); write it without the leading zero, "
                              "or quote it to mean text")

    def construct_yaml_int(self, node: ScalarNode) -> int:
        # the length first: Python refuses to read one past 4,300 digits, and to write one
        # (an octal's value, shown in decimal) past as many
        digits = len(str(node.value).lstrip("+-"))
        if digits > MAX_INT_DIGITS:
            raise YamlProblem(f"line {_line(node)}: a whole number of {digits:,} digits; no "
                              f"setting takes one of more than {MAX_INT_DIGITS} (quote it to "
                              "mean text)")
        self._plain_number(node, "a number")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: ScalarNode) -> float:
        self._plain_number(node, "a number")
        return super().construct_yaml_float(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def expanded_size(root: Node) -> int:
    """Values `root` stands for with every alias expanded, counted without expanding them
    (each shared node once, iteratively: alias chains may be deeper than the recursion limit).
    YamlProblem when an alias refers to a node that holds it, or beyond MAX_NODES."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            if size[key] > MAX_NODES:
                raise YamlProblem(f"line {_line(node)}: with its aliases (*name) expanded, "
                                  f"the document holds more than {MAX_NODES:,} values; "
                                  "write the values out or use fewer aliases")
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise YamlProblem(f"line {_line(node)}: an alias (*name) refers to the list or "
                              "mapping that holds it, so the value never ends")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def load_yaml(text: str) -> Any:
    """The one document in `text` (None when it is empty); YamlProblem for text that is not
    YAML or that breaks one of the rules above, its message naming the line."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_size(node)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise YamlProblem(_yaml_error(e)) from None
    except RecursionError:  # a limit above should come first; never a traceback
        raise YamlProblem(f"nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()
