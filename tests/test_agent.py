"""The public agent API as a user meets it: `import turnstile`, the README's agent run with
the test model, the example agent served by `turnstile run MODULE:AGENT` on Kafka against
a loopback model server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
import types
from pathlib import Path

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from provider_server import ProviderServer, Reply
from test_cli import run_worker_until
from test_cli import turnstile as turnstile_cli

import turnstile
from turnstile import Agent, Model, TestModel, TurnBudget
from turnstile.events import (
    AttemptFailed,
    DecodeError,
    Event,
    ToolCallFinished,
    ToolCallStarted,
    TurnCompleted,
    TurnPaused,
    decode,
    encode,
)
from turnstile.handlers.provider import ProviderError
from turnstile.streams.agent import Answered, OperationRefused, load_agent
from turnstile.streams.file_log import FileLog, LogOwned
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.publisher import KafkaPublisher, message_event
from turnstile.streams.serving import LogPlace

ROOT = Path(__file__).parent.parent


def test_every_public_name_resolves_and_is_documented() -> None:
    doc = turnstile.__doc__ or ""
    for name in turnstile.__all__:
        assert getattr(turnstile, name) is not None
        assert f"`{name}`" in doc, f"{name} is not described in turnstile's docstring"
    with pytest.raises(AttributeError):
        turnstile.NotAThing  # noqa: B018


def test_a_model_whose_key_variable_is_unset_is_named_when_its_provider_is_made(monkeypatch, caplog) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    Model("claude-x", family="anthropic", api_key_env="NO_SUCH_KEY_VAR").provider()
    unset = "NO_SUCH_KEY_VAR is not set (or empty): requests to https://api.anthropic.com carry no API key"
    assert unset in caplog.text
    monkeypatch.setenv("A_KEY_VAR", "sk-test")
    caplog.clear()
    Model("gpt-x", base_url="http://127.0.0.1:9/v1", api_key_env="A_KEY_VAR").provider()
    assert "carry no API key" not in caplog.text and "ends in /v1" not in caplog.text


def test_an_anthropic_base_url_ending_in_v1_is_named_when_its_provider_is_made(monkeypatch, caplog) -> None:
    # (its requests go to .../v1/v1/messages: every turn failed with a 404)
    monkeypatch.setenv("A_KEY_VAR", "sk-test")
    Model("claude-x", family="anthropic", base_url="http://127.0.0.1:9/v1/", api_key_env="A_KEY_VAR").provider()
    assert "requests go to http://127.0.0.1:9/v1/v1/messages" in caplog.text
    caplog.clear()
    Model("claude-x", family="anthropic", base_url="http://127.0.0.1:9", api_key_env="A_KEY_VAR").provider()
    assert "ends in /v1" not in caplog.text


def readme_agent() -> types.ModuleType:
    """The code of the README's "Your agent in 20 lines", as a module."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your agent in 20 lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    module = types.ModuleType("orders")
    exec(compile(code.group(1), "README.md", "exec"), module.__dict__)
    return module


def test_the_readme_agent_calls_its_tool_and_answers_with_the_test_model(tmp_path: Path) -> None:
    agent = readme_agent().agent  # made outside any event loop
    model = TestModel(
        replies=[TestModel.calls("lookup_order", '{"order_id": "A-1001"}'), "A-1001 has shipped.", "It left on Monday."]
    )
    with agent.override(model=model):
        answered = asyncio.run(agent.answer("Where is A-1001?", data=tmp_path))
    assert agent.model.name == "gpt-4.1-mini" and len(agent.fallbacks) == 1  # restored after the block
    finished = [e for e in answered.events if isinstance(e, ToolCallFinished)]
    assert [(f.ok, f.result) for f in finished] == [(True, "shipped")]
    assert answered.reply == "A-1001 has shipped." and isinstance(answered.outcome, TurnCompleted)
    # a later call on the same folder goes on with the conversation (the model sees the first),
    # and the model with its replies (it answered each call with the first ones again)
    with agent.override(model=model):
        again = asyncio.run(agent.answer("When?", data=tmp_path))
    assert again.reply == "It left on Monday." and again.events[: len(answered.events)] == answered.events
    assert "A-1001 has shipped." in [m.content for m in model.requests[-1].messages]
    first = model.requests[0]
    assert first.messages[0].content.startswith("You answer questions about orders.")
    assert [t.name for t in first.tools] == ["lookup_order"]


