"""Streamed replies (server-sent events) of both families, on httpx.MockTransport: event
streams whose every event the official SDK models validate (fixtures/providers/*/*.sse),
delivered in small pieces. A streamed reply parses to exactly what the same reply unstreamed
does; its text arrives as deltas in order; a retry voids the text already sent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from anthropic_rules import violations
from wire_harness import (
    API_KEY,
    Collected,
    MockApi,
    anthropic_api,
    fixture,
    openai_api,
    openai_violations,
    stream_fixture,
    streamed,
)

from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ChatMessage, ModelReply, ModelRequest, ProviderError
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.streams.provider_http import HttpProvider

HELLO = ModelRequest(model="m", messages=(ChatMessage("user", "Compare the 9th and the 10th."),), max_output_tokens=64)
WIRES = {"openai": OpenAIChat(), "anthropic": AnthropicMessages()}


class Family:
    def __init__(self, name: str, api: MockApi, client: httpx.AsyncClient) -> None:
        self.name, self.api = name, api
        self.waits: list[float] = []
        self.provider = HttpProvider(
            WIRES[name], "https://api.test/v1", API_KEY, client=client, sleep=self._wait, jitter=lambda: 0.0
        )

    async def _wait(self, seconds: float) -> None:
        self.waits.append(seconds)


@pytest.fixture
async def sides() -> AsyncIterator[dict[str, Family]]:
    apis = {"openai": openai_api(), "anthropic": anthropic_api()}
    async with apis["openai"].client() as first, apis["anthropic"].client() as second:
        yield {
            "openai": Family("openai", apis["openai"], first),
            "anthropic": Family("anthropic", apis["anthropic"], second),
        }


@pytest.fixture
def openai(sides: dict[str, Family]) -> Family:
    return sides["openai"]


@pytest.fixture
def anthropic(sides: dict[str, Family]) -> Family:
    return sides["anthropic"]


@pytest.mark.parametrize(
    ("family", "stream", "unstreamed", "deltas"),
    [
        ("openai", "stream_text", "text", ["The 9th", " is cheaper."]),
        ("openai", "stream_tool_calls", "parallel_tool_calls", []),
        ("openai", "stream_refusal", "refusal", []),  # a refusal is not reply text
        ("anthropic", "stream_text", "text", ["The 9th", " is cheaper."]),
        ("anthropic", "stream_thinking_tool_use", "thinking_tool_use", ["Let me look both up."]),
        # Text streams, then the classifier stops it: the explanation comes in message_delta.
        ("anthropic", "stream_refusal", "refusal_partial", ["Sure, here is ", "how to"]),
    ],
)
async def test_a_streamed_reply_is_the_same_reply_with_its_text_as_deltas(
    sides: dict[str, Family], family: str, stream: str, unstreamed: str, deltas: list[str]
) -> None:
    side = sides[family]
    side.api.push(streamed(stream_fixture(family, stream)))
    collected = Collected()

    reply = await side.provider.complete(HELLO, collected)

    whole = WIRES[family].parse_reply(fixture(family, unstreamed), "m")
    assert (reply.text, reply.tool_calls, reply.stop, reply.finish_reason, reply.refusal) == (
        whole.text,
        whole.tool_calls,
        whole.stop,
        whole.finish_reason,
        whole.refusal,
    )
    assert collected.seen == deltas
    if family == "anthropic":
        assert reply.native == whole.native  # thinking text and signature reassembled exactly
    else:
        assert reply.usage == whole.usage


async def test_a_chunk_whose_error_is_null_is_no_error(openai: Family) -> None:
    # Gateways put `"error": null` in every chunk; openai-python raises only on a truthy one.
    lines = stream_fixture("openai", "stream_text").decode().split("\n")
    with_null = [
        "data: " + orjson.dumps({**orjson.loads(line[6:]), "error": None}).decode()
        if line.startswith("data: {")
        else line
        for line in lines
    ]
    openai.api.push(streamed("\n".join(with_null).encode()))
    collected = Collected()

    reply = await openai.provider.complete(HELLO, collected)

    assert (reply.text, reply.stop, collected.seen) == ("The 9th is cheaper.", "end", ["The 9th", " is cheaper."])


async def test_usage_is_summed_from_start_and_delta_events(anthropic: Family) -> None:
    anthropic.api.push(streamed(stream_fixture("anthropic", "stream_text")))

    reply = await anthropic.provider.complete(HELLO, Collected())

    assert reply.usage == Usage(input_tokens=48, output_tokens=8)


async def test_streamed_requests_ask_for_a_stream_and_still_keep_each_apis_rules(
    openai: Family, anthropic: Family
) -> None:
    openai.api.push(streamed(stream_fixture("openai", "stream_text")))
    anthropic.api.push(streamed(stream_fixture("anthropic", "stream_text")))

    await openai.provider.complete(HELLO, Collected())
    await anthropic.provider.complete(HELLO, Collected())

    [sent_openai], [sent_anthropic] = openai.api.bodies, anthropic.api.bodies
    assert (sent_openai["stream"], sent_openai["stream_options"]) == (True, {"include_usage": True})
    assert openai_violations(sent_openai) == []
    assert sent_anthropic["stream"] is True and violations(sent_anthropic) == []


async def test_an_error_mid_stream_voids_the_text_sent_and_the_request_is_retried(anthropic: Family) -> None:
    anthropic.api.push(
        streamed(stream_fixture("anthropic", "stream_overloaded")), streamed(stream_fixture("anthropic", "stream_text"))
    )
    collected = Collected()

    reply = await anthropic.provider.complete(HELLO, collected)

    assert reply.text == "The 9th is cheaper."
    assert collected.seen == ["The 9th", "<restart>", "The 9th", " is cheaper."]
    assert anthropic.waits == [0.5]


async def test_an_overloaded_stream_that_stays_so_fails_as_overloaded(anthropic: Family) -> None:
    anthropic.api.push(*[streamed(stream_fixture("anthropic", "stream_overloaded")) for _ in range(3)])

    with pytest.raises(ProviderError) as caught:
        await anthropic.provider.complete(HELLO, Collected())

    assert (caught.value.kind, caught.value.retryable, caught.value.provider_message) == (
        "overloaded",
        True,
        "Overloaded",
    )


@pytest.mark.parametrize("family", ["openai", "anthropic"])
async def test_a_stream_that_just_stops_is_a_connection_error(sides: dict[str, Family], family: str) -> None:
    side = sides[family]
    whole = stream_fixture(family, "stream_text")
    side.api.push(*[streamed(whole[: len(whole) // 2]) for _ in range(3)])

    with pytest.raises(ProviderError) as caught:
        await side.provider.complete(HELLO, Collected())

    assert (caught.value.kind, caught.value.retryable) == ("connection", True)
    assert "stream ended before the reply did" in caught.value.message


@pytest.mark.parametrize(
    ("name", "text", "output_tokens"),
    [("stream_cut_tool_input", None, 16), ("stream_text_then_cut_tool_input", "I'll save it in notes.txt.", 124)],
)
async def test_a_tool_input_cut_off_by_max_tokens_is_left_out_and_the_reply_is_a_cut_off_one(
    anthropic: Family, name: str, text: str | None, output_tokens: int
) -> None:
    # (the SDK's accumulator ends the same stream normally, stop_reason max_tokens)
    anthropic.api.push(streamed(stream_fixture("anthropic", name)))

    reply = await anthropic.provider.complete(HELLO, Collected())

    assert (reply.stop, reply.text, reply.tool_calls) == ("truncated", text, ())  # never run on a guess
    assert reply.usage == Usage(input_tokens=48, output_tokens=output_tokens)  # billed, so counted
    assert [block["type"] for block in reply.native] == ([] if text is None else ["text"])


async def test_a_whole_tool_input_that_is_not_json_is_a_malformed_reply(anthropic: Family) -> None:
    anthropic.api.push(streamed(stream_fixture("anthropic", "stream_invalid_tool_input")))

    with pytest.raises(ProviderError) as caught:
        await anthropic.provider.complete(HELLO, Collected())

    assert caught.value.kind == "malformed_response" and "is not JSON: '{\"q\": fares}'" in caught.value.message
    assert caught.value.usage == Usage(input_tokens=48, output_tokens=20)  # the stream's whole reply, billed


async def test_a_null_count_in_message_delta_leaves_message_starts_standing(anthropic: Family) -> None:
    anthropic.api.push(streamed(stream_fixture("anthropic", "stream_null_usage_delta")))

    reply = await anthropic.provider.complete(HELLO, Collected())

    # as the SDK accumulates it: input 48 + cache read 200 + cache write 50, output 5
    assert reply.usage == Usage(input_tokens=298, output_tokens=5, cached_input_tokens=200, cache_write_tokens=50)


async def test_an_http_error_to_a_streamed_request_is_read_as_an_error(openai: Family) -> None:
    openai.api.push(httpx.Response(401, json={"error": {"message": "Incorrect API key provided"}}))

    with pytest.raises(ProviderError) as caught:
        await openai.provider.complete(HELLO, Collected())

    assert (caught.value.kind, caught.value.provider_message) == ("authentication", "Incorrect API key provided")


def test_tool_call_pieces_are_joined_by_index() -> None:
    from turnstile.handlers.providers.sse import SseDecoder

    assembler = OpenAIChat().assembler()
    for event in SseDecoder().feed(stream_fixture("openai", "stream_tool_calls")):
        assembler.feed(event)

    reply = OpenAIChat().parse_reply(assembler.payload(), "m")
    assert reply.tool_calls == (
        ToolCall(call_id="call_a1", name="search", arguments='{"q": "fares 9th"}'),
        ToolCall(call_id="call_b2", name="search", arguments='{"q": "fares 10th"}'),
    )


COUNTS = {"openai": ("prompt_tokens", "completion_tokens"), "anthropic": ("input_tokens", "output_tokens")}


@pytest.mark.parametrize("family", ["openai", "anthropic"])
@pytest.mark.parametrize("usage", ["absent", "null", "empty", "counts null", "no output count"])
def test_a_whole_reply_that_says_nothing_of_its_tokens_is_not_taken_as_costing_nothing(family: str, usage: str) -> None:
    body = fixture(family, "text")
    read, wrote = COUNTS[family]
    if usage == "absent":
        del body["usage"]
    else:
        body["usage"] = {
            "null": None, "empty": {}, "counts null": {read: None, wrote: None}, "no output count": {read: 12}
        }[usage]  # fmt: skip
    silent = WIRES[family].parse_reply(body, "m")
    assert not silent.usage_reported  # the turn prices it as unknown
    assert WIRES[family].parse_reply(fixture(family, "text"), "m").usage_reported


async def test_a_stream_without_the_usage_chunk_says_nothing_of_its_tokens(openai: Family) -> None:
    # (an OpenAI-compatible server that ignores stream_options.include_usage)
    whole = stream_fixture("openai", "stream_text").split(b"\n\n")
    without_usage = b"\n\n".join(e for e in whole if b'"usage": {' not in e)
    openai.api.push(streamed(without_usage))

    reply = await openai.provider.complete(HELLO, Collected())

    assert reply.text and not reply.usage_reported


@pytest.mark.parametrize(("family", "end"), [("openai", b"data: [DONE]"), ("anthropic", b"event: message_stop")])
async def test_a_stream_that_ends_after_its_stop_reason_without_its_end_marker_is_a_whole_reply(
    sides: dict[str, Family], family: str, end: bytes
) -> None:
    # (the SDKs take it as finished; retrying it would pay for the same reply again)
    whole = stream_fixture(family, "stream_text")
    side = sides[family]
    side.api.push(streamed(b"\n\n".join(e for e in whole.split(b"\n\n") if not e.startswith(end))))

    reply = await side.provider.complete(HELLO, Collected())

    expected = await _reply_to(sides, family, whole)
    assert (reply.text, reply.usage, reply.usage_reported) == (expected.text, expected.usage, True)
    assert len(side.api.bodies) == 2  # one each: the cut stream was not asked again


async def _reply_to(sides: dict[str, Family], family: str, stream: bytes) -> ModelReply:
    sides[family].api.push(streamed(stream))
    return await sides[family].provider.complete(HELLO, Collected())


async def test_a_stream_whose_chunks_never_have_a_choice_is_malformed_with_its_usage(openai: Family) -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    events = [{"id": "c", "model": "m", "choices": []}, {"id": "c", "model": "m", "choices": [], "usage": usage}]
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    openai.api.push(streamed(body))

    with pytest.raises(ProviderError) as caught:
        await openai.provider.complete(HELLO, Collected())

    assert (caught.value.kind, caught.value.message) == ("malformed_response", "choices is empty")
    assert caught.value.usage == Usage(input_tokens=9, output_tokens=3)  # billed, so counted


async def test_a_broken_stream_is_not_asked_again_when_the_server_said_not_to(openai: Family) -> None:
    whole = stream_fixture("openai", "stream_text")
    cut = streamed(whole[: len(whole) // 3])
    openai.api.push(httpx.Response(200, headers={"x-should-retry": "false"}, stream=cut.stream))

    with pytest.raises(ProviderError) as caught:
        await openai.provider.complete(HELLO, Collected())

    assert (caught.value.kind, caught.value.retryable) == ("connection", False)
    assert len(openai.api.bodies) == 1  # as the SDKs honour x-should-retry


@pytest.mark.parametrize("family", ["openai", "anthropic"])
async def test_a_server_that_answers_a_streamed_request_whole_is_read_whole(
    sides: dict[str, Family], family: str
) -> None:
    # (a compatible server that ignores stream: true; read as a stream it has no events)
    side = sides[family]
    side.api.push(httpx.Response(200, json=fixture(family, "text")))

    reply = await side.provider.complete(HELLO, Collected())

    whole = WIRES[family].parse_reply(fixture(family, "text"), "m")
    assert (reply.text, reply.usage, reply.usage_reported) == (whole.text, whole.usage, True)
    assert len(side.api.bodies) == 1


def _without_usage(stream: bytes, *, start: bool, delta: bool) -> bytes:
    events = []
    for event in stream.split(b"\n\n"):
        head, _, data = event.partition(b"\ndata: ")
        if data and ((start and head == b"event: message_start") or (delta and head == b"event: message_delta")):
            value = orjson.loads(data)
            (value["message"] if start and "message" in value else value).pop("usage", None)
            event = head + b"\ndata: " + orjson.dumps(value)
        events.append(event)
    return b"\n\n".join(events)


@pytest.mark.parametrize(("start", "delta"), [(True, True), (False, True)])
async def test_an_anthropic_stream_without_its_final_output_count_says_nothing_of_its_tokens(
    anthropic: Family, start: bool, delta: bool
) -> None:
    # message_start's output_tokens is a placeholder (1): the count is message_delta's
    anthropic.api.push(streamed(_without_usage(stream_fixture("anthropic", "stream_text"), start=start, delta=delta)))

    reply = await anthropic.provider.complete(HELLO, Collected())

    assert reply.text and not reply.usage_reported


@pytest.mark.parametrize("kind", ["text/plain", "application/x-ndjson", "application/json; charset=utf-8"])
async def test_a_whole_reply_under_any_type_but_event_stream_is_read_whole(openai: Family, kind: str) -> None:
    body = orjson.dumps(fixture("openai", "text"))
    openai.api.push(httpx.Response(200, headers={"content-type": kind}, content=body))

    reply = await openai.provider.complete(HELLO, Collected())

    assert reply.text == "The 9th is cheaper." and reply.usage_reported and len(openai.api.bodies) == 1


async def test_an_answer_that_names_no_type_is_read_by_its_first_bytes(openai: Family) -> None:
    # A whole JSON reply with no content type (it was read as a stream of no events: the
    # reply lost, retried and paid again); events with none, cut in small pieces, still stream.
    body = b"\n " + orjson.dumps(fixture("openai", "text"))
    openai.api.push(httpx.Response(200, content=body))
    assert "content-type" not in openai.api.answers[0].headers

    reply = await openai.provider.complete(HELLO, Collected())

    assert reply.text == "The 9th is cheaper." and reply.usage_reported and len(openai.api.bodies) == 1
    events = streamed(stream_fixture("openai", "stream_text"), chunk_bytes=1)
    del events.headers["content-type"]
    openai.api.push(events)
    seen = Collected()
    reply = await openai.provider.complete(HELLO, seen)
    assert reply.text == "The 9th is cheaper." and "".join(seen.seen) == reply.text and len(seen.seen) > 1


@pytest.mark.parametrize("body", [b"", b"  \n\n"])
async def test_an_empty_answer_that_names_no_type_is_a_stream_cut_short_and_tried_again(
    openai: Family, body: bytes
) -> None:
    openai.api.push(httpx.Response(200, content=body), httpx.Response(200, json=fixture("openai", "text")))

    reply = await openai.provider.complete(HELLO, Collected())

    assert reply.text == "The 9th is cheaper." and len(openai.api.bodies) == 2


@pytest.mark.parametrize("streamed_request", [False, True])
async def test_an_error_answered_with_200_is_the_error_it_names(openai: Family, streamed_request: bool) -> None:
    # (some gateways answer an overload with 200 and an error body)
    busy = {"error": {"type": "overloaded_error", "message": "Overloaded"}}
    openai.api.push(httpx.Response(200, json=busy), httpx.Response(200, json=fixture("openai", "text")))

    answered = await openai.provider.complete(HELLO, Collected() if streamed_request else None)

    assert answered.text == "The 9th is cheaper." and len(openai.api.bodies) == 2  # retried as an overload
    openai.api.push(httpx.Response(200, json={"error": {"type": "invalid_request_error", "message": "bad"}}))
    with pytest.raises(ProviderError) as caught:
        await openai.provider.complete(HELLO, Collected() if streamed_request else None)
    assert (caught.value.kind, caught.value.message) == ("bad_request", "error in the answer: bad")

