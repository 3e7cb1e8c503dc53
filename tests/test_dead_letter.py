"""What a dead letter carries, at the exact edges of the size the dead-letter topic accepts."""

from __future__ import annotations

import hashlib

import pytest

from turnstile.events import DeadLetter

VALUE = b"\xff not json " * 100  # not UTF-8, so carried as base64


def letter(max_bytes: int | None, value: bytes = VALUE, key: bytes | None = b"conv") -> DeadLetter:
    return DeadLetter.of("turnstile.events", 3, 42, key, value, "not_json", "bad", max_bytes)


WHOLE = len(letter(None).encode())  # the size of the letter that carries all of VALUE


def test_given_a_limit_the_whole_letter_meets_when_dead_lettered_then_the_whole_value_is_carried() -> None:
    for limit in (WHOLE, WHOLE + 1):
        got = letter(limit)
        assert got.original_value() == VALUE and not got.value_truncated
        assert len(got.encode()) <= limit


def test_given_a_limit_one_byte_short_when_dead_lettered_then_a_prefix_its_size_and_hash_are_carried() -> None:
    got = letter(WHOLE - 1)
    assert len(got.encode()) <= WHOLE - 1
    assert got.value_truncated
    assert VALUE.startswith(got.original_value()) and len(got.original_value()) >= len(VALUE) - 3
    assert got.value_bytes == len(VALUE) and got.value_sha256 == hashlib.sha256(VALUE).hexdigest()
    assert (got.topic, got.partition, got.offset) == ("turnstile.events", 3, 42)  # where to fetch it whole


@pytest.mark.parametrize("size", [1, 2, 3, 1000, 999_999, 1_048_576])
def test_given_a_value_of_any_size_when_dead_lettered_under_a_limit_then_the_letter_fits_and_uses_the_room(
    size: int,
) -> None:
    value = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    limit = 10_000
    got = letter(limit, value)
    encoded = len(got.encode())
    assert encoded <= limit
    if got.value_truncated:
        assert encoded > limit - 4  # a longer prefix (3 bytes = 4 characters more) would not fit
    DeadLetter.model_validate_json(got.encode())  # and it reads back


def test_given_a_null_key_when_dead_lettered_then_the_letter_keeps_a_null_key() -> None:
    assert DeadLetter.model_validate_json(letter(None, key=None).encode()).key is None


def test_given_a_limit_smaller_than_the_letter_without_its_value_when_dead_lettered_then_it_says_so() -> None:
    with pytest.raises(ValueError, match="even without its value"):
        letter(100)


def test_given_a_very_long_detail_when_dead_lettered_then_it_is_cut_so_the_bytes_keep_their_room() -> None:
    got = DeadLetter.of("t", 0, 0, b"k", b"v", "invalid_event", "e" * 100_000)
    assert len(got.detail) < 10_000 and got.original_value() == b"v"


def test_given_a_key_too_long_for_the_limit_when_dead_lettered_then_the_key_is_cut_and_the_value_kept() -> None:
    key, value = b"k" * 5000, b"not json"
    whole = len(letter(None, value, key).encode())
    assert letter(whole, value, key).key == key.decode()  # exactly at the limit: all of it
    limit = whole - 100  # under what the letter takes even without its value: the key is over
    got = letter(limit, value, key)
    assert got.key_truncated and not got.value_truncated and got.original_value() == value
    assert len(got.encode()) <= limit and key.decode().startswith(got.key or "x")
    longer = got.model_copy(update={"key": key.decode()[: len(got.key or "") + 1]})
    assert len(longer.encode()) > limit  # the longest prefix that fits


def test_given_a_limit_the_key_alone_is_over_when_dead_lettered_then_the_key_goes_and_a_value_prefix_stays() -> None:
    key, value = b"k" * 5000, b"v" * 5000
    got = letter(3000, value, key)
    assert got.key == "" and got.key_truncated and got.value_truncated and len(got.encode()) <= 3000
    assert value.startswith(got.original_value()) and len(got.original_value()) > 1000
