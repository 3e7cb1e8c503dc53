"""Issue #6 item 7: faust vs aiokafka on the hot path. The relay of benchmark 2 (the same
20,000 serialized `MessageReceived` of 2,000 conversations on 8 partitions, read, decoded,
encoded, produced to another topic) once through the raw aiokafka relay (`bench.kafka.relay`)
and once through a faust-streaming agent in a worker process of its own
(`bench/faust_relay.py`), alternated, each on fresh topics. The engine itself does not use
faust (`streams/kafka_log.py` is aiokafka); this measures what moving the hot path onto a
faust agent would cost or gain.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.common import Section
from bench.kafka import PARTITIONS, RUN_ID, Broker, RelayResult, _messages, _seed, relay

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 2


@dataclass(frozen=True)
class FaustResult:
    events: int
    seconds: float  # first record seen by the agent -> last send acknowledged
    cpu_s: float  # the faust process's CPU over the same window
    process_s: float  # the whole subprocess: start, join the group, relay, stop
    settings: dict[str, Any]
    profile: pstats.Stats | None = None

    @property
    def per_s(self) -> float:
        return self.events / self.seconds


def available() -> str | None:
    """None if faust can run here, else why not."""
    try:
        import faust  # noqa: F401
    except Exception as exc:
        return f"faust-streaming is not importable ({type(exc).__name__}: {exc}); pip install -e '.[bench]'"
    return None


async def faust_relay(
    broker: Broker, events: int = 20_000, conversations: int = 2_000, timeout_s: float = 120, profile: bool = False
) -> FaustResult:
    topics = await broker.fresh_topics("faust")
    await _seed(broker.bootstrap, topics.events, _messages(conversations, events // conversations))
    app_id = f"bench-{RUN_ID}-faust-{len(broker.created)}"
    profile_path = Path(tempfile.mkdtemp(prefix="bench-faust-")) / "window.prof" if profile else None
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.faust_relay",
        "--bootstrap",
        broker.bootstrap,
        "--app-id",
        app_id,
        "--source",
        topics.events,
        "--sink",
        topics.outcomes,
        "--events",
        str(events),
        "--partitions",
        str(PARTITIONS),
        *(["--profile", str(profile_path)] if profile_path else []),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()  # the process this function started, by its own handle
        await process.wait()
        raise TimeoutError(f"the faust worker did not relay {events:,} records in {timeout_s:.0f} s") from None
    process_s = time.perf_counter() - started
    # the line may follow terminal escapes of faust's spinner
    lines = [line.split("FAUST_RESULT ", 1)[1] for line in out.decode().splitlines() if "FAUST_RESULT " in line]
    if not lines:
        tail = " | ".join(err.decode(errors="replace").strip().splitlines()[-5:])
        raise RuntimeError(f"the faust worker exited {process.returncode} without a result: {tail}")
    result = orjson.loads(lines[-1])
    stats = None
    if profile_path is not None and profile_path.exists():
        stats = pstats.Stats(str(profile_path), stream=io.StringIO())
        profile_path.unlink()
        profile_path.parent.rmdir()
    return FaustResult(result["count"], result["seconds"], result["cpu_s"], process_s, result["settings"], stats)


def faust_section(relays: list[RelayResult], fausts: list[FaustResult]) -> Section:
    relay_ = max(relays, key=lambda r: r.records_per_s)
    faust_ = max(fausts, key=lambda f: f.per_s)
    relay_per_s = relay_.events / relay_.seconds
    section = Section("", ("7. faust vs aiokafka relay (issue item 7)", "value", "baseline (aiokafka relay)", "ratio"))
    section.add("events relayed/s (read+decode+encode+produce)", f"{faust_.per_s:,.0f}/s", f"{relay_per_s:,.0f}/s")
    section.rows[-1] = (*section.rows[-1][:3], f"{faust_.per_s / relay_per_s:.2f}")
    section.add(
        "process CPU / wall time in the measured window",
        f"{faust_.cpu_s / faust_.seconds:.0%} (faust)",
        f"{relay_.cpu_s / relay_.seconds:.0%} (relay)",
    )
    faust_cpu_us, relay_cpu_us = faust_.cpu_s / faust_.events * 1e6, relay_.cpu_s / relay_.events * 1e6
    section.add(
        "CPU µs per event relayed",
        f"{faust_cpu_us:.0f} µs",
        f"{relay_cpu_us:.0f} µs",
        f"{faust_cpu_us / relay_cpu_us:.1f}x",
    )
    section.add("faust worker process, start to exit", f"{faust_.process_s:.1f} s")
    section.notes.append(
        f"{faust_.events:,} MessageReceived (2,000 conversations) on {PARTITIONS} partitions each; faust: one worker "
        "process, one agent (concurrency 1), value_serializer raw, at_least_once; window from the first record the "
        "agent sees to the last send acknowledged (producer.flush); relay: first record read to the last commit"
    )
    settings = faust_.settings
    section.notes.append(
        f"faust settings: acks {settings['producer_acks']}, linger {settings['producer_linger_s']} s, "
        f"max batch {settings['producer_max_batch_size']:,} B, {settings['broker_max_poll_records']} records a poll, "
        f"offsets committed every {settings['broker_commit_every']:,} records or "
        f"{settings['broker_commit_interval_s']} s (the relay commits each batch, idempotent producer)"
    )
    section.notes.append(
        f"best of {len(fausts)} alternated rounds; events/s: relay "
        + ", ".join(f"{r.events / r.seconds:,.0f}" for r in relays)
        + "; faust "
        + ", ".join(f"{f.per_s:,.0f}" for f in fausts)
    )
    return section


def profile_section(result: FaustResult, area: Callable[[str, str], str]) -> Section:
    """Own time of the faust worker's measured window, grouped by `area(filename, name)`."""
    assert result.profile is not None
    stats = result.profile
    by_area: dict[str, float] = {}
    for (filename, _line, name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = area(filename, name)
        by_area[key] = by_area.get(key, 0.0) + own
    total = sum(by_area.values())
    section = Section("", ("profile of the faust worker's window (cProfile)", "own time", "share"))
    for key, own in sorted(by_area.items(), key=lambda kv: -kv[1]):
        section.add(key, f"{own:.2f} s", f"{own / total:.0%}")
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(12)
    section.notes.append(f"under the profiler: {result.per_s:,.0f} events/s; top functions by own time:")
    section.notes += [
        line.rstrip()
        for line in out.getvalue().splitlines()
        if line.strip() and "Ordered by" not in line and ".prof" not in line
    ]
    return section


async def faust_vs_aiokafka(
    broker: Broker, rounds: int = ROUNDS, profile_area: Callable[[str, str], str] | None = None
) -> list[Section]:
    """The comparison, and with `profile_area` one more faust run under cProfile."""
    why_not = available()
    if why_not is not None:
        section = Section("", ("7. faust vs aiokafka relay (issue item 7)", "result"))
        section.add("not run", why_not)
        return [section]
    relays, fausts = [], []
    for _ in range(rounds):
        relays.append(await relay(broker))
        fausts.append(await faust_relay(broker))
    sections = [faust_section(relays, fausts)]
    if profile_area is not None:
        sections.append(profile_section(await faust_relay(broker, profile=True), profile_area))
    return sections
