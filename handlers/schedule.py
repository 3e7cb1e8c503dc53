"""Schedules: when a scheduled input is due, and the `InputInjected` it becomes. Pure: the
time comes in as an argument, and the same schedule and times always give the same
occurrences and the same keys.

A schedule fires at occurrence times: an interval (`every_ms` from an anchor) or a small
cron (five UTC fields: minute hour day-of-month month day-of-week, with `*`, `a-b`, `*/n`,
`a-b/n` and lists; `@hourly`, `@daily`, `@weekly`, `@monthly`). Each occurrence becomes an
input whose `occurrence_key` is the schedule id and the occurrence time, so a schedule
that fires twice for one occurrence (two workers, a restart) yields one input and one
logical turn: the fold keeps the first and ignores the duplicate. Missed occurrences are
not replayed as a storm: at most `max_catch_up` of those within `grace_ms` fire, latest
first kept.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from turnstile.events import InputInjected

_DAY_MS = 86_400_000
_MACROS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *"}
# field name, lowest, highest
_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7))


class ScheduleError(ValueError):
    """A schedule definition that cannot be used."""


@dataclass(frozen=True, slots=True)
class Interval:
    """Occurrences at `anchor_ms + k * every_ms`."""

    every_ms: int
    anchor_ms: int = 0

    def __post_init__(self) -> None:
        if self.every_ms < 1000:
            raise ScheduleError("an interval must be at least one second")

    def between(self, after_ms: int, until_ms: int) -> Iterator[int]:
        """Occurrence times t with after_ms < t <= until_ms, in order."""
        t = self.anchor_ms + ((after_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms
        while t <= until_ms:
            yield t
            t += self.every_ms

    def next_after(self, after_ms: int) -> int:
        return self.anchor_ms + ((after_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms


def _field(text: str, name: str, low: int, high: int) -> frozenset[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if body == "*":
                start, end = low, high
            elif "-" in body:
                a, b = body.split("-", 1)
                start, end = int(a), int(b)
            else:
                start = int(body)
                end = high if step_text else start
        except ValueError:
            raise ScheduleError(f"cannot read {part!r} in the {name} field") from None
        if step < 1 or not low <= start <= end <= high:
            raise ScheduleError(f"{part!r} is out of range for the {name} field ({low}-{high})")
        values.update(range(start, end + 1, step))
    return frozenset(values)


@dataclass(frozen=True, slots=True)
class Cron:
    """Five UTC fields. As in cron, when both day fields are restricted a day matches
    either of them; 0 and 7 are Sunday."""

    expression: str

    def __post_init__(self) -> None:
        self._parsed()  # fail at definition time, not at the first tick

    def _parsed(self) -> tuple[frozenset[int], ...]:
        text = _MACROS.get(self.expression.strip(), self.expression)
        parts = text.split()
        if len(parts) != 5:
            raise ScheduleError(f"a cron expression has five fields, got {self.expression!r}")
        return tuple(_field(p, name, low, high) for p, (name, low, high) in zip(parts, _FIELDS, strict=True))

    def _days(self, first: dt.date, last: dt.date) -> Iterator[tuple[dt.date, list[int]]]:
        minutes, hours, doms, months, dows = self._parsed()
        dows = frozenset(d % 7 for d in dows)
        dom_any = doms == frozenset(range(1, 32))
        dow_any = dows == frozenset(range(7))
        times = sorted(h * 3_600_000 + m * 60_000 for h in hours for m in minutes)
        day = first
        while day <= last:
            if day.month in months:
                dom_ok, dow_ok = day.day in doms, (day.weekday() + 1) % 7 in dows
                # cron's rule: with both day fields restricted, either may match
                if (dom_ok and dow_ok) if dom_any or dow_any else (dom_ok or dow_ok):
                    yield day, times
            day += dt.timedelta(days=1)

    def between(self, after_ms: int, until_ms: int) -> Iterator[int]:
        if until_ms <= after_ms:
            return
        for day, times in self._days(_date(after_ms), _date(until_ms)):
            base = _midnight_ms(day)
            for offset in times:
                if after_ms < base + offset <= until_ms:
                    yield base + offset

    def next_after(self, after_ms: int) -> int | None:
        """The first occurrence after `after_ms` within five years (None: never, e.g. 30 Feb)."""
        start = _date(after_ms)
        for day, times in self._days(start, start + dt.timedelta(days=5 * 366)):
            base = _midnight_ms(day)
            for offset in times:
                if base + offset > after_ms:
                    return base + offset
        return None


def _date(ms: int) -> dt.date:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).date()


def _midnight_ms(day: dt.date) -> int:
    return int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()) * 1000


Timing = Interval | Cron


MIN_GRACE_MS = 10_000  # how late an occurrence may always still fire


@dataclass(frozen=True, slots=True)
class Schedule:
    schedule_id: str
    conversation_id: str
    content: str
    timing: Timing
    # Occurrences missed by more than this are skipped; of the rest, only the latest
    # `max_catch_up` fire.
    grace_ms: int = 3_600_000
    max_catch_up: int = 1

    def __post_init__(self) -> None:
        if not self.schedule_id or "@" in self.schedule_id:
            raise ScheduleError("a schedule id is non-empty and has no '@' (it separates the occurrence time)")
        if not self.conversation_id or not self.content:
            raise ScheduleError("a schedule names a conversation and the content to inject")
        if self.grace_ms < MIN_GRACE_MS or self.max_catch_up < 1:
            # A worker wakes a moment after each occurrence (its loop, a collection): under a
            # smaller grace the occurrence it woke for was already too late, and was dropped.
            raise ScheduleError(f"grace_s must be at least {MIN_GRACE_MS // 1000} and max_catch_up at least 1")


def due(schedule: Schedule, last_fired_ms: int | None, now_ms: int) -> tuple[int, ...]:
    """The occurrences to fire now, oldest first: those after `last_fired_ms` (the latest
    occurrence already fired, if known) and no older than the grace period, at most
    `max_catch_up` of them (the latest)."""
    after = now_ms - schedule.grace_ms - 1
    if last_fired_ms is not None:
        after = max(after, last_fired_ms)
    times: list[int] = []
    for t in schedule.timing.between(after, now_ms):
        times.append(t)
        if len(times) > schedule.max_catch_up:
            del times[0]
    return tuple(times)


def next_due(schedule: Schedule, now_ms: int) -> int | None:
    return schedule.timing.next_after(now_ms)


def occurrence_key(schedule: Schedule, at_ms: int) -> str:
    """`<schedule id>@<occurrence time, ISO 8601 UTC>`: stable, readable, unique per occurrence."""
    moment = dt.datetime.fromtimestamp(at_ms / 1000, dt.UTC)
    stamp = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if at_ms % 1000:
        stamp += f".{at_ms % 1000:03d}"
    return f"{schedule.schedule_id}@{stamp}Z"


def injected(schedule: Schedule, at_ms: int, *, event_id: str) -> InputInjected:
    """The input of one occurrence. Everything but `event_id` depends only on the schedule
    and the occurrence, so a second firing is an exact duplicate the fold ignores."""
    return InputInjected(
        event_id=event_id,
        conversation_id=schedule.conversation_id,
        occurred_at=at_ms,
        occurrence_key=occurrence_key(schedule, at_ms),
        source="schedule",
        content=schedule.content,
    )


def parse_schedule(raw: Mapping[str, Any]) -> Schedule:
    """One schedule from its JSON form:
    `{"id", "conversation", "content", "every_s" | "cron", "anchor_ms"?, "grace_s"?, "max_catch_up"?}`."""
    known = {"id", "conversation", "content", "every_s", "cron", "anchor_ms", "grace_s", "max_catch_up"}
    unknown = set(raw) - known
    if unknown:
        raise ScheduleError(f"unknown schedule field(s): {sorted(unknown)}")
    if ("every_s" in raw) == ("cron" in raw):
        raise ScheduleError("a schedule has exactly one of 'every_s' and 'cron'")
    try:
        timing: Timing = (
            Interval(round(float(raw["every_s"]) * 1000), int(raw.get("anchor_ms", 0)))
            if "every_s" in raw
            else Cron(str(raw["cron"]))
        )
        return Schedule(
            schedule_id=str(raw["id"]),
            conversation_id=str(raw["conversation"]),
            content=str(raw["content"]),
            timing=timing,
            grace_ms=round(float(raw.get("grace_s", 3600)) * 1000),
            max_catch_up=int(raw.get("max_catch_up", 1)),
        )
    except KeyError as missing:
        raise ScheduleError(f"a schedule needs {missing}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ScheduleError):
            raise
        raise ScheduleError(f"invalid schedule: {exc}") from None


def parse_schedules(raw: Any) -> tuple[Schedule, ...]:
    if not isinstance(raw, list):
        raise ScheduleError("schedules are a JSON list")
    schedules = tuple(parse_schedule(item) for item in raw)
    ids = [s.schedule_id for s in schedules]
    if len(set(ids)) != len(ids):
        raise ScheduleError("schedule ids must be unique")
    return schedules
