"""On the real broker: a rolling deploy (drain, then restart under the same instance id, one
worker after the other) under a steady stream of turns with a side effect is invisible to
users -- every message answered once, no turn failed, no attempt interrupted, no model step
asked twice, no outcome record written twice, no side effect run twice."""

from __future__ import annotations

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from rolling_deploy import Shape, rolling_deploy

from turnstile.streams.log import Topics

pytestmark = pytest.mark.kafka


async def test_a_rolling_deploy_with_drain_and_static_membership_fails_no_turn(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
):
    figures = await rolling_deploy(kafka_bootstrap, fresh_topics, Shape(messages=60, conversations=30, over_s=5.0))
    assert (figures.answered, figures.unanswered) == (60, 0)
    assert figures.turns_failed == 0
    assert figures.attempts_interrupted == 0
    assert figures.model_requests_repeated == 0
    assert figures.outcome_records_duplicated == 0
    assert figures.transfers_run_twice == 0
