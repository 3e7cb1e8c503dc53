"""The worker's local store of conversation snapshots: one SQLite file.

It holds the latest snapshot's head (`turnstile.projections.snapshot_head`) of every
conversation of the partitions this worker owns and, once fetched, the snapshot itself (the
bytes of `turnstile.projections.snapshot`), so that an idle conversation can leave memory and
come back on demand (`streams/eviction.py`). A row without its snapshot yet is *unfilled*:
an assignment reads only the heads, and the snapshots follow in the background
(`streams/snapshot_fill.py`). It is a cache of the heads and snapshot topics, never the
truth: an assignment refills a partition's rows from the heads topic, unless the store holds
a *checkpoint* of the partition -- as Kafka Streams' `.checkpoint` file: written at a clean
stop, it says below which offset of the heads partition the rows are complete, so a restart
on the same machine (a persistent `state_dir`) reads only the heads written after it. The
checkpoint is taken out of the store once the worker has taken the partition (its rows change
from then on), so after a crash there is none and the partition is refilled from the topic:
a store whose last writes may be lost is never trusted. Hence no fsync and no backup. A load
cut off before that (a rebalance, a stop, a crash) leaves the checkpoint: it has put only
heads that follow it, which the next load puts again (after a crash of the process SQLite
keeps a prefix of its transactions; an OS crash can lose or damage unsynced pages, as for
every write since the clean stop), and it takes the checkpoint out before it forgets a row.

Why SQLite (the standard library's `sqlite3`): what the worker needs is point reads and
batched upserts by key, from one process; SQLite is in every CPython, one file, and its page
cache bounds its own memory. RocksDB or LMDB bindings would be a compiled dependency for a
store whose hot path -- the reload of an evicted conversation -- is one primary-key read of a
few kilobytes.

The store also lists the conversations out of memory for the read model (`streams/
read_model.py`): each row has a place (`listed`) in the read model's most-recent-first order,
so a page of a million conversations of which a thousand are in memory is a walk of an
index here, and the worker keeps nothing in memory for the others. A row put for a
conversation new to the store is listed below everything the read model numbers (under
`LISTED_BY_THE_STORE`); the read model gives an evicted conversation the place it had in
memory (`relist`), so one evicted while a client pages is not seen twice.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from turnstile.projections import STATUSES, Status
from turnstile.projections.snapshot_head import Head

# The file is a cache: one of another layout is emptied, not migrated.
_LAYOUT = 7
# The places below this are the store's own, given to rows as they are first put; the read
# model numbers its places from here up (well inside JSON's exact integers: a page cursor).
LISTED_BY_THE_STORE = 1 << 40
# A listing walk reads the index this many rows at a time (no statement stays open between).
_WALK_CHUNK = 256
_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshot (
    conversation TEXT PRIMARY KEY,
    partition    INTEGER NOT NULL,
    covered      INTEGER NOT NULL,  -- the events offset the snapshot covers
    source       INTEGER NOT NULL,  -- its head's offset on the heads topic
    at           INTEGER NOT NULL,  -- its offset on the snapshot topic
    status       TEXT NOT NULL,     -- the conversation's status in it (`projections.status`)
    events       INTEGER NOT NULL,  -- and what a listing shows of it
    turns        INTEGER NOT NULL,
    pending      INTEGER NOT NULL,
    listed       INTEGER NOT NULL,  -- its place in the read model's order (the higher, the more recent)
    value        BLOB               -- the snapshot; NULL: not fetched yet (unfilled)
);
-- A partition's rows listed from the index alone: the table's pages, which hold the
-- snapshots' bytes and so grow with the conversations' history, are not read.
CREATE INDEX IF NOT EXISTS snapshot_heads ON snapshot (partition, conversation, covered, source, at, status, events,
    turns, pending);
-- Pages of the listing from the indexes alone: all statuses (or idle, nearly every row's),
-- and the few rows of any other status (a partial index: idle rows cost it nothing).
CREATE INDEX IF NOT EXISTS snapshot_listed ON snapshot (listed, partition, conversation, status, events, turns,
    pending);
CREATE INDEX IF NOT EXISTS snapshot_listed_unsettled ON snapshot (status, listed, partition, conversation, events,
    turns, pending) WHERE status != 'idle';
-- The rows still to fill, by where their snapshots are (a partial index: empty once filled).
CREATE INDEX IF NOT EXISTS snapshot_unfilled ON snapshot (partition, at, conversation) WHERE value IS NULL;
CREATE TABLE IF NOT EXISTS checkpoint (
    partition        INTEGER PRIMARY KEY,
    heads_to         INTEGER NOT NULL,
    watermark        INTEGER NOT NULL,
    watermark_source INTEGER NOT NULL
);
"""


