"""Where the HTTP API and the console get a conversation's view.

From the worker's read model (`streams.read_model`) for the conversations it owns: no log
read at all. For a conversation on a partition it does not own (or with no worker beside
the port), from one bounded read of that partition: past `max_records` records the read is
refused before it starts and the client is told to ask the partition's owner, so a GET
never scans a log that grows without bound. A partition still replaying is a 503 with
Retry-After: its state is not the log's present yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from turnstile.streams.kafka_reader import KafkaReader, ReadTooLarge, read_conversation
from turnstile.streams.log import LogReader, Record
from turnstile.streams.read_model import NotOwned, ReadModel, Replaying
from turnstile.streams.views import ConversationView, TurnView, build_view

ReadConversation = Callable[[str], Awaitable[list[Record]]]
# The default bound of a read of a partition this worker does not own.
BOUNDED_READ_RECORDS = 200_000


def bounded_reader(reader: LogReader, max_records: int | None) -> ReadConversation:
    """`reader.conversation`, refused (`ReadTooLarge`) past `max_records`: on Kafka before a
    record is fetched (the partition's offsets say its size). The embedded log is one
    process's, whose worker holds every partition: its reads (no worker beside the port, an
    old turn's page) are checked after the read."""
    if max_records is None:
        return reader.conversation
    if isinstance(reader, KafkaReader):
        kafka = reader

        async def on_kafka(conversation: str) -> list[Record]:
            return await read_conversation(kafka.bootstrap, kafka.topics.events, conversation, max_records=max_records)

        return on_kafka

    async def checked(conversation: str) -> list[Record]:
        records = await reader.conversation(conversation)
        if len(records) > max_records:
            raise ReadTooLarge([records[0].partition], len(records), max_records)
        return records

    return checked


@dataclass(frozen=True, slots=True)
class Unavailable:
    status: int
    message: str
    retry_after_s: int | None = None


class Reads:
    def __init__(self, read_model: ReadModel | None, read_conversation: ReadConversation) -> None:
        self.model = read_model
        self._read = read_conversation

    async def conversation(self, conversation: str) -> ConversationView | Unavailable:
        found = self.model.lookup(conversation) if self.model is not None else NotOwned(None)
        if isinstance(found, Replaying):
            return Unavailable(503, f"partition {found.partition} is still replaying; try again shortly", 1)
        if isinstance(found, NotOwned):
            return await self._bounded(conversation)
        if found is None:
            return Unavailable(404, f"no events of conversation {conversation!r}")
        return found

    async def turn(self, conversation: str, turn_id: str) -> tuple[ConversationView, TurnView] | Unavailable:
        view = await self.conversation(conversation)
        if isinstance(view, Unavailable):
            return view
        turn = view.turns.get(turn_id)
        if turn is not None and turn.entries_dropped:  # an old turn of an owned conversation
            view = await self._bounded(conversation)
            if isinstance(view, Unavailable):
                return view
            turn = view.turns.get(turn_id)
        if turn is None:
            return Unavailable(404, f"no turn {turn_id!r} in conversation {conversation!r}")
        return view, turn

    async def _bounded(self, conversation: str) -> ConversationView | Unavailable:
        try:
            records = await self._read(conversation)
        except ReadTooLarge as exc:
            return Unavailable(
                503,
                f"conversation {conversation!r} is on partition {exc.partitions[0]}, which this worker does not"
                f" hold in memory, and its {exc.records} records exceed the bounded read ({exc.limit}); ask the"
                " worker that owns it (its /readyz lists its partitions)",
            )
        # Folding a long partition is CPU work: in a thread, the loop keeps serving.
        view = await asyncio.to_thread(build_view, conversation, records)
        if view.state.events_applied == 0:
            return Unavailable(404, f"no events of conversation {conversation!r}")
        return view
