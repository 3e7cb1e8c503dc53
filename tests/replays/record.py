"""Re-records the histories the Replayer checks (tests/test_replays.py):

    .venv/bin/python tests/replays/record.py            # every scenario
    .venv/bin/python tests/replays/record.py resume     # one

Each scenario of tests/replay_scenarios.py runs through the real executor on the embedded
file log (a temporary directory) with a scripted model; its history -- the log before the
turn, then every step's observation, ids and commands -- is written to NAME.jsonl here.
Re-record only on purpose: a history that no longer replays means the engine would decide
differently on a turn recorded by the code before, i.e. on turns in flight at a deploy.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay_scenarios import REPLAYS, SCENARIOS, record


async def main(names: list[str]) -> None:
    for name in names or sorted(SCENARIOS):
        with tempfile.TemporaryDirectory() as tmp:
            lines = await record(SCENARIOS[name], Path(tmp))
        path = REPLAYS / f"{name}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(line, option=orjson.OPT_SORT_KEYS) + b"\n" for line in lines))
        last = next(c for line in reversed(lines) for c in reversed(line.get("commands", [])) if c["type"] == "Append")
        outcome = last["event"]
        print(f"{path.name}: {len(lines)} lines, ends with {outcome['type']} {outcome.get('reason', '')}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
