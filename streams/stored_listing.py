"""The read model's listing of a partition's conversations that have waited in the local store
since the partition was assigned: one packed entry each, not a dict entry, an int and a str.

A worker that takes over a partition of a million settled conversations keeps none of them in
memory (`streams/residency.py`), but lists every one. As dict entries keyed by their ids,
with a sequence number each, that listing cost ≈ 150 B of resident memory a conversation,
as much as the rest of the worker; packed here it is the id's UTF-8 bytes, a 4-byte end and
a status byte.

The entries are immutable and never looked up by id: a conversation that folds an event after
the assignment is listed again by the read model with a newer sequence number, and the read
model skips its entry here (`walk`'s `moved`). So the listing needs no index of ids, and a
conversation appears once in a page walk.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterator

from turnstile.projections import STATUSES, Status

STATUS_INDEX = {status: i for i, status in enumerate(STATUSES)}
# The one status a listing has no index of: nearly every conversation's, so a page filtered by
# it walks the listing in order and skips the few others.
WALKED: Status = "idle"
_WALKED_INDEX = STATUS_INDEX[WALKED]


class StoredListing:
    """Entry i lists `conversations[i]` with sequence number `first + i`: they were listed at
    once, in the store's order (their sequence numbers only have to be distinct and stable
    for a cursor to page through them)."""

    __slots__ = ("_by_status", "_ends", "_ids", "_statuses", "first", "partition")

    def __init__(self, partition: int, first: int, conversations: list[tuple[str, Status]]) -> None:
        self.partition = partition
        self.first = first
        encoded = [conversation.encode() for conversation, _ in conversations]
        self._ids = b"".join(encoded)
        self._ends = array("I", itertools.accumulate(len(e) for e in encoded))
        self._statuses = bytes(STATUS_INDEX[status] for _, status in conversations)
        # The positions of the few entries of a status other than idle (paused, failed), so that
        # a page filtered by one of them does not walk the million idle ones.
        self._by_status: dict[int, array[int]] = {}
        for i, index in enumerate(self._statuses):
            if index != _WALKED_INDEX:
                self._by_status.setdefault(index, array("I")).append(i)

    def __len__(self) -> int:
        return len(self._statuses)

    def walk(
        self, status: Status | None, before: int | None, moved: Callable[[str], bool], contains: str = ""
    ) -> Iterator[tuple[int, str, Status]]:
        """(sequence, conversation, status), highest sequence first, below `before` (None: from
        the last), of `status` (None: any), whose id contains `contains`, without the
        conversations `moved` says were listed again since."""
        needle = contains.encode()  # searched in the UTF-8 bytes: only the matches are decoded
        end = len(self) if before is None else max(0, min(len(self), before - self.first))
        wanted = None if status is None else STATUS_INDEX[status]
        if wanted is None or wanted == _WALKED_INDEX:
            positions: Iterator[int] = iter(range(end - 1, -1, -1))
        else:
            positions = (i for i in reversed(self._by_status.get(wanted, ())) if i < end)
        for i in positions:
            index = self._statuses[i]
            if wanted is not None and index != wanted:
                continue
            encoded = self._ids[self._ends[i - 1] if i else 0 : self._ends[i]]
            if needle and needle not in encoded:
                continue
            conversation = encoded.decode()
            if not moved(conversation):
                yield self.first + i, conversation, STATUSES[index]
