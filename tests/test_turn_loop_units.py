"""The pure parts of the turn loop: signatures, budgets, prices, compaction, fallback."""

from __future__ import annotations

import pytest
from builders import claim, message, started
from pydantic import BaseModel

from turnstile.events import Approval, InputInjected, ToolCall, TurnMetrics, TurnPaused, Usage
from turnstile.handlers.budget import Spent, TurnBudget, hard_limit, soft_dimension, spending_limit
from turnstile.handlers.compaction import compact_tool_exchanges
from turnstile.handlers.fallback import FallTo, NoFallback, RouteInfo, next_route
from turnstile.handlers.pricing import ModelPrice, cost_usd
from turnstile.handlers.protocol import RepeatPolicy
from turnstile.handlers.provider import ChatMessage, ProviderError
from turnstile.handlers.tools import InvalidCall, Tool, ToolRegistry, ValidCall, call_signature, validate_call
from turnstile.projections import apply_event, new_state
from turnstile.streams.turn_runner import TurnSettings


class Args(BaseModel):
    q: str


async def run(args: Args) -> str:
    return args.q


def test_the_signature_ignores_spacing_and_key_order_but_not_values():
    assert call_signature("t", '{"a": 1, "b": [1, {"y": 2, "x": 1}]}') == call_signature(
        "t", '{"b":[1,{"x":1,"y":2}],"a":1}'
    )
    assert call_signature("t", '{"a": 1}') != call_signature("t", '{"a": 2}')
    assert call_signature("t", '{"a": 1}') != call_signature("u", '{"a": 1}')
    assert call_signature("t", " {broken ") == call_signature("t", "{broken")


def test_validation_happens_before_anything_runs():
    registry = ToolRegistry([Tool("search", "Search.", Args, run)])
    ok = validate_call(registry, ToolCall(call_id="1", name="search", arguments='{"q": "x"}'), isolated=False)
    assert isinstance(ok, ValidCall) and ok.arguments == Args(q="x")
    bad = validate_call(registry, ToolCall(call_id="2", name="search", arguments='{"q": 1}'), isolated=False)
    assert isinstance(bad, InvalidCall) and bad.kind == "malformed_arguments"
    hidden = validate_call(registry, ToolCall(call_id="3", name="search", arguments="{}"), isolated=True)
    assert isinstance(hidden, InvalidCall) and hidden.kind == "unknown_tool"
    with pytest.raises(ValueError, match="twice"):
        ToolRegistry([Tool("a", "", Args, run), Tool("a", "", Args, run)])


def test_the_four_limits_are_independent():
    budget = TurnBudget(max_iterations=5, max_tool_calls=3, max_cost_usd=1.0, deadline_ms=1000)
    fresh = Spent(iterations=4, tool_calls=2, cost_usd=0.9, elapsed_ms=999)
    assert hard_limit(fresh, budget, "m") is None
    assert hard_limit(Spent(0, 3, 0.0, 0), budget, "m").dimension == "tool_calls"
    assert hard_limit(Spent(0, 0, 1.0, 0), budget, "m").dimension == "cost"
    assert hard_limit(Spent(0, 0, 0.0, 1000), budget, "m").dimension == "deadline"
    unknown = spending_limit(Spent(0, 0, None, 0), budget, "m")
    assert unknown is not None and unknown.dimension == "cost" and "unknown" in unknown.reason
    assert spending_limit(Spent(0, 3, 0.0, 0), budget, "m") is None  # tool calls do not stop a request


def test_the_soft_threshold_names_the_first_dimension_past_it():
    budget = TurnBudget(max_iterations=8, max_tool_calls=8, max_cost_usd=1.0, deadline_ms=1000, soft_fraction=0.5)
    assert soft_dimension(Spent(1, 1, 0.1, 100), budget) is None
    assert soft_dimension(Spent(4, 1, 0.1, 100), budget) == "iterations"
    assert soft_dimension(Spent(1, 1, None, 100), budget) == "cost"
    assert soft_dimension(Spent(1, 1, 0.1, 500), budget) == "deadline"


def test_cost_comes_from_the_price_table_and_an_unknown_model_has_no_cost():
    prices = {"m": ModelPrice(3.0, 15.0)}
    assert cost_usd(prices, "m", Usage(input_tokens=1000, output_tokens=100)) == pytest.approx(0.0045)
    assert cost_usd(prices, "other", Usage(input_tokens=1)) is None


def test_each_token_component_has_its_price_an_unpriced_read_is_an_input_and_an_unpriced_write_fails_closed():
    full = {"m": ModelPrice(2.0, 8.0, cached_input_per_mtok=0.5, cache_write_per_mtok=2.5)}
    # OpenAI-style: 2000 prompt tokens of which 1536 cached; 300 output of which 192 reasoning.
    openai_usage = Usage(input_tokens=2000, output_tokens=300, cached_input_tokens=1536, reasoning_tokens=192)
    assert cost_usd(full, "m", openai_usage) == pytest.approx((464 * 2.0 + 1536 * 0.5 + 300 * 8.0) / 1e6)
    written = Usage(input_tokens=100, output_tokens=0, cache_write_tokens=100)
    assert cost_usd(full, "m", written) == pytest.approx(100 * 2.5 / 1e6)
    no_cache_prices = {"m": ModelPrice(2.0, 8.0)}
    # A cache read with no price of its own costs what input does: an upper bound (reads are
    # discounted everywhere), so a two-part price keeps a budget that holds, where it paused
    # every turn once the provider began caching.
    assert cost_usd(no_cache_prices, "m", openai_usage) == pytest.approx((2000 * 2.0 + 300 * 8.0) / 1e6)
    assert cost_usd(no_cache_prices, "m", openai_usage) >= cost_usd(full, "m", openai_usage)  # type: ignore[operator]
    assert cost_usd(no_cache_prices, "m", written) is None  # writes cost more than input: no bound
    # A reply that touched no cache costs what it did before cache prices existed.
    assert cost_usd(no_cache_prices, "m", Usage(input_tokens=10, output_tokens=1)) == pytest.approx(28e-6)
    with pytest.raises(ValueError):
        ModelPrice(1.0, 1.0, cached_input_per_mtok=-1.0)