_HEAD = "conversation, covered, status, at, events, turns, pending"


def _head(row: Iterable[object]) -> Head:
    """A `Head` from the columns `_HEAD` names, in its order."""
    conversation, covered, status, at, events, turns, pending = row
    return Head(conversation, covered, status, at, events, turns, pending)  # type: ignore[arg-type]


# Not frozen (treat it as a value all the same): a new owner makes one per conversation, and a
# frozen dataclass takes 4x as long to make.
@dataclass(slots=True)
class Stored:
    """A row: a conversation's snapshot head (what loading and listing need of it without
    decoding it), where the head is on the heads topic, and the snapshot (None: unfilled)."""

    head: Head
    partition: int
    source: int
    value: bytes | None

    @property
    def conversation(self) -> str:
        return self.head.conversation

    @property
    def covered(self) -> int:
        return self.head.covered

    @property
    def status(self) -> Status:
        return self.head.status


def _columns(row: Stored, listed: int) -> tuple[object, ...]:
    h = row.head
    return (h.conversation, row.partition, h.covered, row.source, h.at, h.status, h.events, h.turns, h.pending,
            listed, row.value)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Unfilled:
    """A row whose snapshot is not fetched yet: it is at `at` on the snapshot topic."""

    head: Head


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Of one partition: its rows hold the head covering most of every conversation among
    the heads-topic records below `heads_to`, and `watermark` is the latest watermark among
    them (written at `watermark_source` on the heads topic; -1: none)."""

    heads_to: int
    watermark: int
    watermark_source: int


class StoreClosed(RuntimeError):
    """The store was used after the worker's stop closed it (it is never opened again: a
    late writer would leave a file, or a temporary folder, that nothing removes)."""


class StateStore:
    """Snapshots by conversation id in `directory`/`name`.sqlite; a temporary folder (removed
    on close) when no directory is given."""

    def __init__(self, directory: Path | None, name: str) -> None:
        self._directory = directory
        self._name = name
        self._temporary: Path | None = None
        self._connection: sqlite3.Connection | None = None
        self._closed = False

    @property
    def path(self) -> Path:
        if self._directory is None and self._temporary is None:
            self._temporary = Path(tempfile.mkdtemp(prefix="turnstile-state-"))
        folder = self._directory or self._temporary
        assert folder is not None
        return folder / f"{self._name}.sqlite"

    @property
    def _db(self) -> sqlite3.Connection:
        """Opened on first use: a worker made but never run leaves no file behind."""
        if self._closed:
            raise StoreClosed(f"the local store {self._name!r} is closed: the worker has stopped")
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._connection = sqlite3.connect(self.path, isolation_level=None)
            # Trusted only with a checkpoint a clean stop wrote: losing its last writes in a
            # crash costs nothing, so no journal fsync.
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=OFF")
            (layout,) = self._connection.execute("PRAGMA user_version").fetchone()
            if layout != _LAYOUT:
                self._connection.executescript("DROP TABLE IF EXISTS snapshot; DROP TABLE IF EXISTS checkpoint;")
                self._connection.execute(f"PRAGMA user_version = {_LAYOUT}")
            self._connection.executescript(_SCHEMA)
        return self._connection

    def put(self, rows: Iterable[Stored]) -> None:
        """Upsert rows in one transaction. A conversation new to the store is listed above the
        store's earlier rows (below the read model's); one already there keeps its place."""
        self._db.execute("BEGIN")
        try:
            (last,) = self._db.execute(
                "SELECT coalesce(max(listed), 0) FROM snapshot WHERE listed BETWEEN 1 AND ?", (LISTED_BY_THE_STORE - 1,)
            ).fetchone()
            self._db.executemany(
                "INSERT INTO snapshot (conversation, partition, covered, source, at, status, events, turns, pending,"
                " listed, value) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (conversation) DO UPDATE SET"
                " partition = excluded.partition, covered = excluded.covered, source = excluded.source,"
                " at = excluded.at, status = excluded.status, events = excluded.events, turns = excluded.turns,"
                " pending = excluded.pending, value = excluded.value",
                # In key order (their places are given in the order they came): inserts into
                # the key's B-trees near each other are cheaper (100,000 rows with UUID ids:
                # 1.39 -> 1.07 s).
                sorted((_columns(r, place) for place, r in enumerate(rows, start=last + 1)), key=itemgetter(0)),
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def get(self, conversation: str, partition: int) -> bytes | Unfilled | None:
        """The conversation's snapshot (None: no row; `Unfilled`: not fetched yet)."""
        found = self._db.execute(
            f"SELECT value, {_HEAD} FROM snapshot WHERE conversation = ? AND partition = ?", (conversation, partition)
        ).fetchone()
        if found is None:
            return None
        return Unfilled(_head(found[1:])) if found[0] is None else bytes(found[0])

    def waiting(self, conversation: str, partition: int) -> bool:
        """The conversation's row is unfilled (its snapshot's bytes are not read to say so)."""
        found = self._db.execute(
            "SELECT value IS NULL FROM snapshot WHERE conversation = ? AND partition = ?", (conversation, partition)
        ).fetchone()
        return found is not None and bool(found[0])

    def rows(self, partition: int, *, without_value: frozenset[str], after: str | None, limit: int) -> list[Stored]:
        """Up to `limit` of the partition's rows, in conversation order from past `after` (None:
        the first): a slice, so that a reader of many takes them with the loop running between
        (no statement stays open meanwhile). Those whose status is in `without_value` come
        without their bytes (they stay on disk until a reload; so do those of unfilled rows: None)."""
        past = "" if after is None else "AND conversation > ?"
        heads = self._db.execute(
            f"SELECT source, {_HEAD} FROM snapshot WHERE partition = ? {past} ORDER BY conversation LIMIT ?",
            (partition, limit) if after is None else (partition, after, limit),
        ).fetchall()
        out = []
        for source, *head in heads:
            row = Stored(_head(head), partition, source, None)
            if row.status not in without_value and isinstance(value := self.get(row.conversation, partition), bytes):
                row = Stored(row.head, partition, source, value)
            out.append(row)
        return out

    def unfilled(self, partition: int, limit: int, after: int = -1) -> list[Head]:
        """Up to `limit` of the partition's unfilled rows whose snapshots are past `after` on
        the snapshot topic, in their order there."""
        found = self._db.execute(
            f"SELECT {_HEAD} FROM snapshot INDEXED BY snapshot_unfilled WHERE partition = ? AND value IS NULL"
            " AND at > ? ORDER BY at LIMIT ?",
            (partition, after, limit),
        ).fetchall()
        return [_head(row) for row in found]

    def fill(self, partition: int, snapshots: Iterable[tuple[Head, bytes]]) -> int:
        """Give unfilled rows their snapshots: each only to the row still waiting for exactly
        that one (a row put again since keeps its own). Returns how many were filled."""
        self._db.execute("BEGIN")
        try:
            before = self._db.total_changes
            self._db.executemany(
                "UPDATE snapshot SET value = ? WHERE conversation = ? AND partition = ? AND at = ?"
                " AND covered = ? AND value IS NULL",
                ((value, h.conversation, partition, h.at, h.covered) for h, value in snapshots),
            )
            filled = self._db.total_changes - before
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return filled

    def relist(self, places: Iterable[tuple[str, int | None]]) -> None:
        """Give these conversations (those with a row) these places in the listing; None: a
        place at the bottom, below every other (a conversation back in memory, which the read
        model lists itself)."""
        self._db.execute("BEGIN")
        try:
            self._db.executemany(
                "UPDATE snapshot SET listed = coalesce(?, -rowid) WHERE conversation = ?", ((p, c) for c, p in places)
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def last_listed(self) -> int:
        """The highest place any row has (0: none)."""
        (last,) = self._db.execute("SELECT coalesce(max(listed), 0) FROM snapshot").fetchone()
        return int(last)

    def listing(
        self,
        partitions: Collection[int],
        status: Status | None,
        before: int | None,
        contains: str,
        above: int | None = None,
    ) -> Iterator[tuple[int, str, Status, int, int, int]]:
        """(place, conversation, status, events, turns, pending) of every row of `partitions`, highest place first,
        below `before` (None: from the top) and above `above` (None: to the bottom), of
        `status` (None: any), whose id contains `contains`. (Rows of other partitions wait
        to be dropped or refilled: not listed.)"""
        if not partitions:
            return
        owned = ", ".join(str(int(p)) for p in sorted(partitions))
        where, filters, index = ["listed < ?", f"partition IN ({owned})"], list[str | int](), "snapshot_listed"
        if above is not None:
            where.append("listed > ?")
            filters.append(above)
        if status is not None:
            # Literals, not parameters: SQLite takes a partial index only when the query has its
            # condition word for word.
            assert status in STATUSES, status
            where.append(f"status = '{status}'")
            if status != "idle":
                where.append("status != 'idle'")
                index = "snapshot_listed_unsettled"
        if contains:
            where.append("instr(conversation, ?) > 0")
            filters.append(contains)
        query = f"SELECT listed, conversation, status, events, turns, pending FROM snapshot INDEXED BY {index}"
        query += f" WHERE {' AND '.join(where)}"
        query += " ORDER BY listed DESC LIMIT ?"
        below = (1 << 62) if before is None else before
        while True:
            chunk = self._db.execute(query, (below, *filters, _WALK_CHUNK)).fetchall()
            yield from chunk
            if len(chunk) < _WALK_CHUNK:
                return
            below = chunk[-1][0]

    def forget(self, conversations: Iterable[str]) -> None:
        """Drop the rows of these conversations."""
        self._db.executemany("DELETE FROM snapshot WHERE conversation = ?", ((c,) for c in conversations))

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """Forget the rows (and checkpoints) of partitions no longer ours or to be refilled."""
        for p in partitions:
            # The checkpoint first: a crash between the two must not leave one vouching for no rows.
            self._db.execute("DELETE FROM checkpoint WHERE partition = ?", (p,))
            self._db.execute("DELETE FROM snapshot WHERE partition = ?", (p,))

    def checkpoint(self, partition: int) -> Checkpoint | None:
        """The partition's checkpoint: its rows are the heads topic's up to `heads_to`."""
        found = self._db.execute(
            "SELECT heads_to, watermark, watermark_source FROM checkpoint WHERE partition = ?", (partition,)
        ).fetchone()
        return None if found is None else Checkpoint(*found)

    def drop_checkpoint(self, partition: int) -> None:
        """From now on the partition's rows change without one."""
        self._db.execute("DELETE FROM checkpoint WHERE partition = ?", (partition,))

    def write_checkpoint(self, partition: int, mark: Checkpoint) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO checkpoint (partition, heads_to, watermark, watermark_source)"
            " VALUES (?, ?, ?, ?)",
            (partition, mark.heads_to, mark.watermark, mark.watermark_source),
        )

    def __len__(self) -> int:
        (count,) = self._db.execute("SELECT count(*) FROM snapshot").fetchone()
        return int(count)

    @property
    def closed(self) -> bool:
        """Closed by the worker's stop (a use after it raises `StoreClosed`)."""
        return self._closed

    def close(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