def test_a_test_model_reply_may_call_several_tools_at_once(tmp_path: Path) -> None:
    # Given the README's agent and a scripted reply with two calls, as real models send
    agent = readme_agent().agent
    both = TestModel.parallel(("lookup_order", '{"order_id": "A-1001"}'), ("lookup_order", '{"order_id": "B-7"}'))
    with agent.override(model=TestModel(replies=[both, "One shipped, one unknown."])):
        answered = asyncio.run(agent.answer("Where are A-1001 and B-7?", data=tmp_path))
    # Then both run, in order, each with its own id, and the model reads both results
    finished = [(f.call_id, f.result) for f in answered.events if isinstance(f, ToolCallFinished)]
    assert finished == [("call-1", "shipped"), ("call-2", "unknown order")]
    assert answered.reply == "One shipped, one unknown."
    with pytest.raises(ValueError, match="at least one"):
        TestModel.parallel()


def test_a_test_approves_and_denies_a_paused_call_as_an_operator_would(tmp_path: Path) -> None:
    # Given an agent whose send_email needs approval, and a kept folder
    agent = Agent("mail", model=TestModel())
    sent: list[str] = []

    @agent.tool(side_effect=True, needs_approval=True)
    def send_email(to: str) -> str:
        """Send the email."""
        sent.append(to)
        return "sent"

    call = TestModel.calls("send_email", '{"to": "a@b.c"}')
    model = TestModel(replies=[call, call, "Sent it.", call, "Not sent, as you said."])
    with agent.override(model=model):
        paused = asyncio.run(agent.answer("Mail a@b.c", data=tmp_path))
        assert isinstance(paused.outcome, TurnPaused) and paused.outcome.reason == "approval"
        # When the test approves it, then the turn that claims the approval runs it once
        approved = asyncio.run(agent.approve("call-1", data=tmp_path, note="fine"))
        assert approved.reply == "Sent it." and sent == ["a@b.c"]
        # and nothing waits any more (a denial of the call taken is refused, naming the approval);
        # a denial of a call the model asks for again is read
        with pytest.raises(OperationRefused, match=r"call 'call-1' of turn \w+ was approved already"):
            asyncio.run(agent.deny("call-1", data=tmp_path))
        again = asyncio.run(agent.answer("Mail a@b.c again", data=tmp_path))
        assert isinstance(again.outcome, TurnPaused)
        waiting = again.outcome.pending_call
        assert waiting is not None
        denied = asyncio.run(agent.deny(waiting.call_id, data=tmp_path))
    assert denied.reply == "Not sent, as you said." and sent == ["a@b.c"]


def test_every_public_name_is_listed_by_dir_though_imported_on_first_use() -> None:
    import turnstile

    assert {"Agent", "LogPlace", "TestModel", "tool", "TurnBudget"} <= set(dir(turnstile))


def test_a_fallback_of_another_protocol_family_is_refused_when_the_agent_is_made() -> None:
    with pytest.raises(ValueError, match="fallback 'claude' speaks the anthropic protocol, not openai"):
        Agent("a", model=Model("gpt"), fallbacks=[Model("claude", family="anthropic")])


