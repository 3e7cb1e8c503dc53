"""The ids the running service draws (event and run ids) are random version-4 UUIDs."""

import uuid

from turnstile.streams.runtime import RandomIds


def test_random_ids_are_version_4_uuids_in_hex_and_distinct() -> None:
    ids = [RandomIds().new() for _ in range(2_000)]
    assert len(set(ids)) == len(ids)
    for one in ids:
        parsed = uuid.UUID(hex=one)
        assert (parsed.hex, parsed.version, parsed.variant) == (one, 4, uuid.RFC_4122)
