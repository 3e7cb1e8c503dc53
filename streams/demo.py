"""`turnstile demo`: the seed's scenario, on the embedded log.

A user sends "check the dates"; while that turn's model call is still running, they add
"also compare the refund rules". The second message must stay pending, get its own turn
after the first outcome is on the log, and be answered once.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from turnstile.events import DecodeError, Event, MessageReceived, TurnClaimed, TurnCompleted, decode_record
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.file_log import FileLog
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.timeline import describe
from turnstile.streams.worker import Worker, WorkerConfig


async def run_demo(data_dir: Path | None = None, model_delay_s: float = 2.0, follow_up_after_s: float = 2.0) -> int:
    """On `data_dir` (kept: each run is a conversation of its own in it), or a temporary
    folder removed after."""
    if data_dir is not None:
        return await _demo(data_dir, model_delay_s, follow_up_after_s)
    with tempfile.TemporaryDirectory(prefix="turnstile-demo-") as directory:
        return await _demo(Path(directory), model_delay_s, follow_up_after_s)


async def _demo(directory: Path, model_delay_s: float, follow_up_after_s: float) -> int:
    log = FileLog(directory)
    clock = SystemClock()
    worker = Worker(log, ScriptedProvider(delay_s=model_delay_s), WorkerConfig(debounce=DebouncePolicy()), clock)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    start = clock.now_ms()
    # A run's own conversation: a kept folder's earlier runs are other conversations.
    conversation = f"demo-{start}"
    print(f"embedded log in {directory}, conversation {conversation}\n")
    await publish(log, message_event(conversation, "check the dates", clock.now_ms(), "msg-1"))
    await asyncio.sleep(follow_up_after_s)
    await publish(log, message_event(conversation, "also compare the refund rules", clock.now_ms(), "msg-2"))

    def answered() -> int:
        state = worker.states.get(conversation)
        return sum(len(t.input_ids) for t in state.turns.values()) if state else 0

    for _ in range(400):
        if answered() >= 2:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await running

    events = (decode_record(record.key, record.value) for record in log.read_all(log.topics.events))
    timeline = [e for e in events if not isinstance(e, DecodeError) and e.conversation_id == conversation]
    for event in timeline:
        print(f"+{(event.occurred_at - start) / 1000:6.2f}s  {describe(event)}")
    return _verdict(timeline)


def _verdict(events: list[Event]) -> int:
    sent = [e.message_id for e in events if isinstance(e, MessageReceived)]
    claims = [e for e in events if isinstance(e, TurnClaimed)]
    replies = [e for e in events if isinstance(e, TurnCompleted)]
    claimed = [i for c in claims for i in c.input_ids]
    ok = sorted(claimed) == sorted(sent) and len(claims) == 2 and len(replies) == 2
    print()
    for c in claims:
        print(f"turn {c.turn_id[:8]} claimed {list(c.input_ids)}")
    print(
        "\nOK: each message was claimed by exactly one turn and answered once; the follow-up waited "
        "for the first outcome."
        if ok
        else "\nUNEXPECTED: see the timeline above."
    )
    return 0 if ok else 1


def main(data_dir: Path | None = None) -> int:
    return asyncio.run(run_demo(data_dir))
