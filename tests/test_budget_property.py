"""Property: whatever the budget and whatever the model and tools do (within what a real
provider does: it honours the output allowance), every outcome's metrics are within the
hard limits (the deadline's overrun only a side-effecting call's own length, which is not
cut off), and the auditor, told the same limits, finds no violation."""

from __future__ import annotations

import asyncio

from budget_harness import CONV, START, Harness, Step
from builders import message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.events import OUTCOME_TYPES, ToolCallFinished, ToolCallStarted, encode
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.pricing import ModelPrice
from turnstile.projections import apply_event, new_state
from turnstile.projections.audit import AuditLimits, audit
from turnstile.streams.log import Record

budgets = st.builds(
    TurnBudget,
    max_iterations=st.integers(1, 6),
    max_tool_calls=st.integers(0, 5),
    max_cost_usd=st.floats(0.0, 0.05),
    # Small: a step cut off by the deadline is waited for in real time until it is cancelled.
    deadline_ms=st.integers(1, 150),  # (0 is refused where a budget is made)
    soft_fraction=st.sampled_from([0.5, 0.75, 1.0]),
)
calls = st.lists(st.tuples(st.sampled_from(["search", "transfer"]), st.integers(0, 60)), max_size=3)
steps = st.builds(
    Step,
    ms=st.integers(0, 60),
    output_tokens=st.integers(1, 2000),
    calls=calls.map(tuple),
    text=st.sampled_from(["working", "done", ""]),
)
prices = st.builds(
    ModelPrice, input_per_mtok=st.sampled_from([0.0, 1.0, 3.0]), output_per_mtok=st.sampled_from([0.0, 10.0, 15.0])
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=budgets, script=st.lists(steps, max_size=8), price=prices)
def test_every_outcome_is_within_the_hard_limits_and_the_auditor_agrees(budget, script, price):
    h = Harness(script=list(script))
    first = message("m1", START - 60_000, "do the work", conv=CONV)
    state = new_state(CONV)
    assert apply_event(state, first) is None
    asyncio.run(h.run_turn(state, h.settings(budget, price)))

    [outcome] = [e for e in h.events if isinstance(e, OUTCOME_TYPES)]
    m = outcome.metrics
    assert m.iterations <= budget.max_iterations
    assert m.tool_calls <= budget.max_tool_calls
    assert m.cost_usd is not None and m.cost_usd <= budget.max_cost_usd
    # Nothing starts past the deadline; a side-effecting call started before it runs to its
    # end (cut off, it would be in doubt), and what follows it may be as late as that end.
    started = {e.call_id: e for e in h.events if isinstance(e, ToolCallStarted)}
    assert all(e.occurred_at - START <= budget.deadline_ms for e in started.values())
    effects_end = max(
        (e.occurred_at - START for e in h.events if isinstance(e, ToolCallFinished) and started[e.call_id].side_effect),
        default=0,
    )
    bound = max(budget.deadline_ms, effects_end)
    assert m.duration_ms <= bound
    assert all(e.occurred_at - START <= bound for e in h.events)

    limits = AuditLimits(budget.max_iterations, budget.max_tool_calls, budget.max_cost_usd, budget.deadline_ms / 1000)
    log = [Record(0, i, CONV.encode(), encode(e)) for i, e in enumerate([first, *h.events])]
    report = audit(log, limits, strict=True)
    assert report.ok, [(r.rule, [v.detail for v in r.violations]) for r in report.rules if r.violations]
