"""The error type for bad input that the CLI reports in one message with exit code 2, and how text from
outside (a file name, a revision, a value of a query's result) is shown on a terminal."""

from __future__ import annotations

import re

# What a terminal would act on instead of showing: C0 and C1 control characters (escape sequences start with
# one) and the Unicode marks that reorder text (bidirectional overrides and isolates).
_CONTROL = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_HIDDEN = re.compile(f"[{_CONTROL}]")


class InputError(ValueError):
    """Bad input (params, paths, models, corpus, queries): the message names the cause and the fix."""


def escape(text: str, *, lines: bool = True) -> str:
    """`text` with every control character written as an escape (`\\x1b`, `\\u202e`), so that printing it
    shows it; with `lines`, newlines and tabs are kept (a message of several lines)."""
    keep = "\n\t" if lines else ""
    return _HIDDEN.sub(lambda m: m[0] if m[0] in keep else _escaped(m[0]), text)


def _escaped(char: str) -> str:
    code = ord(char)
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
