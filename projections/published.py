"""Whether the outcomes topic holds what the events topic says was decided.

A worker publishes each outcome (and each `MessageRejected`) it folds as new to the outcomes
topic, at least once, before it commits past the event; downstream consumers read only that
topic. This ledger, fed the events the fold accepted and then the outcomes topic's records,
names the outcomes a consumer can never see: below the workers' committed offset, not on the
outcomes topic, and not explained by a dead letter saying the write was refused.

Pure: records in, findings out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson

from turnstile.events import OUTCOME_TYPES, Event, MessageRejected, TurnEnvelope

PUBLISHED_TYPES = (*OUTCOME_TYPES, MessageRejected)


@dataclass(frozen=True, slots=True)
class Decided:
    """An event the outcomes topic should hold (only what this check needs of it: a
    whole log's outcomes are kept until the report)."""

    partition: int
    offset: int
    event_id: str
    occurred_at: int
    conversation_id: str
    turn_id: str | None
    event_type: str


class OutcomeLedger:
    def __init__(self) -> None:
        self._decided: list[Decided] = []

    def note(self, partition: int, offset: int, event: Event) -> None:
        """`event`, at partition@offset of the events topic, was folded as new."""
        if isinstance(event, PUBLISHED_TYPES):
            turn_id = event.turn_id if isinstance(event, TurnEnvelope) else None
            decided = Decided(partition, offset, event.event_id, event.occurred_at, event.conversation_id, turn_id,
                              event.type)  # fmt: skip
            self._decided.append(decided)

    def unpublished(
        self,
        outcome_values: Iterable[bytes | None],
        trimmed: bool,
        committed: Mapping[int, int],
        refused: set[tuple[int, int]],
    ) -> list[Decided]:
        """`outcome_values`: the value of every record of the outcomes topic; `trimmed`:
        whether retention deleted the topic's oldest records (a partition starts past offset
        0), in which case it is judged only from the oldest outcome it still holds, by event
        time (what was older may have been deleted, not lost); `committed`: the workers'
        group's offsets on the events topic; `refused`: the events' partition@offset whose
        outcome record a dead letter says the log refused."""
        published: set[str] = set()
        oldest: int | None = None  # the oldest outcome the topic holds, by event time
        for value in outcome_values:
            fields = _fields(value)
            if fields is not None:
                published.add(fields[0])
                oldest = fields[1] if oldest is None else min(oldest, fields[1])
        if trimmed and oldest is None:
            return []  # all deleted: nothing to tell lost from expired
        found = []
        for d in self._decided:
            if d.offset >= committed.get(d.partition, 0) or (d.partition, d.offset) in refused:
                continue  # not yet due (the workers publish before they commit), or said why
            if d.event_id in published or (trimmed and oldest is not None and d.occurred_at < oldest):
                continue
            found.append(d)
        return found


def _fields(value: bytes | None) -> tuple[str, int] | None:
    """The event id and time of an outcome record; None for a value that is not one."""
    try:
        parsed = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    event_id, occurred_at = parsed.get("event_id"), parsed.get("occurred_at")
    if not isinstance(event_id, str) or not isinstance(occurred_at, int | float):
        return None
    return event_id, int(occurred_at)
