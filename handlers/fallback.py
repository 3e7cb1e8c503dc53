"""The fallback chain: which model takes over when the current one fails mid-turn.

The next route takes the exact same transcript only when it speaks the same protocol
family; a model of another family would need a reconstructed transcript, which is never
done mid-turn (tool call ids, block structure and results do not translate faithfully).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from turnstile.handlers.provider import ProtocolFamily


@dataclass(frozen=True, slots=True)
class RouteInfo:
    model: str
    family: ProtocolFamily


@dataclass(frozen=True, slots=True)
class FallTo:
    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class NoFallback:
    reason: str


_FELL_BACK = re.compile(r" failed \((\w+)\); ")


def failure_of(reason: str) -> str | None:
    """The failure a `FallTo.reason` (a `FallbackEngaged` on the log) names, read back."""
    found = _FELL_BACK.search(reason)
    return found[1] if found else None


def next_route(routes: Sequence[RouteInfo], current: int, failure: str) -> FallTo | NoFallback:
    """The route after `current` in the chain, if it may take the transcript over."""
    if current + 1 >= len(routes):
        return NoFallback("no fallback model left")
    here, there = routes[current], routes[current + 1]
    if there.family != here.family:
        return NoFallback(
            f"fallback to {there.model} refused: it speaks the {there.family} protocol, not {here.family}, "
            "and a transcript is never reconstructed for another protocol family mid-turn"
        )
    return FallTo(current + 1, f"{here.model} failed ({failure}); {there.model} continues the same transcript")