@pytest.mark.parametrize(
    ("make", "says"),
    [
        # Each was taken and failed only at the first request (or never: max_attempts=0).
        (lambda: Model("m", family="gemini"), "family is 'openai' or 'anthropic', not 'gemini'"),  # type: ignore[arg-type]
        (lambda: Model(""), "a model needs a name"),
        (lambda: Model("m", base_url="localhost:8000/v1"), "is not an http:// or https:// URL"),
        (lambda: Agent("a", model=Model("m"), max_attempts=0), "max_attempts and max_output_tokens must be at least 1"),
        (lambda: Agent("a", model=Model("m"), max_output_tokens=0), "must be at least 1"),
        (lambda: Agent("a", model=Model("m"), double_text="maybe"), "unknown double-text policy 'maybe'"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_model_or_agent_setting_is_refused_when_it_is_made(make, says) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=re.escape(says)):
        make()


def test_a_target_that_is_not_an_agent_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="expected MODULE:AGENT"):
        load_agent("examples.support_agent")
    with pytest.raises(ValueError, match=r"'ORDERS' in examples\.support_agent is dict, not a turnstile\.Agent"):
        load_agent("examples.support_agent:ORDERS")
    with pytest.raises(ValueError, match=r"examples\.support_agent \(.*support_agent\.py\) has no 'agnet'"):
        load_agent("examples.support_agent:agnet")
    with pytest.raises(ValueError, match=r"no module named 'nosuch' in .*: run from the folder that holds it"):
        load_agent("nosuch.agents:agent")


def test_a_module_the_agents_code_imports_keeps_its_own_error(tmp_path, monkeypatch) -> None:
    # The agent's module is found; what it imports is not: said with the line that imports it.
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    said = r"importing needs_dep failed: ModuleNotFoundError: .*no_such_dependency.* \(.*needs_dep\.py, line 1\)"
    with pytest.raises(ValueError, match=said) as caught:
        load_agent("needs_dep:agent")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


@pytest.mark.kafka
def test_the_example_agent_answers_on_kafka_through_the_loopback_model(
    kafka_bootstrap: str, fresh_topics: Topics, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    where = [
        "--broker", f"kafka://{kafka_bootstrap}",
        "--events-topic", fresh_topics.events,
        "--outcomes-topic", fresh_topics.outcomes,
        "--dlq-topic", fresh_topics.dead_letters,
    ]
    with ProviderServer() as server:
        server.push(
            Reply(tool_calls=[("call_1", "lookup_order", '{"order_id": "A-1001"}')], usage=(50, 10)),
            Reply(text="Your order A-1001 has shipped with DHL.", usage=(80, 12)),
        )
        monkeypatch.setenv("TURNSTILE_BASE_URL", server.base_url_openai)
        monkeypatch.setenv("TURNSTILE_API_KEY", "sk-test")
        sent = turnstile_cli("send", *where, "--conversation", "c1", "--text", "Where is A-1001?", "--message-id", "m1")
        assert sent.returncode == 0, sent.stderr
        group = f"g-{os.getpid()}-{time.time_ns()}"
        out = run_worker_until(where, "c1", 1, "examples.support_agent:agent", "--no-stream", "--group", group)
        bodies = [r.body for r in server.requests]
    assert "COMPLETED {'m1': 'answered'}" in out and "has shipped with DHL" in out
    assert [b["model"] for b in bodies] == ["gpt-4.1-mini", "gpt-4.1-mini"]
    assert bodies[0]["messages"][0]["content"].startswith("You are the support desk")
    assert {t["function"]["name"] for t in bodies[0]["tools"]} == {"lookup_order", "send_email"}
    assert '"status":"shipped"' in bodies[1]["messages"][-1]["content"]


@pytest.mark.kafka
def test_kafka_clients_are_made_before_any_event_loop_runs(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    publisher = KafkaPublisher(kafka_bootstrap, fresh_topics)  # at import time, as an Agent's module would
    log = KafkaLog(kafka_bootstrap, group_id=f"g-{os.getpid()}-{time.time_ns()}", topics=fresh_topics)

    async def publish_both() -> tuple[tuple[int, int], tuple[int, int]]:
        async with publisher:
            first = await publisher.publish(message_event("c1", "hi", 1, "m1"))
        await log.producer.start()
        try:
            second = await log.append(fresh_topics.events, "c1", encode(message_event("c1", "again", 2, "m2")))
        finally:
            await log.stop()
        return first, second

    (partition, offset), (partition_2, offset_2) = asyncio.run(publish_both())
    assert (partition_2, offset_2) == (partition, offset + 1)  # one conversation, one partition, in order


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: Agent("a", model="gpt-4.1"), "model is a turnstile.Model or TestModel (Model('gpt-4.1')), not str"),
        (lambda: Agent("a", model=None), "model is a turnstile.Model or TestModel, not NoneType"),
        (lambda: Agent("a", model=TestModel(), system_prompt=5), "system_prompt is str | None, not int"),
        (lambda: Agent("a", model=TestModel(), budget={"max_iterations": 2}), "budget is TurnBudget, not dict"),
        (lambda: Agent("a", model=TestModel(), tools=[len]), "a tool is made with @tool or @agent.tool, not"),
        (lambda: Agent("a", model=TestModel(), tools="abc"), "a tool is made with @tool or @agent.tool, not str"),
        (lambda: Agent("a", model=TestModel(), tools=len), "tools is a list of tools: tools=[len]"),
        (lambda: Agent(5, model=TestModel()), "an agent's name is a non-empty str, not 5"),  # type: ignore[arg-type]
        (lambda: Agent("a", model=TestModel(), max_attempts="3"), "max_attempts is an int, not '3'"),
        (lambda: TurnBudget(max_iterations=2.5), "max_iterations is an integer, not 2.5"),
        (lambda: TurnBudget(max_cost_usd=True), "max_cost_usd is a number, not True"),
    ],
)
def test_a_mistyped_agent_is_refused_where_it_is_made_not_at_its_first_turn(make, says) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match=re.escape(says)):
        make()


