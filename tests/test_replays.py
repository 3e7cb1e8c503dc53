"""The Replayer over the recorded histories (tests/replays/*.jsonl): today's `decide` must
return, at every step of every recorded turn, the commands the recording holds. A failure
names the history and the step; re-record (tests/replays/record.py) only on purpose."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
from replay_scenarios import FAMILY, REPLAYS, SCENARIOS, Clock, record

from turnstile.handlers.replayer import Divergence, History, history_of, replay

HISTORIES = sorted(REPLAYS.glob("*.jsonl"))


def load(path: Path) -> History:
    return history_of(path.stem, (orjson.loads(line) for line in path.read_bytes().splitlines()))


def test_every_scenario_has_a_recorded_history_and_every_history_a_scenario():
    assert sorted(p.stem for p in HISTORIES) == sorted(SCENARIOS)


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_a_recorded_turn_replays_to_the_same_decisions(path: Path):
    history = load(path)
    assert history.steps, f"{path.name} holds no steps"
    divergence = replay(history, SCENARIOS[path.stem].settings(Clock()), FAMILY)
    assert divergence is None, str(divergence)


def test_a_change_that_decides_differently_is_named_with_its_history_and_step():
    # Given the recorded retry, when the backoff policy changes, then the step that
    # decides the wait diverges -- not the steps before it.
    settings = dataclasses.replace(SCENARIOS["retried"].settings(Clock()), backoff_base_ms=500)
    divergence = replay(load(REPLAYS / "retried.jsonl"), settings, FAMILY)
    assert isinstance(divergence, Divergence)
    assert (divergence.history, divergence.step, divergence.observation) == ("retried", 2, "ModelFailed")
    assert "command 2 differs at SleepUntil.due_ms" in str(divergence)


def test_a_changed_request_is_named_down_to_the_field():
    history = load(REPLAYS / "completed.jsonl")
    # The output allowance of every request changes: the first request already differs.
    settings = dataclasses.replace(SCENARIOS["completed"].settings(Clock()), max_output_tokens=100)
    divergence = replay(history, settings, FAMILY)
    assert isinstance(divergence, Divergence) and divergence.step == 1
    assert "command 3 differs at CallModel.request.max_output_tokens" in str(divergence)
    assert (divergence.recorded, divergence.decided) == (200, 100)


@pytest.mark.parametrize("name", ["resume", "approval", "retried"])
async def test_the_executor_on_the_embedded_log_still_records_the_same_history(name: str, tmp_path: Path):
    # The recording is deterministic (scripted clock, counter ids): the real executor run
    # again writes the history that is checked in.
    lines = await record(SCENARIOS[name], tmp_path)
    assert [orjson.loads(orjson.dumps(line)) for line in lines] == [
        orjson.loads(line) for line in (REPLAYS / f"{name}.jsonl").read_bytes().splitlines()
    ]
