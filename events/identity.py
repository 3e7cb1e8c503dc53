"""Stable identities derived from content, so that every reader computes the same ids."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from aiokafka.partitioner import murmur2  # a pure function: Kafka's hash, as Java's client has it


def logical_turn_id(input_ids: Iterable[str]) -> str:
    """The logical turn of a set of claimed inputs: sha256 of the sorted ids, one per line.

    Automatic retries claim the same inputs, so they share it; an injected input's id is
    its occurrence key, so a schedule that fires twice for one occurrence maps to one turn.
    """
    return hashlib.sha256("\n".join(sorted(input_ids)).encode()).hexdigest()


def content_fingerprint(content: str) -> str:
    """Short digest used to tell a harmless re-publish from an id reused for other content."""
    return hashlib.blake2b(content.encode(), digest_size=12).hexdigest()


def partition_for(key: str, partitions: int) -> int:
    """Kafka's default partitioner: the same partition a Java or Go producer picks, and so
    the one partition where a conversation's events live."""
    hashed: int = murmur2(key.encode())
    return (hashed & 0x7FFFFFFF) % partitions
