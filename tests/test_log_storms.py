"""A client library's storm of one log line is cut to a few per window, and what was held
back is counted on the next line that passes (an operator's worker wrote 240,000 aiokafka
lines, 28 MB, in 80 s of broker outage)."""

from __future__ import annotations

import logging

import pytest

from turnstile.streams.log_storms import RepeatLimit, limit_client_storms


def line(template: str, *args: object, name: str = "aiokafka.conn", level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, template, args, None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_storm_of_one_line_passes_a_few_a_window_and_says_how_many_it_held() -> None:
    clock = Clock()
    limit = RepeatLimit(per_window=5, window_s=10.0, now=clock)
    # Given 100 lines of one template, their arguments all different, within 10 s
    passed = [limit.filter(line("Unable connect to node with id %s: %s", n, "refused")) for n in range(100)]
    assert passed.count(True) == 5 and passed[:5] == [True] * 5
    # When the window has gone by, the next one passes and says what was held back
    clock.now = 10.0
    nxt = line("Unable connect to node with id %s: %s", 7, "refused")
    assert limit.filter(nxt)
    said = nxt.getMessage()
    assert said == "Unable connect to node with id 7: refused [95 more like this in the 10 s before, not shown]"


def test_the_count_held_back_names_the_time_it_spans_and_a_line_it_cannot_read_passes() -> None:
    clock = Clock()
    limit = RepeatLimit(per_window=1, window_s=10.0, now=clock)
    assert limit.filter(line("Coordinator %s dead", 1)) and not limit.filter(line("Coordinator %s dead", 2))
    clock.now = 95.0  # the storm ended long ago: the count says over what span it was held
    nxt = line("Coordinator %s dead", 3)
    assert limit.filter(nxt)
    assert nxt.getMessage() == "Coordinator 3 dead [1 more like this in the 95 s before, not shown]"
    # A line that cannot be formatted, when a count is to be added to it: it passes as it is,
    # and nothing is raised into the caller's logging call.
    assert limit.filter(line("two args %s %s", 1, 2)) and not limit.filter(line("two args %s %s", 3, 4))
    clock.now = 200.0
    broken = line("two args %s %s", 5)
    assert limit.filter(broken)


def test_other_lines_levels_and_loggers_have_windows_of_their_own() -> None:
    limit = RepeatLimit(per_window=1, window_s=10.0, now=Clock())
    assert limit.filter(line("Unable to update metadata from %s", 1))
    assert not limit.filter(line("Unable to update metadata from %s", 2))
    assert limit.filter(line("Unable to update metadata from %s", 3, level=logging.WARNING))
    assert limit.filter(line("Unable to update metadata from %s", 4, name="aiokafka.cluster"))
    assert limit.filter(line("Coordinator %s dead", 5))


def test_every_aiokafka_logger_is_limited(caplog: pytest.LogCaptureFixture) -> None:
    limit_client_storms()
    limit_client_storms()  # (once is enough: no second filter)
    conn = logging.getLogger("aiokafka.conn")
    assert sum(1 for f in conn.filters if isinstance(f, RepeatLimit)) == 1
    with caplog.at_level(logging.ERROR, logger="aiokafka"):
        for n in range(50):
            conn.error("a storm line only this test makes, node %s", n)
    assert len([r for r in caplog.records if "only this test makes" in r.getMessage()]) == 5
    # The engine's own lines are not limited: each says something of its own.
    assert not any(isinstance(f, RepeatLimit) for f in logging.getLogger("turnstile.streams.worker").filters)
