"""Whether the outcomes topic holds what the events topic says was decided.

A worker publishes each outcome (and each `MessageRejected`) it folds as new to the outcomes
topic, keyed by conversation id, at least once, before it commits past the event; downstream
consumers read only that topic. This ledger, fed the events the fold accepted and the
outcomes topic's records, names the outcomes a consumer can never see: below the workers'
committed offset, not on the outcomes topic, and not explained by a dead letter saying the
write was refused.

Retention deletes a partition's oldest records on its own schedule: an outcome whose
partition of the outcomes topic starts past offset 0 is judged only if it occurred after the
oldest record that partition still holds was written (what was older may have been deleted,
not lost); one whose partition retention emptied is not judged.

Pure: records in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from turnstile.events import OUTCOME_TYPES, Event, MessageRejected, TurnEnvelope, partition_for

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
        self._published: set[str] = set()
        self._oldest: dict[int, int] = {}  # outcomes partition -> its oldest record's time
        self._starts: dict[int, int] | None = None  # outcomes partition -> its first offset

    def note(self, partition: int, offset: int, event: Event) -> None:
        """`event`, at partition@offset of the events topic, was folded as new."""
        if isinstance(event, PUBLISHED_TYPES):
            turn_id = event.turn_id if isinstance(event, TurnEnvelope) else None
            decided = Decided(partition, offset, event.event_id, event.occurred_at, event.conversation_id, turn_id,
                              event.type)  # fmt: skip
            self._decided.append(decided)

    def published(self, partition: int, value: bytes | None, written_ms: int | None) -> None:
        """A record of the outcomes topic; `written_ms`: when the log says it was written
        (None: its event time stands in)."""
        fields = _fields(value)
        if fields is None:
            return  # not an outcome: nothing a consumer reads as one
        event_id, occurred_at = fields
        self._published.add(event_id)
        at = written_ms if written_ms is not None else occurred_at
        self._oldest[partition] = min(self._oldest.get(partition, at), at)

    def started(self, starts: Mapping[int, int]) -> None:
        """Where each partition of the outcomes topic starts (every partition, empty ones too)."""
        self._starts = dict(starts)

    @property
    def read(self) -> bool:
        """Whether the outcomes topic was read (`started` was told where it starts)."""
        return self._starts is not None

    def unpublished(self, committed: Mapping[int, int], refused: set[tuple[int, int]]) -> Verdict:
        """`committed`: the workers' group's offsets on the events topic; `refused`: the
        events' partition@offset whose outcome record a dead letter says the log refused."""
        starts = self._starts or {}
        due, found = 0, []
        for d in self._decided:
            if d.offset >= committed.get(d.partition, 0) or (d.partition, d.offset) in refused:
                continue  # not yet due (the workers publish before they commit), or said why
            where = partition_for(d.conversation_id, len(starts)) if starts else 0
            kept_since = self._oldest.get(where)  # None: retention left nothing there, if it ran
            if starts.get(where, 0) > 0 and (kept_since is None or d.occurred_at < kept_since):
                continue  # before what retention kept of its partition
            due += 1
            if d.event_id not in self._published:
                found.append(d)
        ours = {d.event_id for d in self._decided}
        if self._published and self._published.isdisjoint(ours):
            return Verdict(due, [], foreign=True)  # outcomes, but none of this log's
        return Verdict(due, found, empty=not self._published)


@dataclass(frozen=True, slots=True)
class Verdict:
    # The outcomes the topic should hold, and those it does not. A topic holding outcomes,
    # but none of this log's, is taken for another log's (an audit naming its events topic
    # but not its outcomes topic reads the default one), not judged: `foreign`. An empty
    # one is judged: a worker that published nothing is what this check is for.
    due: int
    missing: list[Decided]
    foreign: bool = False
    empty: bool = False  # the topic holds no outcome at all: none published, or not this log's


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
