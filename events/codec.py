"""The wire codec: compact JSON (orjson) in, validated events out.

`decode` never raises: a consumer must be able to route any byte string it meets to the
dead-letter topic with a reason, and keep its partition moving.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from events.union import EVENT_ADAPTER, Event

DEFAULT_MAX_VALUE_BYTES = 1_000_000


@dataclass(frozen=True, slots=True)
class DecodeError:
    """Why a value was not accepted. `reason` is a short stable code, `detail` is for people."""

    reason: str  # not_json | invalid_event | too_large | key_mismatch | conflicting_duplicate
    detail: str


def encode(event: Event) -> bytes:
    return orjson.dumps(event.model_dump(mode="json"))


def decode(value: bytes | None, max_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> Event | DecodeError:
    if value is None:
        return DecodeError("not_json", "empty value (tombstone)")
    if len(value) > max_bytes:
        return DecodeError("too_large", f"value is {len(value)} bytes, the limit is {max_bytes}")
    try:
        return EVENT_ADAPTER.validate_json(value)
    except ValidationError as exc:
        return _classify(exc)


def _classify(exc: ValidationError) -> DecodeError:
    errors = exc.errors(include_url=False, include_input=False)
    if errors and errors[0]["type"] == "json_invalid":
        return DecodeError("not_json", str(errors[0]["msg"]))
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<value>'}: {e['msg']}" for e in errors[:5])
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return DecodeError("invalid_event", shown + more)
