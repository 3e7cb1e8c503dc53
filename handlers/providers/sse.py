"""Server-sent events (the `text/event-stream` format both providers stream in), decoded
incrementally from the bytes as they arrive. Pure: the transport feeds it chunks.

Per the HTML standard's event stream rules: lines end in LF, CRLF or CR; a line starting
with ":" is a comment; `field: value` (one space after the colon dropped); `data` lines of
one event are joined with LF; a blank line dispatches the event; an event without data is
not dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" when the stream names none
    data: str


class SseDecoder:
    def __init__(self) -> None:
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events that `chunk` completes. Lines are decoded once whole, so a UTF-8
        sequence split across chunks is never cut."""
        self._buffer += chunk
        # A CR at the very end may be the first half of a CRLF: wait for the next byte.
        cut = len(self._buffer) - 1 if self._buffer.endswith(b"\r") else len(self._buffer)
        text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        *lines, rest = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._buffer = rest + self._buffer
        events: list[SseEvent] = []
        for raw in lines:
            event = self._line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            event = SseEvent(self._event or "message", "\n".join(self._data)) if self._data else None
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            self._event = value
        elif field == "data":
            self._data.append(value)
        return None
