"""How a replay shares the event loop: folding awaits nothing real, and neither does a poll
with records at hand, so a replay would hold the loop (the HTTP port and its probes with
it) for as long as it lasts. The worker folds in slices of `YIELD_AFTER_S` and tells its
`ReplayHooks` when a replay starts, at each slice, and when it ends."""

from __future__ import annotations

import asyncio
from typing import Protocol

# The longest the consumer folds (or decides) without letting the rest of the loop run.
YIELD_AFTER_S = 0.02


class ReplayHooks(Protocol):
    """Told when the worker starts replaying (some assigned partition is not live yet),
    between slices of a replay (each time it lets the loop run), and when every assigned
    partition has turned live; e.g. `streams.worker_gc.WorkerGc`."""

    def replaying(self) -> None: ...

    def replay_slice(self) -> None: ...

    def replayed(self) -> None: ...


class ReplayPace:
    def __init__(self, hooks: ReplayHooks | None) -> None:
        self.hooks = hooks
        self.replaying = False
        self._held_since = 0.0  # loop time the consumer last let the loop run

    def note(self, replaying: bool) -> None:
        """Whether some assigned partition is still replaying; the hooks hear of changes."""
        if replaying == self.replaying:
            return
        self.replaying = replaying
        if self.hooks is not None:
            if replaying:
                self.hooks.replaying()
            else:
                self.hooks.replayed()

    async def let_the_loop_run(self, folding_a_replay: bool) -> None:
        """Past the budget, across steps, let the loop run once. `folding_a_replay`: what
        was folded since is a replay's (long-lived state), not live turns' (their garbage
        must stay collectable): only then is it a replay's slice for the hooks."""
        now = asyncio.get_running_loop().time()
        if now - self._held_since > YIELD_AFTER_S:
            if self.replaying and folding_a_replay and self.hooks is not None:
                self.hooks.replay_slice()
            await asyncio.sleep(0)
            self._held_since = asyncio.get_running_loop().time()
