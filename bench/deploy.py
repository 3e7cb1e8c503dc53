"""9. A rolling deploy under load, against the same stream with no deploy.

The scenario is `tests/rolling_deploy.py` (two workers, each turn model -> side-effecting
`transfer` -> answer; worker 1 then worker 2 stopped and started again mid-stream). Three
runs in the same session: no deploy (the baseline), a deploy with drain and static
membership (`--instance-id`), a deploy with drain only (every stop rebalances the group),
worker 1 dying with no restart (the survivor takes its partitions after the session
timeout), and a third worker joining (scale-out: an eager rebalance of every partition).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.common import Section, fmt, percentile
from bench.kafka import Broker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the scenario is a test helper
from rolling_deploy import Figures, Shape, rolling_deploy

RUNS = (
    ("no deploy (baseline)", Shape(deploy="none")),
    ("deploy: drain + static membership", Shape(deploy="rolling", static=True)),
    ("deploy: drain, no instance id", Shape(deploy="rolling", static=False)),
    ("worker 1 dies (static member, 10 s session)", Shape(deploy="crash", static=True)),
    ("scale-out: a third worker joins", Shape(deploy="scale-out", static=True)),
)


async def deploy(broker: Broker) -> Section:
    shape = RUNS[0][1]
    section = Section(
        f"9. rolling deploy: {shape.messages} messages to {shape.conversations} conversations over {shape.over_s:g} s,"
        f" 2 workers, model {shape.model_s:g} s, side-effecting tool {shape.transfer_s:g} s",
        (
            "run",
            "answered",
            "turns failed",
            "attempts interrupted",
            "of them unmoved",
            "moved",
            "model steps re-asked",
            "dup outcome records",
            "side effects twice",
            "longest gap s",
            "p50 s",
            "p99 s",
            "takeover s",
        ),
    )
    for name, run_shape in RUNS:
        figures: Figures = await rolling_deploy(broker.bootstrap, await broker.fresh_topics("deploy"), run_shape)
        lat = figures.latencies_s or [0.0]
        section.add(
            name,
            f"{figures.answered}/{run_shape.messages}",
            str(figures.turns_failed),
            str(figures.attempts_interrupted),
            str(figures.attempts_interrupted_unmoved),
            str(figures.partitions_moved),
            str(figures.model_requests_repeated),
            str(figures.outcome_records_duplicated),
            str(figures.transfers_run_twice),
            fmt(figures.longest_silence_s),
            fmt(percentile(lat, 50)),
            fmt(percentile(lat, 99)),
            "" if figures.takeover_s is None else fmt(figures.takeover_s),
        )
    section.notes.append("publish -> outcome latency; the longest gap is between consecutive outcomes on any partition")
    section.notes.append(
        "unmoved: interrupted attempts on partitions no other worker (by name) was given during the deploy;"
        " moved: partitions that were"
    )
    section.notes.append(
        "takeover: from the death to the survivor owning every partition, replayed (goal: session timeout + 2 s);"
        " turns failed there had the side-effecting call in flight when the worker died"
    )
    return section