def test_usage_parts_cannot_exceed_their_totals():
    with pytest.raises(ValueError):
        Usage(input_tokens=10, cached_input_tokens=8, cache_write_tokens=3)
    with pytest.raises(ValueError):
        Usage(output_tokens=1, reasoning_tokens=2)


def test_compaction_is_deterministic_keeps_the_last_exchange_and_never_repeats_itself():
    call = lambda i: ToolCall(call_id=f"c{i}", name="t", arguments="{}")  # noqa: E731
    messages = [ChatMessage("user", "q")]
    for i in range(3):
        messages += [ChatMessage("assistant", "", (call(i),)), ChatMessage("tool", f"result {i} " * 50, None, f"c{i}")]
    once, ids = compact_tool_exchanges(messages)
    assert ids == ("c0", "c1") and compact_tool_exchanges(messages) == (once, ids)
    assert once[-1] == messages[-1] and once[2].content.startswith("[compacted result: ")
    assert [m.role for m in once] == [m.role for m in messages]
    again, more = compact_tool_exchanges(once)
    assert again == once and more == ()


def test_fallback_stays_in_the_protocol_family():
    routes = [RouteInfo("a", "openai"), RouteInfo("b", "openai"), RouteInfo("c", "anthropic")]
    assert isinstance(next_route(routes, 0, "timeout"), FallTo)
    refused = next_route(routes, 1, "timeout")
    assert isinstance(refused, NoFallback) and "anthropic" in refused.reason
    assert isinstance(next_route(routes, 2, "timeout"), NoFallback)


def test_repeat_policy_and_backoff_are_bounded():
    policy = RepeatPolicy()
    assert [policy.action(n) for n in (1, 2, 3, 4)] == ["report", "change_strategy", "stop", "stop"]
    with pytest.raises(ValueError):
        RepeatPolicy(change_strategy_after=3, stop_after=2)
    settings = TurnSettings(backoff_base_ms=100, backoff_max_ms=1000)
    assert [settings.backoff_s(a) for a in (1, 2, 5)] == [0.1, 0.2, 1.0]
    slow = ProviderError("rate_limited", "429", retryable=True, status=429, retry_after_s=0.5)
    assert settings.backoff_s(1, slow) == 0.5
    # The transport lets a server-directed wait through only when its policy allows it,
    # so the attempt backoff honours it whole (a Retry-After of 30 s is not cut to 1 s).
    patient = ProviderError("rate_limited", "429", retryable=True, status=429, retry_after_s=30)
    assert settings.backoff_s(1, patient) == 30.0
    assert settings.backoff_s(1, ProviderError("timeout", "x", retryable=True)) == 0.1


def test_the_fold_resolves_an_approval_against_the_call_its_turn_paused_on():
    state = new_state("conv-1")
    m, c = message("m1", 1), claim(["m1"], 2, 0)
    call = ToolCall(call_id="call_9", name="transfer", arguments='{"to": "bob"}')
    metrics = TurnMetrics(
        model="m",
        attempt=1,
        iterations=1,
        tool_calls=0,
        input_tokens=0,
        output_tokens=0,
        cost_usd=0.0,
        fallbacks=0,
        duration_ms=1,
    )
    paused = TurnPaused(
        event_id="p",
        conversation_id="conv-1",
        occurred_at=3,
        turn_id=c.turn_id,
        run_id=c.run_id,
        attempt=1,
        statuses={"m1": "paused"},
        metrics=metrics,
        reason="approval",
        kept="",
        resume_hint="approve",
        pending_call=call,
    )
    for event in (m, c, started(c, 2), paused):
        assert apply_event(state, event) is None

    def decision(key: str, call_id: str, approved: bool) -> InputInjected:
        return InputInjected(
            event_id=f"e-{key}",
            conversation_id="conv-1",
            occurred_at=4,
            occurrence_key=key,
            source="approval",
            content="decision",
            approval=Approval(turn_id=c.turn_id, call_id=call_id, approved=approved),
        )

    assert apply_event(state, decision("a1", "call_9", True)) is None
    assert apply_event(state, decision("a2", "call_other", True)) is None
    grant = state.pending["a1"].grant
    assert grant is not None and (grant.tool, grant.arguments, grant.approved) == ("transfer", call.arguments, True)
    assert state.pending["a2"].grant is None  # names no call that is waiting: a plain input
    with pytest.raises(ValueError, match="source 'approval'"):
        InputInjected(
            event_id="x",
            conversation_id="conv-1",
            occurred_at=4,
            occurrence_key="k",
            source="event",
            content="c",
            approval=Approval(turn_id="t", call_id="c", approved=True),
        )
