"""Text from the log made inert for an operator's terminal or browser.

Ids and content are whatever a client sent: an escape sequence in a conversation id would
restyle (or retitle, or hyperlink) the terminal that prints it. `printable` writes every
control character (C0, DEL, C1 -- ESC among them) as a visible `\\xNN` escape, `inert_json`
as JSON's `\\u00NN`; markup
(rich's `[bold]`, HTML) is the renderer's to escape -- `inspect` prints rich `Text`
objects, never markup, and the HTML pages pass everything through `html.escape`.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with each control character written as `\\xNN` (a newline as `\\n`)."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return "\\n" if char == "\n" else f"\\x{ord(char):02x}"


def inert_json(text: str) -> str:
    """JSON text (orjson's, which escapes C0 only) with DEL and the C1 controls written as
    `\\u00NN` too. They can stand only inside its strings, where that escape means the same."""
    return _RAW_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_RAW_IN_JSON = re.compile(r"[\x7f-\x9f]")
