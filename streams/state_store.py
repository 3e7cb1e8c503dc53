"""The worker's local store of conversation snapshots: one SQLite file.

It holds the latest snapshot (the bytes of `turnstile.projections.snapshot`) of every
conversation of the partitions this worker owns, so that an idle conversation can leave
memory and come back on demand (`streams/eviction.py`). It is a cache of the snapshot topic,
never the truth: each assignment refills a partition's rows from that topic, so a missing or
stale file costs nothing but the read the assignment does anyway, and the file needs no
backup and no fsync.

Why SQLite (the standard library's `sqlite3`): what the worker needs is point reads and
batched upserts by key, from one process; SQLite is in every CPython, one file, and its page
cache bounds its own memory. RocksDB or LMDB bindings would be a compiled dependency for a
store whose hot path -- the reload of an evicted conversation -- is one primary-key read of a
few kilobytes.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections.abc import Iterable
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshot (
    conversation TEXT PRIMARY KEY,
    partition    INTEGER NOT NULL,
    value        BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS snapshot_by_partition ON snapshot (partition);
"""


class StateStore:
    """Snapshots by conversation id in `directory`/`name`.sqlite; a temporary folder (removed
    on close) when no directory is given."""

    def __init__(self, directory: Path | None, name: str) -> None:
        self._directory = directory
        self._name = name
        self._temporary: Path | None = None
        self._connection: sqlite3.Connection | None = None

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
        if self._connection is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._connection = sqlite3.connect(self.path, isolation_level=None)
            # A cache refilled from the snapshot topic on assignment: losing its last writes
            # in a crash costs nothing, so no journal fsync.
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=OFF")
            self._connection.executescript(_SCHEMA)
        return self._connection

    def put(self, rows: Iterable[tuple[str, int, bytes]]) -> None:
        """Upsert (conversation, partition, snapshot bytes) rows in one transaction."""
        self._db.execute("BEGIN")
        try:
            self._db.executemany(
                "INSERT INTO snapshot (conversation, partition, value) VALUES (?, ?, ?) ON CONFLICT (conversation)"
                " DO UPDATE SET partition = excluded.partition, value = excluded.value",
                rows,
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def get(self, conversation: str, partition: int) -> bytes | None:
        found = self._db.execute(
            "SELECT value FROM snapshot WHERE conversation = ? AND partition = ?", (conversation, partition)
        ).fetchone()
        return None if found is None else bytes(found[0])

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        """Forget the rows of partitions no longer ours (or about to be refilled)."""
        self._db.executemany("DELETE FROM snapshot WHERE partition = ?", ((p,) for p in partitions))

    def __len__(self) -> int:
        (count,) = self._db.execute("SELECT count(*) FROM snapshot").fetchone()
        return int(count)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
