"""One command for every benchmark: `python -m bench.run` from the repository root.

Prints one table per benchmark; every figure is set against a baseline measured in the
same run. `--only` / `--skip` pick sections by name (core, throughput, latency, replay,
faust, memory, stream, deploy, reads, recovery). `--profile` also runs the engine benchmark
under cProfile and prints where its CPU goes. The broker is the one `infra/kafka/start.sh`
runs (started if it is not up, never stopped); benchmarks use fresh topics of their own and delete them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import logging
import os
import platform
import pstats
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from bench import core, deploy, faust_vs_aiokafka, first_delta, http_reads, kafka, loop_hold, recovery, replay
from bench.common import Section
from turnstile.streams.kafka_reader import reachable

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent


def _ensure_broker(bootstrap: str) -> None:
    if reachable(bootstrap):
        return
    print(f"no broker at {bootstrap}: starting infra/kafka/start.sh", file=sys.stderr)
    subprocess.run(["bash", str(ROOT / "infra" / "kafka" / "start.sh")], check=True)


def _machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def _failed(title: str, exc: BaseException) -> Section:
    section = Section("", (title, "result"))
    section.add("FAILED", f"{type(exc).__name__}: {exc}")
    return section


SECTIONS = (
    "core", "throughput", "latency", "replay", "faust", "memory", "stream", "deploy", "reads", "loop", "recovery"
)
ON_BROKER = ("throughput", "latency", "replay", "faust", "deploy", "reads", "recovery")


async def _on_broker(bootstrap: str, wanted: set[str], args: argparse.Namespace) -> list[Section]:
    """Each benchmark that fails is reported as failed; the others still run."""
    broker = kafka.Broker(bootstrap)
    sections: list[Section] = []
    try:
        if "throughput" in wanted:
            sections.append(await _throughput(broker, args.what_if))
            print(sections[-1].render() + "\n", flush=True)
        if "latency" in wanted:
            sections.append(await _latency(broker))
            print(sections[-1].render() + "\n", flush=True)
        async def run(title: str, section: Awaitable[Section]) -> None:
            try:
                sections.append(await section)
            except Exception as exc:
                sections.append(_failed(title, exc))
            print(sections[-1].render() + "\n", flush=True)

        if args.profile:
            await run("profile of the engine run", _profiled_engine(broker))
        if "replay" in wanted:
            worker_pass = not args.no_replay_worker
            result = replay.replay(broker, args.replay_events, through_worker=worker_pass, what_if=args.what_if)
            await run("6. replay from offset 0", _then(result, replay.replay_section))
        if "stream" in wanted:
            await run("8. time to first delta", first_delta.first_delta(broker))
        if "deploy" in wanted:
            await run("9. rolling deploy", deploy.deploy(broker))
        if "recovery" in wanted:
            try:
                events, conversations, scale = args.recovery
                found = await recovery.recovery(broker, events, conversations, scale)
                sections += [recovery.recovery_section(found.scales), recovery.memory_section(found.memory)]
            except Exception as exc:
                sections.append(_failed("12-13. assignment -> live, resident memory", exc))
            for section in sections[-2:]:
                print(section.render() + "\n", flush=True)
        if "reads" in wanted:
            await run("10. HTTP GET latency", http_reads.http_reads(broker, args.reads_events))
        if "loop" in wanted:
            await run("11. event loop held during a replay", loop_hold.loop_hold(broker))
        if "faust" in wanted:
            try:
                found = await faust_vs_aiokafka.faust_vs_aiokafka(broker, profile_area=_area if args.profile else None)
            except Exception as exc:
                found = [_failed("7. faust vs aiokafka relay", exc)]
            sections += found
            for section in found:
                print(section.render() + "\n", flush=True)
        return sections
    finally:
        await broker.cleanup()


async def _then(result: Awaitable[T], render: Callable[[T], Section]) -> Section:
    return render(await result)


async def _throughput(broker: kafka.Broker, what_if: bool) -> Section:
    try:
        # Alternated, best of each: the machine and the broker are shared, so one slow
        # moment should not decide the ratio.
        relays, engines = [], []
        for _ in range(kafka.THROUGHPUT_ROUNDS):
            relays.append(await kafka.relay(broker))
            engines.append(await kafka.engine(broker))
        bigger = []
        for _ in range(kafka.THROUGHPUT_ROUNDS if what_if else 0):
            bigger.append(await kafka.engine(broker, producer_batch_bytes=1 << 20))
        return kafka.throughput_section(relays, engines, bigger)
    except Exception as exc:
        return _failed("2-3. broker throughput", exc)


async def _latency(broker: kafka.Broker) -> Section:
    try:
        raws, latencies = [], []
        for _ in range(kafka.LATENCY_ROUNDS):  # alternated; samples of all rounds pooled
            raws.append(await kafka.ping(broker))
            latencies.append(await kafka.latency(broker))
        return kafka.latency_section(latencies, raws)
    except Exception as exc:
        return _failed("5. turn-transition overhead", exc)


async def _profiled_engine(broker: kafka.Broker) -> Section:
    """The engine benchmark again, under cProfile from the first record to the last outcome:
    own time grouped by where the code lives, then the top functions."""
    profiler = cProfile.Profile()
    result = await kafka.engine(broker, profiler=profiler)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    by_area: dict[str, float] = {}
    for (filename, _line, name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():
        area = _area(filename, name)
        by_area[area] = by_area.get(area, 0.0) + own
    total = sum(by_area.values())
    section = Section("", ("profile of the engine window (cProfile)", "own time", "share"))
    for area, own in sorted(by_area.items(), key=lambda kv: -kv[1]):
        section.add(area, f"{own:.2f} s", f"{own / total:.0%}")
    section.notes.append(
        f"under the profiler: {result.records_per_s:,.0f} records/s; cProfile inflates code made of many small "
        "Python calls (asyncio, aiokafka) more than C code (pydantic-core, orjson)"
    )
    stats.sort_stats("tottime").print_stats(15)
    section.notes += ["top functions by own time:"] + [
        line.rstrip() for line in out.getvalue().splitlines() if line.strip() and "Ordered by" not in line
    ]
    return section


def _area(filename: str, name: str) -> str:
    if filename == "~":  # a builtin: name it by what it belongs to
        if "epoll" in name:
            return "idle: waiting in epoll (I/O)"
        if "pydantic_core" in name:
            return "pydantic-core (validation, dump)"
        if "orjson" in name:
            return "orjson"
        if "socket" in name:
            return "socket send/recv"
        return "other builtins"
    path = Path(filename).as_posix()
    for package, label in (
        ("/aiokafka/", "aiokafka (client)"),
        ("/faust/", "faust (streams, agents, topics, sensors)"),
        ("/mode/", "mode (faust's service framework)"),
        ("/asyncio/", "asyncio (event loop, tasks, futures)"),
        ("/pydantic/", "pydantic (python side)"),
    ):
        if package in path:
            return label
    for folder in ("events", "projections", "handlers", "streams", "bench"):
        if path.startswith(str(ROOT / folder)):
            return f"turnstile {folder}/"
    return "other python (stdlib: uuid, hashlib, copy, dataclasses...)"


def _names(value: str) -> set[str]:
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = names - set(SECTIONS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--bootstrap", default=os.environ.get("TURNSTILE_KAFKA", "127.0.0.1:9092"))
    parser.add_argument("--only", type=_names, default=None, help=f"run only these sections: {','.join(SECTIONS)}")
    parser.add_argument("--skip", type=_names, default=set(), help="skip these sections (comma-separated)")
    parser.add_argument("--no-kafka", action="store_true", help="only the pure-core benchmarks (core and memory)")
    parser.add_argument("--profile", action="store_true", help="also profile the engine run and the faust worker")
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="also run the engine with a bigger producer batch (1 MiB instead of aiokafka's 16 KiB) "
        "and the replay rebuild with the cyclic gc off",
    )
    parser.add_argument(
        "--replay-events", type=int, default=1_000_000, help="events on the replay topic (default 1,000,000)"
    )
    parser.add_argument(
        "--reads-events",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(10_000, 1_000_000),
        help="reads: the log sizes GETs are timed at (default 10000,1000000)",
    )
    parser.add_argument(
        "--recovery",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=(1_000_000, 100_000, 10),
        help="recovery: EVENTS,CONVERSATIONS,SCALE: the log, then SCALE times its history (1000000,100000,10)",
    )
    parser.add_argument("--no-replay-worker", action="store_true", help="replay: skip the pass through Worker._consume")
    args = parser.parse_args()
    wanted = (args.only if args.only is not None else set(SECTIONS)) - args.skip
    if args.no_kafka:
        wanted -= set(ON_BROKER)
    # Right after a topic is created the client may see NotLeader errors for a moment; it
    # retries them by itself. Each benchmark's verdict, read from the log, checks the result.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

    started = time.perf_counter()
    print(f"turnstile benchmarks - {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"machine: {_machine()}")
    print(f"sections: {', '.join(n for n in SECTIONS if n in wanted)}\n")
    if "core" in wanted:
        print(core.core_per_event().render() + "\n", flush=True)
    on_broker = wanted & set(ON_BROKER) or ({"stream", "loop"} & wanted and not args.no_kafka)
    if on_broker or args.profile:
        _ensure_broker(args.bootstrap)
        asyncio.run(_on_broker(args.bootstrap, wanted, args))
    if "stream" in wanted and args.no_kafka:
        print(asyncio.run(first_delta.first_delta(None)).render() + "\n", flush=True)
    if "loop" in wanted and args.no_kafka:
        print(asyncio.run(loop_hold.loop_hold(None)).render() + "\n", flush=True)
    if "memory" in wanted:
        print(core.memory_per_conversation().render() + "\n")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