def test_test_model_exceptions_fail_as_a_provider_would_and_are_retried_as_its_requests_are(tmp_path: Path) -> None:
    # A real provider's transport retries a failed request twice before the attempt fails.
    replies = [RuntimeError("model down"), TimeoutError(), ConnectionError(), "ok"]
    agent = Agent("a", model=TestModel(replies=replies))
    answered = asyncio.run(agent.answer("hi", data=str(tmp_path)))  # (a folder as text too)
    assert answered.reply == "ok" and answered.outcome.metrics.attempt == 2
    [failed] = [e.reason for e in answered.events if isinstance(e, AttemptFailed)]
    assert failed.startswith("connection: ConnectionError") and "(after 2 retries)" in failed


def test_a_failure_the_transport_would_absorb_does_not_fail_a_turn_whose_side_effect_ran(tmp_path: Path) -> None:
    model = TestModel(replies=[TestModel.calls("cancel"), RuntimeError("HTTP 500"), "cancelled"])
    agent = Agent("a", model=model)

    @agent.tool(side_effect=True)
    def cancel() -> str:
        """Cancel the order."""
        return "done"

    answered = asyncio.run(agent.answer("cancel it", data=tmp_path))
    assert answered.reply == "cancelled" and not [e for e in answered.events if isinstance(e, AttemptFailed)]
    assert len(model.requests) == 3  # the failed request was sent again, as over HTTP


def test_test_model_gives_a_tool_call_id_once_as_a_real_model_does(tmp_path: Path) -> None:
    agent = Agent("a", model=TestModel(replies=[TestModel.calls("look"), TestModel.calls("look"), "done"]))
    seen: list[str] = []

    @agent.tool
    def look() -> str:
        """Look."""
        seen.append("looked")
        return "seen"

    answered = asyncio.run(agent.answer("look twice", data=tmp_path))
    started = [e.call_id for e in answered.events if isinstance(e, ToolCallStarted)]
    assert answered.reply == "done" and started == ["call-1", "call-1-2"] and seen == ["looked", "looked"]


def test_a_tool_given_its_own_timeout_is_stopped_there_and_the_model_is_told(tmp_path: Path) -> None:
    agent = Agent("a", model=TestModel(replies=[TestModel.calls("slow"), "it was too slow"]))

    @agent.tool(timeout_s=0.05)
    async def slow() -> str:
        """Take a long time."""
        await asyncio.Event().wait()  # never set: only the tool's timeout ends it
        return "never"

    answered = asyncio.run(agent.answer("go", data=tmp_path, timeout_s=20))
    [finished] = [e for e in answered.events if isinstance(e, ToolCallFinished)]
    assert (finished.ok, finished.result) == (False, "error: the tool did not finish within 0.05 s")
    assert answered.reply == "it was too slow"


def test_a_second_answer_on_a_folder_in_use_is_refused_before_its_message_is_sent(tmp_path: Path) -> None:
    agent = Agent("a", model=TestModel(replies=[TestModel.calls("wait"), "first answered", "third answered"]))
    waiting, released = asyncio.Event(), asyncio.Event()

    @agent.tool
    async def wait() -> str:
        """Wait."""
        waiting.set()
        await released.wait()
        return "waited"

    async def both() -> tuple[Answered, BaseException | Answered]:
        first = asyncio.create_task(agent.answer("first", data=tmp_path, conversation="one"))
        await waiting.wait()  # the first owns the folder and is running its turn
        second = agent.answer("second", data=tmp_path, conversation="two")
        [refused] = await asyncio.gather(second, return_exceptions=True)
        released.set()
        return await first, refused

    first, second = asyncio.run(both())
    assert first.reply == "first answered"
    assert isinstance(second, LogOwned) and f"(pid {os.getpid()})" in str(second)
    third = asyncio.run(agent.answer("third", data=tmp_path, conversation="three"))  # the folder is free again
    assert third.reply == "third answered"
    on_the_log = {e.conversation_id for e in asyncio.run(_all_events(tmp_path))}
    assert on_the_log == {"one", "three"}  # "second" was never sent


