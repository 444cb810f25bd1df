"""Whole numbers written as text: how long one may be, and how it becomes an int.

Python refuses to convert a string of more than 4,300 digits to an integer and counts leading
zeros among them (`int("0" * 5000 + "1")` is refused). No count, size or token id here needs
more than 20 significant digits, so the readers of numbers from text (token files, the command
line, the environment) check `significant_digits` against their own bound and convert with
`to_int`, which drops the leading zeros first: a number is judged by its value's length, and
any run of zeros in front of it is harmless."""

from __future__ import annotations

#: significant digits a whole number may have (2^64 has 20; no setting takes more)
MAX_INT_DIGITS = 100


def significant_digits(word: str) -> int:
    """Digits of a whole number as written, its sign and leading zeros aside."""
    return len(word.strip().lstrip("+-").lstrip("0"))


def to_int(word: str) -> int:
    """The value of a whole number written with an optional sign and ASCII digits (checked by
    the caller), leading zeros dropped before Python converts it."""
    text = word.strip()
    digits = text.lstrip("+-").lstrip("0") or "0"
    return -int(digits) if text.startswith("-") else int(digits)
