"""When to send a failed model request again, and after how long: the official SDKs'
policy (openai-python and anthropic-sdk-python `_base_client.py`: `_should_retry`,
`_parse_retry_after_header`, `_calculate_retry_timeout`), as pure functions.

* Retried: no response (timeout, connection), 408, 409, 429 and every 5xx (529, Anthropic's
  "overloaded", included) -- unless the server's `x-should-retry: true|false` says
  otherwise, which always wins.
* The wait: the server's `retry-after-ms`, else `retry-after` (seconds, or an HTTP date),
  when positive and not above `max_retry_after_s`; otherwise exponential backoff from
  `initial_delay_s`, doubling per retry up to `max_delay_s`, minus up to 25% jitter.
* A server that asks for a longer wait than `max_retry_after_s` is not retried (as
  openai-python does past two minutes), nor is a wait that would pass the turn's
  deadline: the turn's time budget decides, and the failure says why.

Time and randomness come in as arguments (`now_s`, `jitter`), so a schedule is a pure
function of the failures and can be tested without waiting.
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Mapping
from dataclasses import dataclass

from turnstile.handlers.provider import ProviderError


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    # The SDKs' defaults; `max_retry_after_s` is openai-python's MAX_RETRY_AFTER_DELAY
    # (anthropic-sdk-python waits however long it is asked). The turn's deadline bounds it too.
    max_retries: int = 2
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    max_retry_after_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.initial_delay_s < 0 or self.max_delay_s < self.initial_delay_s:
            raise ValueError("need max_retries >= 0 and 0 <= initial_delay_s <= max_delay_s")
        if self.max_retry_after_s < 0:
            raise ValueError("max_retry_after_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Retry:
    delay_s: float


@dataclass(frozen=True, slots=True)
class GiveUp:
    """No retry now. `final`: a later attempt would not help either (the server said not
    to, or asked for a longer wait than allowed). `told`: the reason goes into the error
    (not for retries used up: the error says how many there were)."""

    reason: str
    final: bool
    told: bool = True


def retryable_status(status: int, headers: Mapping[str, str]) -> bool:
    """Whether an HTTP error answer may be retried. `headers` is case-insensitive (httpx)."""
    advice = headers.get("x-should-retry")
    if advice == "true":
        return True
    if advice == "false":
        return False
    return status in (408, 409, 429) or status >= 500


def retryable_break(headers: Mapping[str, str]) -> bool:
    """Whether a successful answer whose body broke off (a stream cut short) may be asked
    again: yes, unless the server said `x-should-retry: false` when it began answering."""
    return headers.get("x-should-retry") != "false"


def server_wait_s(headers: Mapping[str, str], now_s: float) -> float | None:
    """The wait the server asked for, in seconds: `retry-after-ms`, else `retry-after` as
    seconds or as an HTTP date (relative to `now_s`, Unix seconds). None if it asked none."""
    for header, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(header)
        if value is None:
            continue
        try:
            delay = float(value)
        except ValueError:
            continue
        if math.isnan(delay):
            continue
        return delay / divisor
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        parsed = email.utils.parsedate_tz(value)
        return None if parsed is None else float(email.utils.mktime_tz(parsed)) - now_s
    except (TypeError, ValueError, OverflowError):
        return None


def backoff_s(policy: RetryPolicy, retries_done: int, jitter: float) -> float:
    """Exponential backoff before retry number `retries_done + 1`; `jitter` in [0, 1)."""
    if not 0 <= jitter < 1:
        raise ValueError("jitter must be in [0, 1)")
    base = min(policy.initial_delay_s * 2.0 ** min(retries_done, 1000), policy.max_delay_s)
    return base * (1 - 0.25 * jitter)


def next_retry(
    policy: RetryPolicy, retries_done: int, error: ProviderError, jitter: float, time_left_s: float | None
) -> Retry | GiveUp:
    """Whether and when to send the request again after `error`, having retried it
    `retries_done` times already. `time_left_s`: time left before the turn's deadline."""
    if not error.retryable:
        return GiveUp("the error is not retryable", final=True)
    wait = error.retry_after_s
    if wait is not None and wait > policy.max_retry_after_s:
        return GiveUp(
            f"the provider asked to wait {wait:g} s, longer than the {policy.max_retry_after_s:g} s allowed",
            final=True,
        )
    if retries_done >= policy.max_retries:
        return GiveUp(f"{retries_done} retries used", final=False, told=False)
    delay = wait if wait is not None and wait > 0 else backoff_s(policy, retries_done, jitter)
    if time_left_s is not None and delay >= time_left_s:
        # Not final: the turn decides (it pauses on its deadline rather than fail).
        left = max(time_left_s, 0.0)
        return GiveUp(f"waiting {delay:g} s would pass the turn's deadline ({left:g} s left)", final=False)
    return Retry(delay)


def given_up(error: ProviderError, decision: GiveUp, retries: int) -> ProviderError:
    """The error as the turn sees it: whether a later attempt may help, and why not now."""
    if not error.retryable:
        return error
    note = f"after {retries} retries" if retries else "not retried"
    return ProviderError(
        error.kind,
        f"{error.message} ({note}: {decision.reason})" if decision.told else f"{error.message} ({note})",
        retryable=not decision.final,
        status=error.status,
        retry_after_s=error.retry_after_s,
        provider_message=error.provider_message,
        usage=error.usage,
    )
