"""The value of a record on the deltas topic (`turnstile.deltas`, keyed by conversation id):
a piece of a reply while it streams in. Not an event: the events topic records the reply
once, whole, in `ModelResponded`; deltas serve live readers only and expire within the hour.

Per run and iteration, records are numbered from 0 in `seq`. A record carries the text that
follows the text so far of its `iteration`, or says that the text so far is void
(`restart`: the request is being sent again, or to a fallback model), or that the
iteration's reply is complete (`done`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from turnstile.events.base import MAX_INT, EpochMillis, Identifier

Count = Annotated[int, Field(ge=0, lt=MAX_INT)]


# One piece of a streamed reply: a longer piece is sent as several, in order.
MAX_DELTA_CHARS = 100_000


class ReplyDelta(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["ReplyDelta"] = "ReplyDelta"
    conversation_id: Identifier
    turn_id: Identifier
    run_id: Identifier
    attempt: Annotated[int, Field(ge=1, lt=MAX_INT)]
    iteration: Annotated[int, Field(ge=1, lt=MAX_INT)]
    seq: Count
    occurred_at: EpochMillis
    text: Annotated[str, Field(max_length=MAX_DELTA_CHARS)] = ""
    restart: bool = False
    done: bool = False


def encode_delta(delta: ReplyDelta) -> bytes:
    return orjson.dumps(delta.model_dump(mode="json"))


def decode_delta(value: bytes | None) -> ReplyDelta | None:
    """The delta, or None for a value that is not one (a reader skips it: nothing durable
    depends on this topic)."""
    if value is None:
        return None
    try:
        return ReplyDelta.model_validate_json(value)
    except ValidationError:
        return None
