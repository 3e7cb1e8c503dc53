"""The value written to the dead-letter topic for input that was not accepted."""

from __future__ import annotations

import base64

import orjson
from pydantic import BaseModel, ConfigDict


class DeadLetter(BaseModel):
    """The original bytes (base64, since they may not be UTF-8), where they were read and
    why they were refused. Enough to fix the producer and re-publish."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    detail: str
    value_base64: str

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
    ) -> DeadLetter:
        return cls(
            topic=topic,
            partition=partition,
            offset=offset,
            key=None if key is None else key.decode("utf-8", "backslashreplace"),
            reason=reason,
            detail=detail,
            value_base64=base64.b64encode(value or b"").decode("ascii"),
        )

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    def original_value(self) -> bytes:
        return base64.b64decode(self.value_base64)
