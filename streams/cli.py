"""`turnstile`: demo, run, send and tail, on Kafka or on the embedded log."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from turnstile.events import DecodeError, decode
from turnstile.handlers.claim import DOUBLE_TEXT_POLICIES, DebouncePolicy, DoubleTextPolicy
from turnstile.handlers.pricing import DEFAULT_PRICES, ModelPrice, parse_price
from turnstile.handlers.provider import Provider
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.handlers.schedule import Schedule, parse_schedules
from turnstile.streams import audit_cli, log_format
from turnstile.streams.cli_errors import (
    NOT_FOUND,
    UNAVAILABLE,
    CliError,
    broker_url,
    explain,
    http_address,
    non_empty,
    schedules_error,
)
from turnstile.streams.inert import printable
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.serving import DEFAULT_DATA, LogPlace, WorkerOptions, serve
from turnstile.streams.timeline import describe
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import WorkerConfig

DEFAULT_TOPICS = Topics()
DEFAULT_DEBOUNCE = DebouncePolicy()


def _add_log_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--broker", type=broker_url, help="kafka://HOST:PORT[,HOST:PORT] (default: the embedded file log)"
    )
    where.add_argument("--data", type=Path, default=DEFAULT_DATA, help="embedded log folder (default: .turnstile)")
    parser.add_argument("--events-topic", default=DEFAULT_TOPICS.events)
    parser.add_argument("--outcomes-topic", default=DEFAULT_TOPICS.outcomes)
    parser.add_argument("--dlq-topic", default=DEFAULT_TOPICS.dead_letters)
    parser.add_argument("--deltas-topic", default=DEFAULT_TOPICS.deltas)


def _place(args: argparse.Namespace) -> LogPlace:
    topics = Topics(args.events_topic, args.outcomes_topic, args.dlq_topic, args.deltas_topic)
    membership = None
    if args.broker and args.command == "run":
        from turnstile.streams.kafka_log import Membership

        membership = Membership(args.instance_id, round(args.session_timeout_s * 1000))
    return LogPlace(args.broker, args.data, topics, getattr(args, "group", "turnstile-worker"), membership)


def _schedules(path: Path) -> tuple[Schedule, ...]:
    try:
        return parse_schedules(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # JSONDecodeError and the schedule's own errors are ValueErrors
        raise schedules_error(str(path), exc) from None


async def _wait_for_broker(bootstrap: str, patience_s: float) -> None:
    """Retry an unreachable broker with backoff (a worker often starts before it), saying so."""
    from turnstile.streams.kafka_reader import reachable

    loop = asyncio.get_running_loop()
    deadline, wait = loop.time() + patience_s, 0.5
    while not await asyncio.to_thread(reachable, bootstrap):
        if loop.time() + wait > deadline:
            raise CliError(
                UNAVAILABLE,
                f"cannot reach the Kafka broker at {bootstrap}"
                + (f" after {patience_s:g} s" if patience_s else "")
                + ": is it running? (bash infra/kafka/start.sh starts one)",
            )
        print(f"turnstile: broker {bootstrap} not reachable, retrying in {wait:g} s", file=sys.stderr, flush=True)
        await asyncio.sleep(wait)
        wait = min(wait * 2, 10.0)


def _provider(args: argparse.Namespace) -> Provider:
    key = os.environ.get("TURNSTILE_API_KEY")
    if args.provider == "openai":
        from turnstile.handlers.providers.openai_chat import OpenAIChat
        from turnstile.streams.provider_http import HttpProvider

        wire = OpenAIChat(legacy_max_tokens=frozenset(args.legacy_max_tokens))
        return HttpProvider(wire, args.base_url or "https://api.openai.com/v1", key)
    if args.provider == "anthropic":
        from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
        from turnstile.streams.provider_http import HttpProvider

        return HttpProvider(AnthropicMessages(), args.base_url or "https://api.anthropic.com", key)
    return ScriptedProvider(delay_s=args.scripted_delay)


async def _run(args: argparse.Namespace) -> int:
    from turnstile.streams.http_api import InsecureBind, check_bind, parse_address, read_token

    http = parse_address(args.http) if args.http else None
    try:
        token = read_token(os.environ, args.http_token_file)
        if http is not None:
            check_bind(http[0], token)  # before anything is opened: a refusal leaves nothing behind
    except (InsecureBind, OSError, ValueError) as exc:
        print(f"turnstile run: {exc}", file=sys.stderr)
        return 2
    schedules = _schedules(args.schedules) if args.schedules else ()
    if args.agent is not None:
        from turnstile.streams.agent import load_agent

        agent = load_agent(args.agent)
        return await agent.serve(_place(args), schedules=schedules, http=http, http_token=token,
                                 worker=_worker_options(args))
    config = WorkerConfig(
        debounce=DebouncePolicy(args.quiet_ms, args.max_wait_ms, args.max_batch),
        double_text=DoubleTextPolicy(args.double_text, dict(args.double_text_for)),
        turn=TurnSettings(model=args.model, prices={**DEFAULT_PRICES, **dict(args.price)}),
        **_worker_options(args),
    )
    return await serve(_place(args), _provider(args), config, schedules=schedules, http=http, http_token=token)


def _worker_options(args: argparse.Namespace) -> WorkerOptions:
    """The flags of `run` that are about the process, not the agent: they apply either way."""
    return {"drain_grace_s": args.drain_grace_s, "stream_replies": not args.no_stream, "tracing": args.trace}


async def _send(args: argparse.Namespace) -> int:
    from turnstile.streams.operations_cli import publish_input

    place = _place(args)
    text = sys.stdin.read() if args.text == "-" else args.text
    event = message_event(args.conversation, non_empty(text), SystemClock().now_ms(), args.message_id)
    partition, offset = await publish_input(place, event)
    print(f"sent message {event.message_id} to {place.topics.events}[{partition}]@{offset}")
    return 0


async def _operate(args: argparse.Namespace) -> int:
    from turnstile.streams.operations_cli import operate

    return await operate(args, _place(args))


async def _tail(args: argparse.Namespace) -> int:
    records = await _place(args).open().reader().read(args.events_topic)
    for record in records:
        event = decode(record.value)
        if isinstance(event, DecodeError):
            continue
        if args.conversation in (None, event.conversation_id):
            # Ids and content are a client's: printed inert, no escape sequence reaches the terminal.
            print(f"{record.partition}@{record.offset:<6} {printable(event.conversation_id):<20} "
                  f"{printable(describe(event))}")
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    from turnstile.streams.inspect_cli import inspect

    topics = Topics(args.events_topic, args.outcomes_topic, args.dlq_topic, args.deltas_topic)
    view = await inspect(args.conversation, broker=args.broker, data=args.data, topics=topics)
    if view.state.events_applied == 0 and view.undecodable == 0:
        raise CliError(NOT_FOUND, f"no event of conversation {args.conversation!r} is on {args.broker or args.data}")
    return 0


def _price(text: str) -> tuple[str, ModelPrice]:
    try:
        return parse_price(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _conversation_policy(text: str) -> tuple[str, str]:
    conversation, _, policy = text.rpartition("=")
    if not conversation or policy not in DOUBLE_TEXT_POLICIES:
        raise argparse.ArgumentTypeError(f"expected CONVERSATION=enqueue|reject|interrupt, got {text!r}")
    return conversation, policy


def build_parser() -> argparse.ArgumentParser:
    from turnstile import __version__

    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__)
    parser.add_argument("--version", action="version", version=f"turnstile {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO and show tracebacks of errors")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="logs as text or JSON lines")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the seed's double-text scenario on the embedded log")
    demo.add_argument("--data", type=Path, default=None, help="keep the demo's log here (default: a temp folder)")

    run = sub.add_parser("run", help="run a worker: of your agent (MODULE:AGENT) or configured by these flags")
    run.add_argument(
        "agent",
        nargs="?",
        default=None,
        metavar="MODULE:AGENT",
        help="a turnstile.Agent to run, as uvicorn takes an app (e.g. examples.support_agent:agent); its model, "
        "prompt, tools, prices, budgets, debounce and double-text policy replace the flags that set them",
    )
    _add_log_args(run)
    run.add_argument("--group", default="turnstile-worker", help="Kafka consumer group")
    run.add_argument(
        "--instance-id",
        default=os.environ.get("TURNSTILE_INSTANCE_ID") or None,
        help="a stable name of this worker (a pod name; default: env TURNSTILE_INSTANCE_ID): a restart under"
        " it within the session timeout keeps its partitions and rebalances nobody (static membership)",
    )
    run.add_argument(
        "--session-timeout-s",
        type=float,
        default=10.0,
        help="how long the group waits for a silent worker before moving its partitions (default: 10; 6..300)",
    )
    run.add_argument("--provider", choices=["scripted", "openai", "anthropic"], default="scripted")
    run.add_argument("--model", default="scripted-1", help="the model the provider is asked for (default: scripted-1)")
    run.add_argument(
        "--price",
        type=_price,
        action="append",
        default=[],
        metavar="MODEL=INPUT,OUTPUT[,CACHED_INPUT[,CACHE_WRITE]]",
        help="a model's price in USD per million tokens (repeatable); a model without one is warned about at start",
    )
    run.add_argument("--base-url", default=None, help="provider endpoint; the key comes from TURNSTILE_API_KEY")
    run.add_argument(
        "--trace",
        action="store_true",
        help="OpenTelemetry spans of turns, attempts, model and tool calls, to the global tracer provider "
        "(needs the [otel] extra; e.g. run under opentelemetry-instrument to export them)",
    )
    run.add_argument(
        "--no-stream",
        action="store_true",
        help="do not stream replies (no deltas topic, no GET /conversations/{id}/stream); "
        "each reply is recorded whole either way",
    )
    run.add_argument(
        "--legacy-max-tokens",
        action="append",
        default=[],
        metavar="MODEL",
        help="send max_tokens instead of max_completion_tokens to this model (OpenAI-compatible servers "
        "that only know the old name; '*' for every model); repeatable",
    )
    run.add_argument("--scripted-delay", type=float, default=0.0, help="seconds the scripted model takes")
    run.add_argument("--quiet-ms", type=int, default=DEFAULT_DEBOUNCE.quiet_ms)
    run.add_argument("--max-wait-ms", type=int, default=DEFAULT_DEBOUNCE.max_wait_ms)
    run.add_argument("--max-batch", type=int, default=DEFAULT_DEBOUNCE.max_batch)
    run.add_argument(
        "--drain-grace-s",
        type=float,
        default=WorkerConfig.drain_grace_s,
        help="on SIGTERM or Ctrl-C, seconds the turns in flight may take to end (default: 30; a second signal"
        " stops at once, leaving them to the next worker)",
    )
    run.add_argument(
        "--http", type=http_address, default=None, metavar="HOST:PORT", help="serve the HTTP API and /metrics here"
    )
    run.add_argument(
        "--http-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="bearer token the HTTP API requires (default: $TURNSTILE_HTTP_TOKEN; one is required to serve"
        " a non-loopback address)",
    )
    run.add_argument(
        "--connect-timeout-s",
        type=float,
        default=60.0,
        help="how long run waits, retrying, for an unreachable broker before it gives up (default: 60)",
    )
    run.add_argument("--schedules", type=Path, default=None, metavar="FILE", help="JSON list of schedules")
    run.add_argument(
        "--double-text",
        choices=DOUBLE_TEXT_POLICIES,
        default="enqueue",
        help=(
            "a message that arrives during a turn: queue it for the next turn (default), refuse it, or "
            "interrupt the turn if no side-effecting tool has started and answer old and new together"
        ),
    )
    run.add_argument(
        "--double-text-for",
        type=_conversation_policy,
        action="append",
        default=[],
        metavar="CONVERSATION=enqueue|reject|interrupt",
        help="the policy of one conversation (repeatable)",
    )

    send = sub.add_parser("send", help="publish a user message")
    _add_log_args(send)
    send.add_argument("--conversation", required=True)
    send.add_argument("--text", type=non_empty, required=True, help="the message; - reads it from stdin")
    send.add_argument("--message-id", default=None, help="idempotency key (default: a new id)")

    tail = sub.add_parser("tail", help="print the events of one or all conversations")
    _add_log_args(tail)
    tail.add_argument("--conversation", default=None)

    inspect = sub.add_parser("inspect", help="show a conversation: history, pending, active turn, turn timelines")
    _add_log_args(inspect)
    inspect.add_argument("conversation")

    from turnstile.streams.operations_cli import add_parsers

    add_parsers(sub, _add_log_args)
    audit_cli.add_parser(sub)
    for command in sub.choices.values():  # the global flags work after the subcommand too
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="as above")
        command.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS, help="as above")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run" and not 6 <= args.session_timeout_s <= 300:
        parser.error(f"--session-timeout-s {args.session_timeout_s:g} is outside 6..300 s (the broker's bounds)")
    log_format.configure(args.verbose, args.log_format)
    if args.command == "demo":
        from turnstile.streams.demo import main as demo_main

        return demo_main(args.data)
    handler = {"run": _run, "send": _send, "tail": _tail, "inspect": _inspect, "audit": audit_cli.run,
               "approve": _operate, "deny": _operate, "resume": _operate}[args.command]

    async def checked() -> int:
        if getattr(args, "broker", None):
            from turnstile.streams.kafka_log import bootstrap_of

            await _wait_for_broker(bootstrap_of(args.broker), args.connect_timeout_s if args.command == "run" else 0)
        return await handler(args)

    try:
        return asyncio.run(checked())
    except Exception as exc:
        error = explain(exc, args.command)
        if error is None:
            raise
        if args.verbose:
            logging.exception("turnstile %s failed", args.command)
        print(f"turnstile {args.command}: {error}", file=sys.stderr)
        return error.code


if __name__ == "__main__":
    sys.exit(main())
