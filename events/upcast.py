"""Schema evolution: upcasters turn a value written under an older `schema_version` into
the current shape before it is validated.

Every event carries `schema_version`. When an event's shape changes incompatibly,
`SCHEMA_VERSION` goes up by one and an upcaster from the previous version is registered
here: a pure function from the old JSON object to the next version's JSON object. The
codec chains them (v1 -> v2 -> ... -> current), so a consumer always sees current
events and the log never has to be rewritten. Values of the current version never pay
for this: they take the codec's fast path.

Today every event is version 1 and the registry is empty; tests inject their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnstile.events.base import SCHEMA_VERSION

JsonObject = dict[str, Any]
# One step: the object of `from_version` in, the object of `from_version + 1` out.
Upcaster = Callable[[JsonObject], JsonObject]
ANY_TYPE = "*"


class UpcastError(ValueError):
    """The value cannot be brought to the current version."""


@dataclass(frozen=True, slots=True)
class Upcasters:
    """(event type or `*`, from_version) -> the step to from_version + 1.

    A step registered for one type wins over one registered for `*` (every type)."""

    steps: Mapping[tuple[str, int], Upcaster] = field(default_factory=dict)
    current: int = SCHEMA_VERSION

    def with_step(self, from_version: int, step: Upcaster, event_type: str = ANY_TYPE) -> Upcasters:
        return Upcasters({**self.steps, (event_type, from_version): step}, self.current)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def upcast(self, raw: JsonObject) -> JsonObject:
        """Apply every step from the value's version to the current one. A value without
        `schema_version` is taken as current (the field defaults to it)."""
        version = raw.get("schema_version", self.current)
        if not isinstance(version, int) or isinstance(version, bool):
            raise UpcastError(f"schema_version {version!r} is not an integer")
        if version > self.current:
            raise UpcastError(f"schema_version {version} is newer than this reader's {self.current}")
        while version < self.current:
            event_type = str(raw.get("type", ""))
            step = self.steps.get((event_type, version)) or self.steps.get((ANY_TYPE, version))
            if step is None:
                raise UpcastError(f"no upcaster for {event_type or 'untyped'} events of schema_version {version}")
            raw = dict(step(dict(raw)))
            version += 1
            raw["schema_version"] = version
        return raw


# The registry the codec uses by default. Add a step here with every version bump.
UPCASTERS = Upcasters()
