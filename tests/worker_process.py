"""A worker in its own process, for tests that must SIGKILL it.

As a script it builds a `Worker` over Kafka whose model is the loopback provider server
(OpenAI wire format) at `--base-url`, with two test tools:

* `search` (read-only) answers at once;
* `transfer` (side effect) appends one line to `<tool-dir>/transfer.count` -- so a test
  counts how often its body ran, across processes -- then waits until
  `<tool-dir>/release` exists (a tool that hangs until the test lets it go);
* `lookup` (read-only) counts its runs in `lookup.count` and waits for `release-lookup`;
* `transfer_once` (side effect, idempotent) writes the idempotency key it got to
  `idem.count` on every run and to `idem.effects` only the first time it sees that key
  (the effect an idempotent API applies once), then waits for `release`.

The API key comes from `TURNSTILE_API_KEY`, as in `turnstile run`. Logs go to stderr at
DEBUG for turnstile and the HTTP client, so a test can grep every line for the key.
SIGTERM stops the worker cleanly; SIGKILL is the crash under test.

In a test, `WorkerProcess` starts one with its output in a file and kills it by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the project packages live at the top level
    sys.path.insert(0, str(ROOT))

from loop_harness import Query, Transfer  # noqa: E402

from turnstile.handlers.claim import DebouncePolicy  # noqa: E402
from turnstile.handlers.pricing import ModelPrice  # noqa: E402
from turnstile.handlers.providers.openai_chat import OpenAIChat  # noqa: E402
from turnstile.handlers.tools import Tool, ToolRegistry  # noqa: E402
from turnstile.streams.kafka_log import KafkaLog  # noqa: E402
from turnstile.streams.log import Topics  # noqa: E402
from turnstile.streams.provider_http import HttpProvider  # noqa: E402
from turnstile.streams.turn_runner import TurnSettings  # noqa: E402
from turnstile.streams.worker import Worker, WorkerConfig  # noqa: E402

# What streams.worker logs when the group hands it partitions (aiokafka's own "Revoking
# previously assigned partitions" must not match).
ASSIGNED = "turnstile.streams.worker: assigned partitions"


def tools(tool_dir: Path) -> ToolRegistry:
    async def search(args: Query) -> str:
        return f"3 results for {args.q}"

    def count_run(args: Transfer) -> None:
        with open(tool_dir / "transfer.count", "a") as fh:
            fh.write(f"{os.getpid()} {args.to} {args.amount}\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def transfer(args: Transfer) -> str:
        count_run(args)  # the side effect: counted before the tool blocks
        await wait_for("release")
        return f"sent {args.amount} to {args.to}"

    async def wait_for(name: str) -> None:
        while not (tool_dir / name).exists():  # noqa: ASYNC110  (another process creates the file)
            await asyncio.sleep(0.05)

    def append(name: str, line: str) -> None:
        with open(tool_dir / name, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    async def lookup(args: Query) -> str:
        append("lookup.count", f"{os.getpid()} {args.q}")
        await wait_for("release-lookup")
        return f"notes on {args.q}"

    async def transfer_once(args: Transfer, key: str) -> str:
        append("idem.count", key)
        effects = tool_dir / "idem.effects"
        if not effects.exists() or key not in effects.read_text().split():
            append("idem.effects", key)
        await wait_for("release")
        return f"sent {args.amount} to {args.to}"

    return ToolRegistry(
        [
            Tool("search", "Search the notes.", Query, search, "read_only"),
            Tool("transfer", "Send money.", Transfer, transfer, "side_effect"),
            Tool("lookup", "Look up the notes.", Query, lookup, "read_only"),
            Tool("transfer_once", "Send money, idempotently.", Transfer, transfer_once, "side_effect", idempotent=True),
        ]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--outcomes", required=True)
    p.add_argument("--dlq", required=True)
    p.add_argument("--deltas", required=True)
    p.add_argument("--stream", action="store_true", help="stream replies to the deltas topic")
    p.add_argument("--base-url", required=True, help="the loopback provider server, OpenAI format")
    p.add_argument("--tool-dir", type=Path, required=True)
    p.add_argument("--model", default="gpt-test")
    p.add_argument("--quiet-ms", type=int, default=50)
    p.add_argument("--max-wait-ms", type=int, default=200)
    p.add_argument("--max-batch", type=int, default=20)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--provider-timeout", type=float, default=120.0)
    return p


async def _main(args: argparse.Namespace) -> None:
    provider = HttpProvider(
        OpenAIChat(), args.base_url, os.environ.get("TURNSTILE_API_KEY"), timeout_s=args.provider_timeout
    )
    turn = TurnSettings(
        model=args.model,
        tools=tools(args.tool_dir),
        max_attempts=args.max_attempts,
        backoff_base_ms=10,
        backoff_max_ms=50,
        prices={args.model: ModelPrice(input_per_mtok=1.0, output_per_mtok=2.0)},
    )
    config = WorkerConfig(
        debounce=DebouncePolicy(args.quiet_ms, args.max_wait_ms, args.max_batch),
        turn=turn,
        commit_interval_s=0.2,
        stream_replies=args.stream,
    )
    topics = Topics(args.events, args.outcomes, args.dlq, args.deltas)
    worker = Worker(KafkaLog(args.bootstrap, args.group, topics, client_id=f"worker-{os.getpid()}"), provider, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger(__name__).info("worker %s starting", os.getpid())
    try:
        await worker.run(stop)
    finally:
        await provider.aclose()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
    )
    for name in ("turnstile", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    asyncio.run(_main(args))


# -- the test side ---------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    """One worker process. Its stdout and stderr go to `log_path`; it is only ever
    signalled by its own pid."""

    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> WorkerProcess:
        out = open(self.log_path, "ab")  # noqa: SIM115  (the child holds it; closed below)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
            )
        finally:
            out.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def assigned(self) -> bool:
        return ASSIGNED in self.log_text()

    def kill(self) -> None:
        """The crash under test: SIGKILL, no cleanup of any kind in the worker."""
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """A clean stop (SIGTERM), then SIGKILL if it does not exit in time."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def worker_args(bootstrap: str, group: str, topics: Topics, base_url: str, tool_dir: Path, *extra: str) -> list[str]:
    return [
        "--bootstrap", bootstrap, "--group", group,
        "--events", topics.events, "--outcomes", topics.outcomes, "--dlq", topics.dead_letters,
        "--deltas", topics.deltas,
        "--base-url", base_url, "--tool-dir", str(tool_dir), *extra,
    ]  # fmt: skip


def worker_env(api_key: str) -> dict[str, str]:
    env = dict(os.environ)
    env["TURNSTILE_API_KEY"] = api_key
    env["PYTHONUNBUFFERED"] = "1"
    return env


if __name__ == "__main__":
    main()
