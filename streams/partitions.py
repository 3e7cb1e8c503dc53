"""The partitions a worker owns: where each one's fold stands, whether it is being revoked,
and which conversations live on it.

Every other part of the worker asks this table rather than keeping its own map, so a
partition that is handed over is forgotten in one place (`drop`), with all its conversations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from turnstile.streams.checkpoint import Position
from turnstile.streams.snapshots import Loaded


@dataclass(slots=True)
class OwnedPartition:
    at: Position  # the checkpoint's: where its fold stands
    conversations: set[str] = field(default_factory=set)
    # Revoked, and not yet known to be ours again: nothing is decided or claimed for it.
    suspended: bool = False
    # Records are folded only from where the log was told to read it (after an assignment).
    reading: bool = True
    # Assigned with snapshots: which events of the partition they include already.
    loaded: Loaded | None = None

    @property
    def live(self) -> bool:
        return self.at.live

    @property
    def deciding(self) -> bool:
        """Its state is the log's present and it is surely ours: decisions may be taken."""
        return self.live and not self.suspended


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """How far the assigned partitions are replayed (`Worker.replay_progress`)."""

    partitions: int  # assigned
    replaying: int  # of them, not live yet
    events_done: int  # records read, up to each partition's replay end
    events_total: int  # records to read before every assigned partition is live


class Partitions:
    def __init__(self) -> None:
        self._parts: dict[int, OwnedPartition] = {}
        self._home: dict[str, int] = {}  # conversation -> its partition, while it is in memory

    def __contains__(self, partition: object) -> bool:
        return partition in self._parts

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._parts))

    def get(self, partition: int | None) -> OwnedPartition | None:
        return self._parts.get(partition) if partition is not None else None

    def __getitem__(self, partition: int) -> OwnedPartition:
        return self._parts[partition]

    def items(self) -> list[tuple[int, OwnedPartition]]:
        return list(self._parts.items())

    def add(self, partition: int, at: Position) -> OwnedPartition:
        part = self._parts[partition] = OwnedPartition(at)
        return part

    def drop(self, partition: int) -> OwnedPartition:
        """The partition moved away: it and its conversations are forgotten here."""
        part = self._parts.pop(partition)
        for conversation in part.conversations:
            self._home.pop(conversation, None)
        return part

    # -- conversations ---------------------------------------------------------------------
    def place(self, conversation: str, partition: int) -> None:
        self._parts[partition].conversations.add(conversation)
        self._home[conversation] = partition

    def remove(self, conversation: str) -> None:
        """The conversation left memory (its partition is still ours)."""
        part = self._parts.get(self._home.pop(conversation, -1))
        if part is not None:
            part.conversations.discard(conversation)

    def home(self, conversation: str) -> int | None:
        """The partition of a conversation in memory."""
        return self._home.get(conversation)

    def of(self, conversation: str) -> OwnedPartition | None:
        return self.get(self._home.get(conversation))

    # -- what others may ask -----------------------------------------------------------------
    def suspended(self) -> list[int]:
        return [p for p, part in self._parts.items() if part.suspended]

    def hold(self, partitions: Iterable[int]) -> dict[int, OwnedPartition]:
        """Those of `partitions` owned here, from now on neither read nor decided for, nor
        committed: they are being revoked."""
        held = {p: part for p in partitions if (part := self._parts.get(p)) is not None}
        for part in held.values():
            part.suspended, part.reading = True, False
        return held

    def committable(self) -> list[int]:
        """Partitions whose positions may be committed now (not being revoked)."""
        return [p for p, part in self._parts.items() if not part.suspended]

    def liveness(self) -> dict[int, bool]:
        return {p: part.live for p, part in self._parts.items()}

    def replaying(self) -> bool:
        return any(not part.live for part in self._parts.values())

    def lag(self, end_offset: Callable[[int], int | None]) -> dict[int, int]:
        """End offset minus position for each partition whose end `end_offset` knows."""
        out: dict[int, int] = {}
        for partition, part in list(self._parts.items()):
            end = end_offset(partition)
            if end is not None:
                out[partition] = max(0, end - part.at.position)
        return out

    def progress(self) -> ReplayProgress:
        parts = list(self._parts.values())
        return ReplayProgress(
            len(parts),
            sum(not part.live for part in parts),
            sum(min(part.at.position, part.at.end_offset) for part in parts),
            sum(part.at.end_offset for part in parts),
        )