async def _all_events(folder: Path) -> list[Event]:
    log = FileLog(folder)
    return [e for r in await log.reader().read(log.topics.events) if not isinstance(e := decode(r.value), DecodeError)]


def test_a_server_asking_to_wait_past_the_deadline_pauses_the_turn_on_it_at_once(tmp_path: Path) -> None:
    busy = ProviderError("rate_limited", "HTTP 429", retryable=True, status=429, retry_after_s=12.0)
    agent = Agent("a", model=TestModel(replies=[busy, "ok"]), budget=TurnBudget(deadline_ms=5_000))
    answered = asyncio.run(agent.answer("hi", data=tmp_path))
    outcome = answered.outcome
    assert isinstance(outcome, TurnPaused) and outcome.reason == "deadline"  # not failed, not slept 12 s
    assert "would pass the turn's deadline" in outcome.resume_hint


def test_a_log_place_with_an_address_kafka_does_not_take_is_refused() -> None:
    with pytest.raises(ValueError, match="is not a Kafka address"):
        LogPlace(broker="http://localhost:9092")


@pytest.mark.kafka
def test_serving_on_topics_that_are_not_there_says_so_at_once(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    # (a typo in a topic's name gave a worker assigned nothing that looked healthy, and
    # returned 0 when stopped)
    from turnstile import LogPlace
    from turnstile.streams.kafka_reader import TopicMissing

    agent = Agent("orders", model=TestModel())
    wrong = dataclasses.replace(fresh_topics, outcomes=f"{fresh_topics.outcomes}-typo")
    place = LogPlace(broker=f"kafka://{kafka_bootstrap}", topics=wrong, group="g-missing")
    with pytest.raises(TopicMissing, match=f"topic '{wrong.outcomes}' does not exist"):
        asyncio.run(asyncio.wait_for(agent.serve(place, stop=asyncio.Event()), 30))


def test_serve_cancelled_by_its_caller_stops_and_the_cancellation_goes_on(tmp_path: Path) -> None:
    # (a timeout around serve() never fired: serve caught the cancellation and returned 130)
    from turnstile.events import MessageReceived, decode, encode

    agent = Agent("echo", model=TestModel(replies=["Hello.", "Again."]))
    data = tmp_path / "log"
    log = FileLog(data, Topics())

    async def main() -> None:
        serving = asyncio.create_task(agent.serve(LogPlace(data=data), stop=asyncio.Event()))
        message = MessageReceived(event_id="e1", conversation_id="c1", occurred_at=1, message_id="m1", content="hi")
        await log.append(log.topics.events, "c1", encode(message))
        async with asyncio.timeout(30):  # (a bound, should the worker never answer)
            async for record in log.follow(log.topics.events, from_end=False):
                if isinstance(decode(record.value), TurnCompleted):  # type: ignore[arg-type]
                    break
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
        assert serving.cancelled()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await agent.serve(LogPlace(data=data), stop=asyncio.Event())

    asyncio.run(main())
    # The log was let go both times: another answer may own it at once.
    assert asyncio.run(agent.answer("again", data=data, conversation="c2")).reply == "Again."


def test_a_tool_that_raises_and_a_turn_that_fails_are_said_in_the_workers_log(caplog: pytest.LogCaptureFixture) -> None:
    # (both were only on the log of events: a tool's traceback was lost, and a wrong base_url
    # failed every turn with not a line in the worker's output, -v or not)
    import logging

    from turnstile.events import TurnFailed

    not_found = ProviderError("bad_request", "HTTP 404", retryable=False, status=404, provider_message="Invalid URL")
    agent = Agent("ops", model=TestModel(replies=[TestModel.calls("lookup", "{}"), not_found]))

    @agent.tool
    def lookup() -> str:
        """Look the order up."""
        raise RuntimeError("database connection refused")

    with caplog.at_level(logging.WARNING, logger="turnstile"):  # (an id a Kafka publisher chose: printed inert)
        answered = asyncio.run(agent.answer("where is my order?", conversation="c\x1b[31m1"))

    assert isinstance(answered.outcome, TurnFailed)
    [raised] = [r for r in caplog.records if "tool lookup raised" in r.getMessage()]
    assert "database connection refused" in raised.getMessage() and raised.exc_info is not None
    said = f"turn {answered.outcome.turn_id} of c\\x1b[31m1 failed"
    [failed] = [r for r in caplog.records if said in r.getMessage()]
    assert "rejected the request (HTTP 404): Invalid URL. Check the model's name and base_url" in failed.getMessage()
