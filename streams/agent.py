"""The public agent API: an `Agent` is a name, a system prompt, a model and its fallbacks,
tools, prices, budgets, debounce and double-text policy; `turnstile run module:agent`
(or `await agent.serve()`) runs it as a worker on the embedded log or on Kafka.

An Agent is plain configuration: creating one does no I/O and needs no event loop.
Providers are made when it is served, and the log is opened inside the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Unpack, overload

from turnstile.events import OUTCOME_TYPES, DecodeError, Event, ToolCall, TurnCompleted, Usage, decode_record
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import DebouncePolicy, DoubleText, DoubleTextPolicy
from turnstile.handlers.operations import AlreadyTaken, Refused, Verb
from turnstile.handlers.pricing import ModelPrice, PriceTable
from turnstile.handlers.provider import (
    ModelReply,
    ModelRequest,
    ProtocolFamily,
    Provider,
    ProviderError,
    ProviderErrorKind,
    ReplyStream,
)
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.handlers.retry import GiveUp, RetryPolicy, given_up, next_retry
from turnstile.handlers.schedule import Schedule
from turnstile.handlers.tool_functions import ToolCallable, ToolFlags, tool_from_function
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.config_file import shipped_prices
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_reads import Unavailable
from turnstile.streams.operations_cli import decided_on_log
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.serving import LogPlace, WorkerOptions, serve
from turnstile.streams.turn_runner import Route, TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig


@dataclass(frozen=True, slots=True)
class Model:
    """A model behind an HTTP API of one protocol family. The key is read from the
    environment variable `api_key_env` when the agent is served, never stored here.
    `price` (USD per million tokens) is what budgets are charged; a model without one
    pauses its turn on cost before anything more is spent after its first reply, as the
    cost cannot be known."""

    name: str
    family: Literal["openai", "anthropic"] = "openai"
    base_url: str | None = None
    api_key_env: str = "TURNSTILE_API_KEY"
    price: ModelPrice | None = None
    # OpenAI-compatible servers that only know `max_tokens` (not max_completion_tokens).
    legacy_max_tokens: bool = False

    def __post_init__(self) -> None:
        # Made where the agent's code says it, refused there: not at the first request.
        if not self.name:
            raise ValueError("a model needs a name")
        if self.family not in ("openai", "anthropic"):
            raise ValueError(f"model {self.name!r}: family is 'openai' or 'anthropic', not {self.family!r}")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"model {self.name!r}: base_url {self.base_url!r} is not an http:// or https:// URL")
        if not self.api_key_env:
            raise ValueError(f"model {self.name!r}: api_key_env names no environment variable")

    def provider(self) -> Provider:
        from turnstile.streams.provider_http import http_provider

        legacy = frozenset({self.name}) if self.legacy_max_tokens else frozenset()
        return http_provider(self.family, self.base_url, os.environ.get(self.api_key_env), self.api_key_env, legacy)


TestReply = str | ModelReply | Exception


class _Retrying(ScriptedProvider):
    """A scripted provider whose failures are retried as the HTTP transport retries a real
    provider's, within the request (the same policy and the same error the turn sees when it
    gives up), each retry taking the next scripted reply; at once, not after the backoff."""

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        retries = 0
        while True:
            try:
                return await super().complete(request, stream)
            except ProviderError as error:
                decision = next_retry(RetryPolicy(), retries, error, 0.0, request.time_left_s)
                if isinstance(decision, GiveUp):
                    raise given_up(error, decision, retries) from None
                if stream is not None:
                    await stream.restart()
                retries += 1


@dataclass(frozen=True, slots=True)
class TestModel:
    """A model for your own tests, in process and free: it answers each request with the
    next of `replies` (text, a `ModelReply` such as `TestModel.calls(...)`, or an exception:
    a `ProviderError` as it is, any other as the provider failing -- a `TimeoutError` as a
    request that timed out, a `ConnectionError` as one that got no answer, others as a server
    error -- each retried as a real provider's would be), or with `respond(request)`; with
    neither it quotes the user's latest input back. A tool call id it already gave is given
    again with a suffix (`call-1-2`), as a real model never repeats one. Every request it got
    is in `.requests` once the agent has served; `replies` are taken in order across every
    time it serves (one `agent.answer` after another goes on where the last stopped)."""

    __test__ = False  # not a pytest test class, despite the name

    name: str = "test-model"
    replies: Sequence[TestReply] = ()
    respond: Callable[[ModelRequest], TestReply] | None = None
    delay_s: float = 0.0
    price: ModelPrice = ModelPrice(0.0, 0.0, 0.0, 0.0)
    family: ProtocolFamily = "scripted"
    _served: list[ScriptedProvider] = field(default_factory=list, compare=False, repr=False)
    _call_ids: set[str] = field(default_factory=set, compare=False, repr=False)

    @staticmethod
    def calls(name: str, arguments: str = "{}", call_id: str = "call-1") -> ModelReply:
        """A reply that calls tool `name` with `arguments` (JSON text)."""
        return _calling(ToolCall(call_id=call_id, name=name, arguments=arguments))

    @staticmethod
    def parallel(*calls: tuple[str, str]) -> ModelReply:
        """A reply that calls several tools at once, as both providers' models may:
        `(name, arguments)` each, given the ids call-1, call-2, ... in order."""
        if not calls:
            raise ValueError("TestModel.parallel() needs at least one (name, arguments) call")
        return _calling(*(ToolCall(call_id=f"call-{n}", name=name, arguments=arguments)
                          for n, (name, arguments) in enumerate(calls, start=1)))  # fmt: skip

    @property
    def requests(self) -> list[ModelRequest]:
        return [r for provider in self._served for r in provider.requests]

    def provider(self) -> Provider:
        def script(request: ModelRequest) -> Scripted:
            taken = len(self.requests) - 1  # this request is the last of them (recorded first)
            if taken < len(self.replies):
                reply = self.replies[taken]
            elif self.respond is not None:
                reply = self.respond(request)
            else:
                reply = echo_reply(request)
            if isinstance(reply, str):
                reply = ModelReply(request.model, reply, (), Usage(input_tokens=1, output_tokens=1), "stop")
            elif isinstance(reply, ModelReply):
                reply = dataclasses.replace(reply, tool_calls=tuple(map(self._unique, reply.tool_calls)))
            else:
                reply = _as_provider_error(reply)
            return Scripted(reply, self.delay_s)

        provider = _Retrying(script)
        self._served.append(provider)
        return provider

    def _unique(self, call: ToolCall) -> ToolCall:
        given, n = call.call_id, 1
        while given in self._call_ids:
            n += 1
            given = f"{call.call_id}-{n}"
        self._call_ids.add(given)
        return call if given == call.call_id else call.model_copy(update={"call_id": given})


def _calling(*calls: ToolCall) -> ModelReply:
    return ModelReply("test-model", None, calls, Usage(input_tokens=1, output_tokens=1), "tool_calls", "tool_use")


def _as_provider_error(error: Exception) -> ProviderError:
    if isinstance(error, ProviderError):
        return error
    kind: ProviderErrorKind = (
        "timeout" if isinstance(error, TimeoutError)
        else "connection" if isinstance(error, ConnectionError)
        else "server_error"
    )  # fmt: skip
    return ProviderError(kind, f"{type(error).__name__}: {error}", retryable=True)


AnyModel = Model | TestModel


class Agent:
    """An agent, declared the way Pydantic AI agents are and served the way faust apps are:

        agent = Agent("support", model=Model("gpt-4.1-mini", price=ModelPrice(0.4, 1.6)),
                      system_prompt="You help customers with their orders.")

        @agent.tool
        def lookup_order(order_id: str) -> str:
            "The status of an order."
            ...

    then `turnstile run mymodule:agent [--broker kafka://…]`.

    `fallbacks` are tried in order when the model fails mid-attempt; they must speak the
    model's protocol family (a transcript is never rebuilt for another protocol).
    """

    def __init__(
        self,
        name: str,
        *,
        model: AnyModel,
        system_prompt: str | None = None,
        fallbacks: Sequence[AnyModel] = (),
        tools: Iterable[Tool] = (),
        budget: TurnBudget = TurnBudget(),
        debounce: DebouncePolicy = DebouncePolicy(),
        double_text: DoubleText | DoubleTextPolicy = "enqueue",
        max_attempts: int = 3,
        max_output_tokens: int = 1024,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"an agent's name is a non-empty str, not {name!r}")
        for what, given in (("model", model), *(("a fallback", f) for f in fallbacks)):
            if not isinstance(given, Model | TestModel):
                hint = f" (Model({given!r}))" if isinstance(given, str) else ""
                raise TypeError(f"agent {name!r}: {what} is a turnstile.Model or TestModel{hint}, "
                                f"not {type(given).__name__}")  # fmt: skip
        settings: tuple[tuple[str, object, object], ...] = (
            ("system_prompt", system_prompt, str | None), ("budget", budget, TurnBudget),
            ("debounce", debounce, DebouncePolicy),
        )  # fmt: skip
        for what, value, kind in settings:
            if not isinstance(value, kind):  # type: ignore[arg-type]
                expected = getattr(kind, "__name__", kind)  # (a union has none: `str | None`)
                raise TypeError(f"agent {name!r}: {what} is {expected}, not {type(value).__name__}")
        for what, count in (("max_attempts", max_attempts), ("max_output_tokens", max_output_tokens)):
            if not isinstance(count, int) or isinstance(count, bool):
                raise TypeError(f"agent {name!r}: {what} is an int, not {count!r}")
        if isinstance(tools, Tool) or callable(tools):
            one = getattr(tools, "name", None) or getattr(tools, "__name__", "the_tool")
            raise TypeError(f"agent {name!r}: tools is a list of tools: tools=[{one}]")
        if max_attempts < 1 or max_output_tokens < 1:
            raise ValueError(f"agent {name!r}: max_attempts and max_output_tokens must be at least 1")
        if isinstance(double_text, str):
            double_text = DoubleTextPolicy(double_text).default  # refuses an unknown policy
        for fallback in fallbacks:
            if fallback.family != model.family:
                raise ValueError(
                    f"fallback {fallback.name!r} speaks the {fallback.family} protocol, not {model.family} like "
                    f"{model.name!r}: a turn cannot move to another protocol family mid-turn"
                )
        self.name = name
        self.model = model
        self.system_prompt = system_prompt
        self.fallbacks = tuple(fallbacks)
        self.budget = budget
        self.debounce = debounce
        self.double_text = double_text
        self.max_attempts = max_attempts
        self.max_output_tokens = max_output_tokens
        self.tools: list[Tool] = []
        for each in tools:
            self.add_tool(each)

    def add_tool(self, tool_: Tool) -> Tool:
        if not isinstance(tool_, Tool):
            made = type(tool_).__name__
            raise TypeError(f"agent {self.name!r}: a tool is made with @tool or @agent.tool, not {made}")
        if any(t.name == tool_.name for t in self.tools):
            raise ValueError(f"agent {self.name!r} already has a tool named {tool_.name!r}")
        ToolRegistry([*self.tools, tool_])  # what the model APIs and approvals need of it, refused here
        self.tools.append(tool_)
        return tool_

    @overload
    def tool(self, function: ToolCallable, /) -> Tool: ...

    @overload
    def tool(self, /, **flags: Unpack[ToolFlags]) -> Callable[[ToolCallable], Tool]: ...

    def tool(
        self, function: ToolCallable | None = None, /, **flags: Unpack[ToolFlags]
    ) -> Tool | Callable[[ToolCallable], Tool]:
        """`@agent.tool` or `@agent.tool(side_effect=True, ...)`: see `turnstile.tool`."""

        def decorate(f: ToolCallable) -> Tool:
            return self.add_tool(tool_from_function(f, **flags))

        return decorate(function) if function is not None else decorate

    @contextlib.contextmanager
    def override(self, *, model: AnyModel) -> Iterator[Agent]:
        """Within the block the agent uses `model` and no fallbacks, as in Pydantic AI's
        `agent.override(model=TestModel())`: your tests run your agent, tools and prompt
        unchanged against a scripted model."""
        saved = self.model, self.fallbacks
        self.model, self.fallbacks = model, ()
        try:
            yield self
        finally:
            self.model, self.fallbacks = saved

    def models(self) -> tuple[AnyModel, ...]:
        return (self.model, *self.fallbacks)

    def worker_config(self, providers: dict[str, Provider], options: WorkerOptions | None = None) -> WorkerConfig:
        """The worker's configuration, with `providers` (model name -> provider) serving
        the fallbacks."""
        turn = TurnSettings(
            model=self.model.name,
            system_prompt=self.system_prompt,
            max_attempts=self.max_attempts,
            budget=self.budget,
            prices=self.prices(),
            tools=ToolRegistry(self.tools),
            fallbacks=tuple(Route(m.name, providers[m.name]) for m in self.fallbacks),
            max_output_tokens=self.max_output_tokens,
        )
        return WorkerConfig(
            debounce=self.debounce, turn=turn, double_text=self.double_text_policy(), **(options or {})
        )

    def prices(self) -> PriceTable:
        """What its models cost: the shipped table prices a model given without a price; a
        model's own price wins."""
        return {**shipped_prices().prices, **{m.name: m.price for m in self.models() if m.price is not None}}

    def double_text_policy(self) -> DoubleTextPolicy:
        if isinstance(self.double_text, DoubleTextPolicy):
            return self.double_text
        return DoubleTextPolicy(self.double_text)

    def providers(self) -> dict[str, Provider]:
        """One provider per model; models of one endpoint share it (one connection pool)."""
        made: dict[tuple[object, ...], Provider] = {}
        by_model: dict[str, Provider] = {}
        for m in self.models():
            endpoint: tuple[object, ...] = (
                (m.family, m.base_url, m.api_key_env, m.legacy_max_tokens) if isinstance(m, Model) else (id(m),)
            )
            if endpoint not in made:
                made[endpoint] = m.provider()
            by_model[m.name] = made[endpoint]
        return by_model

    async def answer(
        self, text: str, *, conversation: str = "c1", data: Path | str | None = None, timeout_s: float = 30.0
    ) -> Answered:
        """Send `text` to `conversation` and run the agent on an embedded log -- a temporary
        folder, or `data` (kept: a later call goes on with the conversation) -- until the turn
        that claims the message has its outcome. For your tests, with a `TestModel`: no
        broker, no port, nothing printed; a `TimeoutError` past `timeout_s`. `data` has one
        owner at a time: while another answer or worker runs on it, `LogOwned` is raised and
        nothing is sent."""
        if data is not None:
            return await self._answer(text, conversation, Path(data), timeout_s)
        with tempfile.TemporaryDirectory(prefix="turnstile-answer-") as folder:
            return await self._answer(text, conversation, Path(folder), timeout_s)

    async def _answer(self, text: str, conversation: str, data: Path, timeout_s: float) -> Answered:
        async with _owned(data) as log:
            message = message_event(conversation, text, SystemClock().now_ms())
            await publish(log, message)
            return await self._until_answered(log, conversation, message.message_id, timeout_s)

    async def approve(
        self, call_id: str, *, data: Path | str, conversation: str = "c1", note: str | None = None,
        turn_id: str | None = None, timeout_s: float = 30.0,
    ) -> Answered:  # fmt: skip
        """`turnstile approve` in a test: approve the call a turn of `conversation` in `data`
        (the folder an `answer` kept) paused on, and run the agent until the turn that claims
        the approval has its outcome. `OperationRefused` (nothing sent) when no such call waits."""
        return await self._operate("approve", call_id, note, conversation, Path(data), timeout_s, turn_id)

    async def deny(
        self, call_id: str, *, data: Path | str, conversation: str = "c1", note: str | None = None,
        turn_id: str | None = None, timeout_s: float = 30.0,
    ) -> Answered:  # fmt: skip
        """`turnstile deny` in a test, as `approve`."""
        return await self._operate("deny", call_id, note, conversation, Path(data), timeout_s, turn_id)

    async def resume(
        self, *, data: Path | str, conversation: str = "c1", note: str | None = None, timeout_s: float = 30.0
    ) -> Answered:
        """`turnstile resume` in a test: a new turn that continues the last one (paused on its
        budget, failed or exhausted), run until its outcome."""
        return await self._operate("resume", None, note, conversation, Path(data), timeout_s)

    async def _operate(
        self, verb: Verb, call_id: str | None, note: str | None, conversation: str, data: Path, timeout_s: float,
        turn_id: str | None = None,
    ) -> Answered:  # fmt: skip
        async with _owned(data) as log:
            place = LogPlace(data=data)
            decided = await decided_on_log(place, conversation, verb, call_id, note, turn_id, self.debounce)
            if isinstance(decided, Unavailable):
                raise OSError(decided.message)
            if isinstance(decided, Refused):
                raise OperationRefused(decided.reason)
            if isinstance(decided, AlreadyTaken):
                raise OperationRefused(decided.said)
            await publish(log, decided.event)
            return await self._until_answered(log, conversation, decided.input_id, timeout_s)

    async def _until_answered(self, log: FileLog, conversation: str, message_id: str, timeout_s: float) -> Answered:
        providers = self.providers()
        config = self.worker_config(providers, {"drain_grace_s": 0.0})  # the outcome is on the log: stop at once
        stop = asyncio.Event()
        running = asyncio.create_task(Worker(log, providers[self.model.name], config).run(stop))
        events: list[Event] = []
        try:
            async with asyncio.timeout(timeout_s):
                async for record in log.follow(log.topics.events, from_end=False):
                    event = decode_record(record.key, record.value)
                    if isinstance(event, DecodeError) or event.conversation_id != conversation:
                        continue
                    events.append(event)
                    if isinstance(event, OUTCOME_TYPES) and message_id in event.statuses:
                        return Answered(event, events)
        except TimeoutError:
            raise TimeoutError(f"no outcome for the message to {conversation!r} within {timeout_s:g} s") from None
        finally:
            stop.set()
            await running
            for provider in {id(p): p for p in providers.values()}.values():
                await provider.aclose()
        raise AssertionError("the log's follower ended")  # it follows until cancelled

    async def serve(
        self,
        place: LogPlace | None = None,
        *,
        schedules: Sequence[Schedule] = (),
        http: tuple[str, int] | None = None,
        http_token: str | None = None,
        worker: WorkerOptions | None = None,
        stop: asyncio.Event | None = None,
        effective_config: str | None = None,
    ) -> int:
        """Runs the agent as a worker on `place` (default: the embedded log in .turnstile)
        until SIGINT/SIGTERM, or until `stop` (an `asyncio.Event`) is set; logs
        `effective_config` at start (`turnstile run` says what it runs with)."""
        # serve() warns at start for each model without a price.
        providers = self.providers()
        config = self.worker_config(providers, worker)
        return await serve(
            place or LogPlace(), providers[self.model.name], config, schedules=schedules, http=http,
            http_token=http_token, stop=stop,
            signals=stop is None, effective_config=effective_config,
        )


@contextlib.asynccontextmanager
async def _owned(data: Path) -> AsyncIterator[FileLog]:
    """The embedded log in `data`, owned while in use: `LogOwned` while another answer or
    worker runs on it, refused before anything is sent; let go after (again, if the worker
    stopped it)."""
    log = FileLog(data)
    log.own()
    try:
        yield log
    finally:
        await log.stop()


class OperationRefused(ValueError):
    """`Agent.approve`, `deny` or `resume` found nothing to act on (the reason names why)."""


@dataclass(frozen=True, slots=True)
class Answered:
    """What `Agent.answer` returns: the outcome of the turn that answered the message
    (`TurnCompleted`, `TurnPaused`, `TurnFailed` or `TurnExhausted`) and the conversation's
    events on the log up to it, in order."""

    outcome: Event
    events: list[Event]

    @property
    def reply(self) -> str | None:
        """The reply, when the turn completed."""
        return self.outcome.reply if isinstance(self.outcome, TurnCompleted) else None


class AgentImportFailed(ValueError):
    """The agent's module raised while it was imported; `__cause__` is what it raised."""


def _where(exc: BaseException) -> str:
    """The error and the line of the agent's code it came from, in one line."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "importlib" not in f.filename]
    at = f" ({ours[-1].filename}, line {ours[-1].lineno})" if ours else ""
    return f"{type(exc).__name__}: {exc}{at}"


def load_agent(target: str) -> Agent:
    """`package.module:attribute` -> the Agent there, imported as uvicorn imports apps (the
    current directory is on the path, so a module next to you is found)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected MODULE:AGENT (e.g. examples.support_agent:agent), got {target!r}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name != missing and not module_name.startswith(f"{missing}."):
            raise AgentImportFailed(f"{target}: importing {module_name} failed: {_where(exc)}") from exc
        raise ValueError(
            f"{target}: no module named {missing!r} in {os.getcwd()}: run from the folder that holds it, "
            "or put that folder on PYTHONPATH"
        ) from None
    except Exception as exc:  # the agent's own code: a syntax error, a raise at import
        raise AgentImportFailed(f"{target}: importing {module_name} failed: {_where(exc)}") from exc
    if not hasattr(module, attribute):
        raise ValueError(f"{target}: {module_name} ({module.__file__}) has no {attribute!r}")
    found = getattr(module, attribute)
    if not isinstance(found, Agent):
        raise ValueError(f"{target}: {attribute!r} in {module_name} is {type(found).__name__}, not a turnstile.Agent")
    return found
