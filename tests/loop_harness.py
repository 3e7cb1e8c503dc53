"""Shared pieces of the turn-loop tests: tools with observable effects, settings, and
waiting for outcomes on the log."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from worker_harness import events_of, until

from turnstile.events import OUTCOME_TYPES, Event, InputInjected, ResumeRequested, encode
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.retry import RetryPolicy
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import EventLog
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.turn_runner import Route, TurnSettings
from turnstile.streams.worker import WorkerConfig

NOW = SystemClock().now_ms
PRICE = ModelPrice(input_per_mtok=1.0, output_per_mtok=2.0)
PRICES = {"gpt-test": PRICE, "gpt-backup": PRICE, "claude-test": PRICE}
# For tests of attempts, retries across attempts and fallback: the transport sends each
# request once, so a scripted failure reaches the turn loop (the transport's own retries
# are tested in test_provider_transport.py and by one turn-loop test).
ATTEMPTS_ONLY = RetryPolicy(max_retries=0)


class Query(BaseModel):
    model_config = ConfigDict(extra="forbid")
    q: str


class Transfer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str
    amount: int = Field(gt=0)


@dataclass
class World:
    """What the tools did: the side effects a test checks happened once, or never."""

    searches: list[str] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    block: asyncio.Event | None = None  # set: transfers wait on it (a tool that hangs)
    seen_started: list[bool] = field(default_factory=list)
    reconciled: list[str] = field(default_factory=list)  # calls a reconciler was asked about
    log: FileLog | None = None

    async def search(self, args: Query) -> str:
        self.searches.append(args.q)
        return f"3 results for {args.q}"

    async def transfer(self, args: Transfer) -> str:
        if self.log is not None:
            # The runner promises ToolCallStarted is on the log before the tool runs.
            self.seen_started.append(any(e.type == "ToolCallStarted" for e in events_of(self.log)))
        if self.block is not None:
            await self.block.wait()
        self.transfers.append(args)
        return f"sent {args.amount} to {args.to}"

    def registry(self, approval: bool = False) -> ToolRegistry:
        return ToolRegistry(
            [
                Tool("search", "Search the notes.", Query, self.search, "read_only", isolated_ok=True),
                Tool("transfer", "Send money.", Transfer, self.transfer, "side_effect", needs_approval=approval),
            ]
        )


def settings(
    world: World, *, approval: bool = False, fallbacks: Sequence[Route] = (), **overrides: Any
) -> TurnSettings:
    base: dict[str, Any] = {
        "model": "gpt-test",
        "prices": PRICES,
        "tools": world.registry(approval),
        "fallbacks": tuple(fallbacks),
        "backoff_base_ms": 10,
        "backoff_max_ms": 20,
        "budget": TurnBudget(),
    }
    base.update(overrides)
    return TurnSettings(**base)


def config(turn: TurnSettings) -> WorkerConfig:
    # drain_grace_s=0: a test's stop is a crash unless it tests the drain
    return WorkerConfig(
        debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200), turn=turn, commit_interval_s=0.05, drain_grace_s=0.0
    )


async def say(log: EventLog, text: str, message_id: str, conv: str = "c1") -> None:
    await publish(log, message_event(conv, text, NOW(), message_id))


async def inject(log: EventLog, event: InputInjected | ResumeRequested) -> None:
    await log.append(log.topics.events, event.conversation_id, encode(event))


def outcomes_of(log: FileLog, conv: str = "c1") -> list[Event]:
    return [e for e in events_of(log, conv) if isinstance(e, OUTCOME_TYPES)]


async def outcomes(log: FileLog, count: int, conv: str = "c1") -> list[Event]:
    await until(lambda: len(outcomes_of(log, conv)) >= count, 20)
    return outcomes_of(log, conv)


def of_type(events: Sequence[Event], name: str) -> list[Any]:
    return [e for e in events if e.type == name]
