"""Failures the fuzzer finds in code that other branches are fixing, so that the suite stays
green until they land: each entry names the area, a pattern of the problem text and why.

A pattern is searched in `<the mutation> :: <the problem>`; a case passes as `known` only when
every one of its problems matches an entry. When a fix
lands its entry stops matching, and test_fuzz reports the entry as stale: delete it then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    area: str
    pattern: str
    reason: str

    def matches(self, problem: str) -> bool:
        return re.search(self.pattern, problem) is not None


KNOWN: tuple[Known, ...] = (
    Known("config loading (config.py)",
          r":: traceback: UnicodeDecodeError: .*\(at config\.py:\d+ in load_config\)",
          "a config that is not UTF-8 escapes as UnicodeDecodeError instead of a message "
          "naming the file"),
    Known("config paths (config_schema.py)",
          r":: traceback: ValueError: embedded null byte \(at config_schema\.py:\d+ in file_path\)",
          "a path holding a NUL byte escapes as ValueError from Path.is_file"),
    Known("prompt files (prompts.py)",
          r":: a Python warning reached the user: RuntimeWarning: overflow encountered in cast "
          r"\(prompts\.py:\d+\)",
          "a float64 hidden-state file beyond float32's range prints numpy's overflow warning "
          "before the (correct) refusal"),
    Known("prompt files (prompts.py)",
          r":: the message does not name h\.npy: .*prefill input holds NaN or Inf",
          "a float64 hidden-state file with a finite value beyond float32's range (1e300) "
          "passes the check before the run and is refused by the engine without the file's "
          "name"),
    Known("config values (config_schema.py)",
          r"repeats = \d{7,}.* :: ran past",
          "`repeats` has no upper bound: 10**30 repeats of a 3-token prompt is accepted and "
          "runs until killed (a size no machine finishes; compare the prompt-length bound)"),
    Known("config loading (config.py)",
          r":: traceback: RecursionError: .*\(at \w+\.py:\d+ in \w+\)",
          "deeply nested YAML ([[[[... 3,000 deep) escapes from the YAML parser as "
          "RecursionError instead of a message naming the config"),
    Known("config checks of a GGUF's dims (config_schema.py)",
          r":: the message does not name m\.gguf: .*model\.gguf: got \{",
          "a GGUF whose dims the format refuses (hidden 255 for IQ3_XXS) is reported under the "
          "config key model.gguf, without the file's name"),
    Known("GGUF reading (gguf_io.py)",
          r":: traceback: UnicodeDecodeError: .*\(at gguf_reader\.py:\d+",
          "a key or tensor name that is not UTF-8 escapes from the gguf library's reader as "
          "UnicodeDecodeError"),
    Known("prompt files (prompts.py)",
          r":: exit 0 on an invalid input toks\.txt \(token lines .*('1_0'|'\u0663')",
          "a token file accepts what Python's int() accepts: '1_0' reads as 10 and the "
          "Arabic-Indic digit U+0663 as 3, so a garbled prompt runs as another one"),
)


def _texts(what: str, problems: list[str]) -> list[str]:
    """What the patterns see of each problem: the mutation, then ` :: `, then the problem."""
    return [f"{what} :: {p}" for p in problems]


def known_reason(what: str, problems: list[str]) -> str | None:
    """The reason when every problem matches a known entry (the first entry's), else None."""
    reasons = []
    for text in _texts(what, problems):
        hit = next((k for k in KNOWN if k.matches(text)), None)
        if hit is None:
            return None
        reasons.append(f"{hit.area}: {hit.reason}")
    return reasons[0] if reasons else None


def used(what: str, problems: list[str]) -> set[int]:
    """Indices of the KNOWN entries these problems match."""
    return {i for t in _texts(what, problems) for i, k in enumerate(KNOWN) if k.matches(t)}
