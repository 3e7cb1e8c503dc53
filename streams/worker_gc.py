"""The cyclic garbage collector under a worker, replaying and live: a process-wide setting,
so it is installed by the process entry (`turnstile run`), never by the worker itself.

Replaying: a replay builds long-lived state (the conversations of every assigned partition)
and the fold makes no reference cycles, yet the collector rescans the growing heap again and
again (bench section 6: ≈ 30% of a rebuild's wall time). While any partition replays, the
young-generation threshold is raised so collections are rare, and what has been replayed is
frozen at every slice of the replay (`gc.freeze`: moved out of every future collection;
memory is still freed by reference counting when a conversation is dropped): a collection
then scans only what the last slice made, so none holds the event loop for long (a
generation-1 collection over a replay's million young objects took 0.1-0.35 s).

Live: every turn in flight holds a task, its coroutines and futures, so under CPython's
default (a young collection every 700 net allocations) a busy worker spends about a sixth
of its CPU in the collector (bench sections 2-3: ≈ 500 collections in a window of 2,000
turns; 41-42 µs of CPU per record against 34-35 µs at 20,000). The live phase collects
every `live_gen0_threshold` allocations instead; the garbage that waits is cycles the next
collection frees, a few MB at most.
"""

from __future__ import annotations

import gc

# Young-generation allocations between collections while replaying (CPython's default: 700).
REPLAY_GEN0_THRESHOLD = 20_000
# ... and once every assigned partition is live.
LIVE_GEN0_THRESHOLD = 20_000


class WorkerGc:
    """Replay hooks for `Worker(replay_hooks=...)`."""

    def __init__(
        self, gen0_threshold: int = REPLAY_GEN0_THRESHOLD, live_gen0_threshold: int = LIVE_GEN0_THRESHOLD
    ) -> None:
        self.gen0_threshold = gen0_threshold
        self.live_gen0_threshold = live_gen0_threshold

    def replaying(self) -> None:
        """Some assigned partition is replaying."""
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(self.gen0_threshold, gen1, gen2)

    def replay_slice(self) -> None:
        """Between slices of the replay: what is folded so far is long-lived."""
        gc.freeze()

    def replayed(self) -> None:
        """Every assigned partition is live: what was replayed is long-lived from here on."""
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(self.live_gen0_threshold, gen1, gen2)
        # The young generations first, so the replay's recent garbage cycles (if any: the fold
        # makes none) are not frozen for good. Not a full collection: that would rescan all of
        # the replayed state once more (≈ 0.5 s after 1,000,000 events) just as it goes live.
        gc.collect(1)
        gc.freeze()
