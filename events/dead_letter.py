"""The value written to the dead-letter topic for input that was not accepted, and the
decision of what a dead letter can carry within the size the dead-letter topic accepts."""

from __future__ import annotations

import base64
import hashlib

import orjson
from pydantic import BaseModel, ConfigDict

# A refusal's detail is for people; a long one (a validator listing a huge value's errors)
# must not crowd out the bytes themselves.
MAX_DETAIL_CHARS = 2_000


class DeadLetter(BaseModel):
    """The original bytes (base64, since they may not be UTF-8), where they were read and
    why they were refused. Enough to fix the producer and re-publish.

    When the whole value does not fit in a record of the dead-letter topic,
    `value_truncated` is set and `value_base64` holds a prefix only; `value_bytes` and
    `value_sha256` describe the whole value, which stays on the events topic at
    `partition`@`offset` to be fetched from there. A key so long that the letter would not
    fit even without the value is cut too (`key_truncated`; the whole key is there as well)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    detail: str
    value_base64: str
    value_bytes: int | None = None
    value_sha256: str | None = None
    value_truncated: bool = False
    key_truncated: bool = False

    @classmethod
    def of(
        cls,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        reason: str,
        detail: str,
        max_bytes: int | None = None,
    ) -> DeadLetter:
        """The dead letter of the record at `topic` `partition`@`offset`: its whole value if
        the encoded letter then takes at most `max_bytes` (None: no limit), else the
        longest prefix that keeps it within `max_bytes`."""
        original = value or b""
        whole = cls(
            topic=topic,
            partition=partition,
            offset=offset,
            key=None if key is None else key.decode("utf-8", "backslashreplace"),
            reason=reason,
            detail=detail[:MAX_DETAIL_CHARS],
            value_base64=base64.b64encode(original).decode("ascii"),
            value_bytes=len(original),
            value_sha256=hashlib.sha256(original).hexdigest(),
        )
        if max_bytes is None or len(whole.encode()) <= max_bytes:
            return whole
        cut = whole.model_copy(update={"value_base64": "", "value_truncated": True})
        if whole.key and len(cut.encode()) > max_bytes:  # it is the key that does not fit
            if len(whole.model_copy(update={"key": "", "key_truncated": True}).encode()) <= max_bytes:
                return _key_cut(whole, max_bytes)  # the whole value, and as much of the key as fits
            cut = cut.model_copy(update={"key": "", "key_truncated": True})
        # base64 has no character JSON escapes: the letter grows by exactly 4 per 3 bytes.
        room = max_bytes - len(cut.encode())
        if room < 0:
            raise ValueError(f"a dead letter of this record needs more than {max_bytes} bytes even without its value")
        prefix = original[: room // 4 * 3]
        return cut.model_copy(update={"value_base64": base64.b64encode(prefix).decode("ascii")})

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    def original_value(self) -> bytes:
        """The bytes carried: the whole value, or its prefix when `value_truncated`."""
        return base64.b64decode(self.value_base64)


def _key_cut(letter: DeadLetter, max_bytes: int) -> DeadLetter:
    """`letter` with the longest prefix of its key that keeps it within `max_bytes` (a key's
    characters may take up to six bytes each once escaped, so the length is searched)."""
    key = letter.key or ""
    fits, over = 0, len(key)
    while over - fits > 1:
        middle = (fits + over) // 2
        if len(letter.model_copy(update={"key": key[:middle], "key_truncated": True}).encode()) <= max_bytes:
            fits = middle
        else:
            over = middle
    return letter.model_copy(update={"key": key[:fits], "key_truncated": True})
