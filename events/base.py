"""The envelope every event carries.

Every value on the events topic is one JSON object with these fields next to the
event's own. The envelope is flat (not nested) so that `kcat`, `jq` and consumers in
any language can filter on `type` or `conversation_id` without knowing the schema.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

SCHEMA_VERSION = 1

# Identifiers are opaque strings chosen by producers (message ids) or by the engine
# (event, run and turn ids). Bounded so that a hostile value cannot bloat the state.
MAX_ID_CHARS = 256
Identifier = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
EpochMillis = Annotated[int, Field(ge=0, lt=2**53)]
# Every integer on the wire stays below 2**53: exact in any JSON reader, and what decoded
# always re-encodes (a value beyond 64 bits would decode, then make `encode` raise).
MAX_INT = 2**53


class Envelope(BaseModel):
    """Fields common to every event. Frozen, and unknown fields are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    schema_version: Annotated[int, Field(ge=1, le=SCHEMA_VERSION)] = SCHEMA_VERSION
    event_id: Identifier
    conversation_id: Identifier
    occurred_at: EpochMillis
    causation_id: Identifier | None = None


class TurnEnvelope(Envelope):
    """Envelope of every event that belongs to one attempt of one logical turn."""

    turn_id: Identifier
    run_id: Identifier
    attempt: Annotated[int, Field(ge=1, lt=MAX_INT)]
