"""Freed memory goes back to the system when asked: after a burst of allocations (an
assignment decoding every snapshot, an eviction pass) the process does not stay at its peak."""

from __future__ import annotations

from pathlib import Path

from turnstile.streams.heap import release_freed_memory


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_after_a_burst_is_freed_the_resident_size_comes_back_down() -> None:
    # Given 200 MB of values too large for Python's small-object arenas (the C allocator's)
    burst = [bytes([i % 256]) * 2_000 for i in range(100_000)]
    keep = burst[::1000]  # a few survive, scattered, as states do, so the heap cannot just shrink
    peak = _rss_bytes()
    del burst
    freed = _rss_bytes()
    # When the freed memory is released
    assert release_freed_memory()  # glibc: malloc_trim
    # Then most of the burst leaves the resident set, which freeing alone did not do
    trimmed = _rss_bytes()
    assert peak - trimmed > 150 * 2**20, (peak, freed, trimmed)
    assert freed - trimmed > 100 * 2**20, (peak, freed, trimmed)
    assert len(keep) == 100
