"""Issue #6 item 7: the relay of benchmark 2 through a faust-streaming agent, one worker
process. Run by `bench.faust_vs_aiokafka` as a subprocess (faust installs signal handlers, sets up
logging and owns its event loop, so it gets a process of its own):

    python -m bench.faust_relay --bootstrap H:P --app-id ID --source T --sink T --events N

The agent reads raw bytes (`value_serializer="raw"`), does what the aiokafka relay does per
record (`orjson.loads`, `orjson.dumps`, send to the sink keyed as the source), and after N
records waits for every send to be acknowledged (`producer.flush`), prints one line
`FAUST_RESULT {json}` and stops its own worker with SIGTERM, faust's ordinary shutdown.
Settings follow the relay's where faust has one: at_least_once, acks=all, linger 0,
1,000 records a poll; offsets are committed by faust's own committer (every
`broker_commit_every` records or `broker_commit_interval` seconds), not per batch.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import signal
import sys
import time
from typing import Any

import faust
import orjson


def build(args: argparse.Namespace) -> tuple[faust.App, dict[str, Any]]:
    app = faust.App(
        args.app_id,
        broker=f"kafka://{args.bootstrap}",
        value_serializer="raw",
        key_serializer="raw",
        processing_guarantee="at_least_once",
        topic_partitions=args.partitions,
        topic_allow_declare=False,  # the benchmark created both topics
        web_enabled=False,
        store="memory://",
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_linger=0.0,
        broker_max_poll_records=1000,
    )
    source = app.topic(args.source, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    sink = app.topic(args.sink, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    result: dict[str, Any] = {"count": 0}
    loads, dumps = orjson.loads, orjson.dumps
    profiler = cProfile.Profile() if args.profile else None

    @app.agent(source)
    async def relay(stream: faust.StreamT[bytes]) -> None:
        async for key, value in stream.items():
            if not result["count"]:
                # faust's loggers are left enabled for debug after the worker's logging setup:
                # every send would build (and drop) a LogRecord. Quiet, as a production worker.
                logging.getLogger("faust").setLevel(logging.WARNING)
                result["first"], result["cpu_first"] = time.perf_counter(), time.process_time()
                if profiler is not None:
                    profiler.enable()
            await sink.send(key=key, value=dumps(loads(value)))
            result["count"] += 1
            if result["count"] == args.events:
                await app.producer.flush()
                result["seconds"] = time.perf_counter() - result.pop("first")
                result["cpu_s"] = time.process_time() - result.pop("cpu_first")
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(args.profile)
                conf = app.conf
                result["settings"] = {
                    "producer_acks": conf.producer_acks,
                    "producer_linger_s": conf.producer_linger,
                    "producer_max_batch_size": conf.producer_max_batch_size,
                    "broker_max_poll_records": conf.broker_max_poll_records,
                    "broker_commit_every": conf.broker_commit_every,
                    "broker_commit_interval_s": conf.broker_commit_interval,
                    "stream_buffer_maxsize": conf.stream_buffer_maxsize,
                }
                print("FAUST_RESULT " + orjson.dumps(result).decode(), flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # faust's own shutdown path

    return app, result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.faust_relay")
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--app-id", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--sink", required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--profile", default=None, help="cProfile the measured window into this file")
    args = parser.parse_args()
    asyncio.set_event_loop(asyncio.new_event_loop())
    app, _ = build(args)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    worker = faust.Worker(app, loglevel="WARNING", quiet=True, redirect_stdouts=False)
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        sys.exit(exc.code)


if __name__ == "__main__":
    main()
