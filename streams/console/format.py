"""Readable, inert fragments of HTML for the console's pages.

Everything that comes from the log (ids, content, tool arguments) goes through `esc` or
`esc_text`: control characters written out (`inert.printable`), markup escaped. Numbers are
rounded for reading with the exact value in the element's `title`; ids are shortened with
the full value in `title` and `data-copy` (a click copies it); times are written in UTC,
and the page's script adds the reader's local time.
"""

from __future__ import annotations

import datetime as dt
import html
import re
from typing import Any
from urllib.parse import quote

import orjson

from turnstile.projections.inert import printable

SHORT_ID = 10
REDACTED = "[redacted]"
# Keys whose values an operator's screen (or an exported page) must not show, whatever a
# tool's author declared: credentials by their usual names.
_SECRET_KEY = re.compile(r"pass(word|wd|phrase)?|secret|token|api[-_]?key|authori[sz]ation|credential|private[-_]?key",
                         re.IGNORECASE)


# `"<a secret name>": "<its value>"` quoted in free text.
_QUOTED_SECRET = re.compile(
    r'("[^"\\]*(?:' + _SECRET_KEY.pattern + r')[^"\\]*"\s*:\s*)"(?:[^"\\]|\\.)*"', re.IGNORECASE
)


def esc(text: object) -> str:
    """One line of log text: control characters (newlines too) written out, markup escaped."""
    return html.escape(printable(str(text)))


def esc_text(text: str) -> str:
    """Log text of several lines (for a `white-space: pre-wrap` element): secret-named JSON
    fields quoted in it redacted (`redact_text`), newlines kept, every other control
    character written out, markup escaped."""
    return "\n".join(html.escape(printable(line)) for line in redact_text(text).split("\n"))


def redact_text(text: str) -> str:
    """Free text (a message that quotes a call's arguments, a pause's hint) with the value of
    every secret-named JSON field in it replaced by [redacted]."""
    return _QUOTED_SECRET.sub(lambda m: f'{m.group(1)}"{REDACTED}"', text)


def path_part(value: str) -> str:
    """An id as one segment of a URL path."""
    return quote(value, safe="")


def short_id(value: str, width: int = SHORT_ID) -> str:
    shown = value if len(value) <= width + 2 else value[:width] + "…"
    full = esc(value)
    return f'<span class="id" title="{full}" data-copy="{full}">{esc(shown)}</span>'


def money(usd: float | None) -> str:
    """Dollars rounded for reading: 3 significant digits under $1 ($0.018, $0.000123), cents
    above; unknown when a model had no price."""
    if usd is None:
        return '<span class="unknown" title="a model without a price: the cost is unknown">unknown</span>'
    if usd == 0:
        shown = "$0"
    elif usd < 1:
        shown = f"${usd:.3g}" if usd >= 1e-6 else "< $0.000001"
    else:
        shown = f"${usd:,.2f}"
    return f'<span class="num" title="${usd!r}">{shown}</span>'


def duration(ms: int | float | None) -> str:
    """850 ms, 2.4 s, 3 min 12 s, 2 h 5 min."""
    if ms is None:
        return "—"
    ms = max(0, int(ms))
    if ms < 1000:
        shown = f"{ms} ms"
    elif ms < 60_000:
        shown = f"{ms / 1000:.1f} s"
    elif ms < 3_600_000:
        shown = f"{ms // 60_000} min {ms % 60_000 // 1000} s"
    else:
        shown = f"{ms // 3_600_000} h {ms % 3_600_000 // 60_000} min"
    return f'<span class="num" title="{ms:,} ms">{shown}</span>'


def count(value: int) -> str:
    return f'<span class="num">{value:,}</span>'


def utc(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso_utc(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def when(ms: int | None) -> str:
    """The time in UTC; the page's script adds the local time (`data-ms`)."""
    if ms is None:
        return "—"
    iso = iso_utc(ms)
    return f'<time datetime="{iso}" data-ms="{ms}" title="{iso}">{utc(ms)}</time>'


def redact_json(text: str) -> str:
    """Tool arguments or a result for display: JSON with every secret-named field's value
    replaced by [redacted], pretty-printed; text that is not JSON is shown as it is."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    if not isinstance(value, (dict, list)):
        return text
    return orjson.dumps(_redacted(value), option=orjson.OPT_INDENT_2).decode()


def _redacted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: REDACTED if _SECRET_KEY.search(str(k)) else _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


STATUS_LABELS = {"idle": "idle", "debouncing": "debouncing", "active": "turn active", "paused": "paused",
                 "failed": "failed"}


def status_badge(status: str) -> str:
    return f'<span class="badge s-{esc(status)}">{esc(STATUS_LABELS.get(status, status))}</span>'
