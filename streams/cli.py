"""`turnstile`: demo, run, send and tail, on Kafka or on the embedded log."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from turnstile.events import DecodeError, decode_record
from turnstile.handlers.claim import DOUBLE_TEXT_POLICIES
from turnstile.handlers.pricing import ModelPrice, parse_price
from turnstile.handlers.schedule import Schedule, parse_schedules
from turnstile.projections.inert import printable
from turnstile.streams import audit_cli, config_file, log_format, run_config
from turnstile.streams.cli_errors import (
    CANT_CREATE,
    DATA_ERR,
    NO_INPUT,
    NOT_FOUND,
    UNAVAILABLE,
    USAGE,
    CliError,
    at_least,
    broker_url,
    explain,
    http_address,
    non_empty,
    schedules_error,
)
from turnstile.streams.log_storms import limit_client_storms
from turnstile.streams.publisher import message_event
from turnstile.streams.runtime import SystemClock
from turnstile.streams.serving import LogPlace, serve
from turnstile.streams.timeline import describe

log = logging.getLogger("turnstile.run")

DEFAULTS = config_file.Config()
# Configured commands: their flags, the environment and turnstile.toml are merged (config_file).
SCRIPTED_NOTE = (
    "no agent (MODULE:AGENT) and model.provider is scripted, the default: replies are echoes, for trying"
    " turnstile out; run your agent, or give --provider openai|anthropic and --model"
)
CONFIGURED = ("run", "send", "tail", "inspect", "approve", "deny", "resume", "export-turn", "audit", "topics")


def _add_log_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None here: a flag left out lets the environment or turnstile.toml decide.
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--broker", type=broker_url, help="kafka://HOST:PORT[,HOST:PORT] (default: the embedded file log)"
    )
    where.add_argument("--data", type=Path, help=f"embedded log folder (default: {DEFAULTS.data})")
    for key, what in (("events", "events"), ("outcomes", "outcome records"), ("dead_letters", "dead letters"),
                      ("deltas", "streamed reply pieces")):
        flag = config_file.FLAGS[("topics", key)]
        parser.add_argument(flag, metavar="TOPIC",
                            help=f"topic of the {what} (default: {getattr(DEFAULTS.topics, key)})")


# Commands that only read what is on the log (or decide from it): on an embedded log that is
# not there, a mistyped --data, they say so rather than print nothing.
READERS = ("tail", "inspect", "export-turn", "approve", "deny", "resume")


def _log_there(config: config_file.Config, command: str) -> None:
    if config.broker is None and command in READERS and not (config.data / config.topics.events).is_dir():
        where = f"{config.data} (no {config.topics.events} folder)"
        raise CliError(NO_INPUT, f"no embedded log in {where}: is --data right?")


def _place(config: config_file.Config, command: str) -> LogPlace:
    _log_there(config, command)
    membership = None
    if config.broker and command == "run":
        from turnstile.streams.kafka_log import Membership

        membership = Membership(config.instance_id, round(config.session_timeout_s * 1000))
    return LogPlace(config.broker, config.data, config.topics.topics(), config.group, membership)


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
                + ": is it running and is the address right? (turnstile speaks PLAINTEXT, not TLS; without "
                "--broker, the embedded log needs none)",
            )
        log.warning("broker %s not reachable, retrying in %g s", bootstrap, wait)
        await asyncio.sleep(wait)
        wait = min(wait * 2, 10.0)


async def _require_topics(bootstrap: str, config: config_file.Config, command: str) -> None:
    """The topics `command` reads or writes are there, or one line says which are not (the
    worker makes its snapshot topics itself; the others are the operator's to make, with the
    retention they want)."""
    from turnstile.streams.kafka_reader import TopicMissing, require_topics

    topics = config.topics
    needed = [topics.events]
    if command == "run":
        needed += [topics.outcomes, topics.dead_letters] + ([topics.deltas] if config.stream else [])
    try:
        await require_topics(bootstrap, needed)
    except TopicMissing as exc:
        them = "it" if len(exc.names) == 1 else "them"
        fix = f"create {them} with `turnstile topics --broker ...` (the same topic flags), or name the right ones"
        raise CliError(USAGE, f"{exc}: {fix} (--events-topic, --outcomes-topic, --dlq-topic, --deltas-topic)") from None


def _require_opentelemetry() -> None:
    try:
        import opentelemetry.trace  # noqa: F401  (only whether it is there)
    except ImportError:
        raise CliError(USAGE, "--trace makes OpenTelemetry spans: pip install 'turnstile-engine[otel]'") from None


async def _run(args: argparse.Namespace) -> int:
    from turnstile.streams.http_api import InsecureBind, check_bind, parse_address, read_token

    resolved: config_file.Resolved = args.resolved
    config = resolved.config
    http = parse_address(config.http.address) if config.http.address else None
    try:
        token = read_token(os.environ, config.http.token_file)
        if http is not None:
            check_bind(http[0], token)  # before anything is opened: a refusal leaves nothing behind
    except OSError as exc:
        raise CliError(NO_INPUT, f"cannot read the token file {config.http.token_file} ({exc.strerror})") from None
    except (InsecureBind, ValueError) as exc:
        print(f"turnstile run: {exc}", file=sys.stderr)
        return 2
    if config.trace:
        _require_opentelemetry()
    schedules = _schedules(config.schedules) if config.schedules else ()
    place = _place(config, "run")
    if args.agent is not None:
        from turnstile.streams.agent import Model, load_agent

        try:
            loaded = load_agent(args.agent)
        except ValueError as exc:  # no such module or attribute, not an Agent: a usage error
            # (with -v, the traceback of what the agent's module raised, if it raised)
            raise CliError(USAGE, str(exc)) from exc.__cause__
        agent, ignored = run_config.configure_agent(loaded, resolved)
        for warning in ignored:
            log.warning("%s", warning)
        keys = [m.api_key_env for m in agent.models() if isinstance(m, Model)]
        secrets = run_config.secrets_of(token, keys, os.environ)
        effective = run_config.effective(run_config.agent_view(agent, resolved), secrets, agent.prices())
        return await agent.serve(place, schedules=schedules, http=http, http_token=token,
                                 worker=run_config.worker_options(config), effective_config=effective)
    provider = run_config.provider(config.model, os.environ.get("TURNSTILE_API_KEY"))
    worker = run_config.worker_config(config, provider)
    secrets = run_config.secrets_of(token, ["TURNSTILE_API_KEY"], os.environ)
    effective = run_config.effective(resolved, secrets, worker.turn.prices)
    # The default model answers real messages with echoes: said once the worker runs.
    scripted = (SCRIPTED_NOTE,) if config.model.provider == "scripted" else ()
    return await serve(place, provider, worker, schedules=schedules, http=http, http_token=token,
                       effective_config=effective, notes=scripted)


async def _send(args: argparse.Namespace) -> int:
    from turnstile.events.identity import content_fingerprint
    from turnstile.streams.http_api import id_problem
    from turnstile.streams.http_reads import Unavailable
    from turnstile.streams.operations_cli import first_use, publish_input, unchecked

    # The ids HTTP and the console take (1..256 characters, no control character): one sent
    # from here that they refuse could never be read or approved there.
    for what, value in (("the conversation id", args.conversation), ("the message id", args.message_id)):
        if value is not None and (problem := id_problem(what, value)):
            raise CliError(DATA_ERR, f"{problem} (ids are 1..256 characters without control characters)")
    place = _place(args.resolved.config, args.command)
    text = args.text
    if text == "-":
        try:
            text = non_empty(sys.stdin.read())  # (the flag's type checked "-" itself only)
        except argparse.ArgumentTypeError as exc:
            raise CliError(USAGE, f"--text -: {exc}") from None
    event = message_event(args.conversation, text, SystemClock().now_ms(), args.message_id)
    config = args.resolved.config
    if config.broker is None and not (config.data / config.topics.events).is_dir():
        # A send from another folder than the worker's: said, or the message waits unanswered.
        print(f"turnstile send: no embedded log in {config.data.resolve()} yet: starting one there; a worker "
              "answers it only when run on the same folder (--data)", file=sys.stderr)  # fmt: skip
    partition, offset = await publish_input(place, event)
    reused = args.message_id is not None and await first_use(place, args.conversation, args.message_id)
    if isinstance(reused, Unavailable):
        unchecked(f"message {args.message_id!r}", reused)
    elif reused and reused != content_fingerprint(text):
        # The id was used before for other content: this one is dead-lettered, never answered.
        raise CliError(DATA_ERR, f"message id {args.message_id!r} was already used for other content")
    print(f"sent message {event.message_id} to {place.topics.events}[{partition}]@{offset}")
    return 0


async def _topics(args: argparse.Namespace) -> int:
    from turnstile.streams.kafka_log import bootstrap_of
    from turnstile.streams.kafka_reader import TopicsRefused, ensure_topics

    config = args.resolved.config
    if config.broker is None:
        raise CliError(USAGE, "the embedded log makes its topics itself: give --broker for Kafka's")
    bootstrap, topics = bootstrap_of(config.broker), config.topics.topics()
    try:
        created, count = await ensure_topics(bootstrap, topics, args.partitions, args.replication_factor)
    except TopicsRefused as exc:
        raise CliError(CANT_CREATE, str(exc)) from None
    for name in (topics.events, topics.outcomes, topics.dead_letters, topics.deltas, topics.snapshots, topics.heads):
        print(f"{name}: {'created' if name in created else 'already there'}")
    if count != args.partitions:
        print(f"turnstile topics: {topics.events} has {count} partitions, not {args.partitions}: kept as it is, and "
              "the topics made beside it have as many (a conversation's partition is its key's hash over the "
              "count: never change it)", file=sys.stderr)  # fmt: skip
    return 0


async def _operate(args: argparse.Namespace) -> int:
    from turnstile.streams.operations_cli import operate

    config = args.resolved.config
    return await operate(args, _place(config, args.command), config.debounce.policy())


async def _export_turn(args: argparse.Namespace) -> int:
    from turnstile.streams.console.export_cli import export_turn

    return await export_turn(args, _place(args.resolved.config, args.command))


async def _tail(args: argparse.Namespace) -> int:
    config: config_file.Config = args.resolved.config
    records = await _place(config, args.command).open().reader().read(config.topics.events)
    for record in records:
        event = decode_record(record.key, record.value)
        if isinstance(event, DecodeError):  # dead-lettered by the workers, not folded
            continue
        if args.conversation in (None, event.conversation_id):
            # Ids and content are a client's: printed inert, no escape sequence reaches the terminal.
            print(f"{record.partition}@{record.offset:<6} {printable(event.conversation_id):<20} "
                  f"{printable(describe(event))}")
    return 0


async def _inspect(args: argparse.Namespace) -> int:
    from turnstile.streams.inspect_cli import inspect

    config: config_file.Config = args.resolved.config
    _log_there(config, args.command)
    view = await inspect(args.conversation, broker=config.broker, data=config.data, topics=config.topics.topics(),
                         print_json=args.json)  # fmt: skip
    if view.state.events_applied == 0 and view.undecodable == 0:
        where = config.broker or config.data
        raise CliError(NOT_FOUND, f"no event of conversation {args.conversation!r} is on {where}")
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


def _add_run_args(run: argparse.ArgumentParser) -> None:
    # Every default is None: a flag left out lets the environment or turnstile.toml decide
    # (config_file); the defaults the help names are config_file.Config's.
    d = DEFAULTS
    run.add_argument("--group", help=f"Kafka consumer group (default: {d.group})")
    run.add_argument(
        "--instance-id",
        help="a stable name of this worker (a pod name): a restart under it within the session timeout keeps"
        " its partitions and rebalances nobody (static membership; default: none)",
    )
    run.add_argument(
        "--session-timeout-s",
        type=float,
        help=f"how long the group waits for a silent worker before moving its partitions "
        f"(default: {d.session_timeout_s:g}; 6..1800)",
    )
    run.add_argument(
        "--state-dir",
        type=Path,
        help="folder of the local snapshot store (default: a temporary one); one that outlives the process"
        " (a volume per worker) lets a restart read only the snapshots written since its clean stop",
    )
    run.add_argument(
        "--evict-idle-s",
        type=float,
        help=f"seconds without an event after which a settled conversation leaves memory for the local store"
        f" (default: {d.eviction.idle_s:g})",
    )
    run.add_argument(
        "--max-resident",
        type=int,
        help="at most this many conversations in memory, the least recently active leaving first"
        " (default: no bound but the idle time)",
    )
    run.add_argument(
        "--drain-grace-s",
        type=float,
        help=f"on SIGTERM or Ctrl-C, seconds the turns in flight may take to end (default: {d.drain_grace_s:g});"
        " then each finishes its step in progress (up to 5 s more) and is left to the next worker;"
        " a second signal stops at once",
    )
    run.add_argument(
        "--connect-timeout-s",
        type=float,
        help=f"how long run waits, retrying, for an unreachable broker before it gives up "
        f"(default: {d.connect_timeout_s:g})",
    )
    run.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        help="stream replies to the deltas topic and GET /conversations/{id}/stream (default: on); "
        "each reply is recorded whole either way",
    )
    run.add_argument(
        "--trace",
        action=argparse.BooleanOptionalAction,
        help="OpenTelemetry spans of turns, attempts, model and tool calls, to the global tracer provider "
        "(default: off; needs the [otel] extra; e.g. run under opentelemetry-instrument to export them)",
    )
    run.add_argument("--schedules", type=Path, metavar="FILE", help="JSON list of schedules (default: none)")
    run.add_argument(
        "--http", type=http_address, metavar="HOST:PORT", help="serve the HTTP API and /metrics here (default: off)"
    )
    run.add_argument(
        "--http-token-file",
        type=Path,
        metavar="FILE",
        help="bearer token the HTTP API requires (default: $TURNSTILE_HTTP_TOKEN; one is required to serve"
        " a non-loopback address)",
    )
    run.add_argument(
        "--provider", choices=["scripted", "openai", "anthropic"], help=f"the model's API (default: {d.model.provider})"
    )
    run.add_argument("--model", help=f"the model the provider is asked for (default: {d.model.name})")
    run.add_argument(
        "--base-url", help="provider endpoint (default: the provider's own); the key comes from TURNSTILE_API_KEY"
    )
    run.add_argument(
        "--fallback",
        action="append",
        metavar="MODEL",
        help="a model of the same provider tried, in order, when the model fails mid-attempt (repeatable)",
    )
    run.add_argument(
        "--legacy-max-tokens",
        action="append",
        metavar="MODEL",
        help="send max_tokens instead of max_completion_tokens to this model (OpenAI-compatible servers "
        "that only know the old name; '*' for every model); repeatable",
    )
    run.add_argument("--scripted-delay", type=float, metavar="S", help="seconds the scripted model takes (default: 0)")
    run.add_argument(
        "--price",
        type=_price,
        action="append",
        metavar="MODEL=INPUT,OUTPUT[,CACHED_INPUT[,CACHE_WRITE]]",
        help="a model's price in USD per million tokens (repeatable), over the shipped table; a model without"
        " one is warned about at start",
    )
    b = d.budget
    run.add_argument(
        "--max-iterations", type=int, help=f"model replies per attempt of a turn (default: {b.max_iterations})"
    )
    run.add_argument("--max-tool-calls", type=int, help=f"tool calls per logical turn (default: {b.max_tool_calls})")
    run.add_argument("--max-cost-usd", type=float, help=f"USD per logical turn (default: {b.max_cost_usd:g})")
    run.add_argument("--deadline-ms", type=int, help=f"wall clock per logical turn (default: {b.deadline_ms})")
    run.add_argument(
        "--soft-fraction",
        type=float,
        help=f"the share of a budget past which older tool exchanges are compacted (default: {b.soft_fraction:g})",
    )
    q = d.debounce
    run.add_argument(
        "--quiet-ms", type=int, help=f"claim once a conversation was quiet this long (default: {q.quiet_ms})"
    )
    run.add_argument(
        "--max-wait-ms",
        type=int,
        help=f"but no later than this after its oldest pending input (default: {q.max_wait_ms})",
    )
    run.add_argument("--max-batch", type=int, help=f"inputs one turn claims at most (default: {q.max_batch})")
    run.add_argument(
        "--double-text",
        choices=DOUBLE_TEXT_POLICIES,
        help=(
            "a message that arrives during a turn: queue it for the next turn (default), refuse it, or "
            "interrupt the turn if no side-effecting tool has started and answer old and new together"
        ),
    )
    run.add_argument(
        "--double-text-for",
        type=_conversation_policy,
        action="append",
        metavar="CONVERSATION=enqueue|reject|interrupt",
        help="the policy of one conversation (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    from turnstile import __version__

    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__)
    parser.add_argument("--version", action="version", version=f"turnstile {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO and show tracebacks of errors")
    parser.add_argument("--log-format", choices=["text", "json"], help="logs as text (default) or JSON lines")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="the configuration file (default: ./turnstile.toml when there is one); flags > env > file",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the seed's double-text scenario on the embedded log")
    demo.add_argument("--data", type=Path, default=None, help="keep the demo's log here (default: a temp folder)")

    run = sub.add_parser("run", help="run a worker: of your agent (MODULE:AGENT) or configured by these flags")
    run.add_argument(
        "agent",
        nargs="?",
        default=None,
        metavar="MODULE:AGENT",
        help="a turnstile.Agent to run, as uvicorn takes an app (e.g. examples.support_agent:agent): its models, "
        "prompt and tools are its own (the model flags are ignored, with a warning); budget, debounce, "
        "double-text and price flags override its settings",
    )
    _add_log_args(run)
    _add_run_args(run)
    send = sub.add_parser("send", help="publish a user message")
    _add_log_args(send)
    send.add_argument("--conversation", required=True, help="the conversation id (its partition key)")
    send.add_argument("--text", type=non_empty, required=True, help="the message; - reads it from stdin")
    send.add_argument("--message-id", default=None, help="idempotency key (default: a new id)")

    tail = sub.add_parser("tail", help="print the events of one or all conversations")
    _add_log_args(tail)
    tail.add_argument("--conversation", default=None, help="only this conversation's events (default: all)")

    topics = sub.add_parser(
        "topics",
        help="create the topics a deployment needs on the broker, those missing, with the engine's settings",
    )
    _add_log_args(topics)
    topics.add_argument(
        "--partitions", type=at_least(1, integer=True), default=8,
        help="partitions of the events topic and those co-partitioned with it (default 8)",
    )  # fmt: skip
    topics.add_argument(
        "--replication-factor", type=at_least(1, integer=True), default=1,
        help="replicas of each topic (default 1: one broker; give 3 on a production cluster)",
    )  # fmt: skip

    inspect = sub.add_parser("inspect", help="show a conversation: history, pending, active turn, turn timelines")
    _add_log_args(inspect)
    inspect.add_argument("conversation", help="the conversation id")
    json_help = "print the conversation and its turns' timelines as JSON (the HTTP API's shapes)"
    inspect.add_argument("--json", action="store_true", help=json_help)

    from turnstile.streams.operations_cli import add_parsers

    add_parsers(sub, _add_log_args)
    from turnstile.streams.console import export_cli

    export_cli.add_parser(sub, _add_log_args)
    audit_cli.add_parser(sub, _add_log_args)
    for command in sub.choices.values():  # the global flags work after the subcommand too
        same = "as before the command (turnstile --help)"
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=same)
        command.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS, help=same)
        command.add_argument("--config", type=Path, metavar="PATH", default=argparse.SUPPRESS, help=same)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in CONFIGURED:
            args.resolved = config_file.load(args.config, os.environ, args)
            args.log_format = args.resolved.config.log_format
    except CliError as refused:
        print(f"turnstile {args.command}: {refused}", file=sys.stderr)
        return refused.code
    log_format.configure(args.verbose, args.log_format or "text")
    limit_client_storms()  # (a broker away made aiokafka write thousands of lines a second)
    if args.command in CONFIGURED:
        for typo in config_file.unknown_variables(os.environ):
            log.warning("%s", typo)
    # The effective configuration and the flags an agent ignores are always said, -v or not.
    for name in ("turnstile.run", "turnstile.streams.serving"):
        logging.getLogger(name).setLevel(logging.INFO)
    if args.command == "demo":
        from turnstile.streams.demo import main as demo_main

        return demo_main(args.data)
    handler = {"run": _run, "send": _send, "tail": _tail, "inspect": _inspect, "audit": audit_cli.run,
               "topics": _topics, "approve": _operate, "deny": _operate, "resume": _operate,
               "export-turn": _export_turn}[args.command]  # fmt: skip

    async def checked() -> int:
        config: config_file.Config | None = getattr(args, "resolved", None) and args.resolved.config
        broker = config.broker if config is not None else getattr(args, "broker", None)
        if broker:
            from turnstile.streams.kafka_log import bootstrap_of

            patience = config.connect_timeout_s if config is not None and args.command == "run" else 0
            await _wait_for_broker(bootstrap_of(broker), patience)
            if config is not None and args.command != "topics":
                await _require_topics(bootstrap_of(broker), config, args.command)
        return await handler(args)

    try:
        return asyncio.run(checked())
    except KeyboardInterrupt:
        # Ctrl-C before run's own handler is installed (waiting for the broker, starting) or
        # in a command that has none (tail, audit): one line, the shell's code for SIGINT.
        print(f"turnstile {args.command}: interrupted", file=sys.stderr)
        return 130
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
