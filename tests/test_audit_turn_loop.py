"""The auditor on logs written by the real worker and turn loop (embedded log, loopback
provider server): tools, a retry, a side effect followed by a failure, a budget pause and
an exhausted turn all audit clean, held to the limits the worker ran with — so the
auditor's view of metrics and budgets agrees with the engine's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import pytest
from loop_harness import ATTEMPTS_ONLY, World, config, outcomes, say, settings
from provider_server import ProviderServer, Raw, Reply, Step
from worker_harness import running

from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.projections.audit import AuditLimits, AuditReport, audit, render
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running_server:
        yield running_server


@pytest.fixture
async def openai(server: ProviderServer) -> AsyncIterator[HttpProvider]:
    provider = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key", timeout_s=5.0, retry=ATTEMPTS_ONLY)
    yield provider
    await provider.aclose()


async def audited(
    server: ProviderServer, provider: HttpProvider, where: Path, script: Sequence[Step], budget: TurnBudget,
    **overrides: object,
) -> tuple[AuditReport, str]:  # fmt: skip
    log = FileLog(where)
    world = World(log=log)
    server.push(*script)
    async with running(log, provider, config(settings(world, budget=budget, **overrides))):
        await say(log, "pay bob 5 and confirm", "m1")
        [outcome] = await outcomes(log, 1)
    limits = AuditLimits(budget.max_iterations, budget.max_tool_calls, budget.max_cost_usd)
    report = audit(log.read_all(Topics().events), limits, strict=True)
    assert report.ok, render(report)
    assert report.rule("budgets").checked > 1  # the outcome's metrics and each limit
    return report, outcome.type


async def test_turn_loop_logs_audit_clean(server: ProviderServer, openai: HttpProvider, tmp_path: Path) -> None:
    search = ("call_1", "search", '{"q": "fees"}')
    transfer = ("call_2", "transfer", '{"to": "bob", "amount": 5}')
    roomy = TurnBudget()

    report, kind = await audited(server, openai, tmp_path / "tools", [Reply(tool_calls=[search]), Reply(text="Paid.")],
                                 roomy)  # fmt: skip
    assert kind == "TurnCompleted"

    report, kind = await audited(server, openai, tmp_path / "retry", [Raw(503, b"down"), Reply(text="ok")], roomy,
                                 max_attempts=2)  # fmt: skip
    assert kind == "TurnCompleted" and report.rule("attempts").checked == 2
    assert report.rule("no_replay_after_side_effect").checked == 2  # the failure and the retry

    report, kind = await audited(server, openai, tmp_path / "side-effect",
                                 [Reply(tool_calls=[transfer]), Raw(503, b"down")], roomy, max_attempts=3)  # fmt: skip
    assert kind == "TurnFailed" and report.rule("attempts").checked == 1  # never replayed

    report, kind = await audited(server, openai, tmp_path / "pause",
                                 [Reply(tool_calls=[search]), Reply(tool_calls=[("call_3", "search", '{"q": "b"}')])],
                                 TurnBudget(max_tool_calls=1))  # fmt: skip
    assert kind == "TurnPaused"

    report, kind = await audited(server, openai, tmp_path / "exhausted", [Reply(tool_calls=[search])],
                                 TurnBudget(max_iterations=1))  # fmt: skip
    assert kind == "TurnExhausted"
