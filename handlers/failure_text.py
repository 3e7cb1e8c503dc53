"""The sentence a user reads when the model provider could not produce a reply: what went
wrong, in one sentence, and what the engine did about it. Pure: from the error alone.

The provider's own message is quoted only for a rejected request (it says what was
wrong with it); the transport has already removed the API key from it.
"""

from __future__ import annotations

from turnstile.handlers.provider import ProviderError

SIDE_EFFECT_NOTE = (
    " A tool with side effects had already run, so the turn was not retried automatically:"
    " check the operation record before continuing."
)


def provider_failure(error: ProviderError, *, attempts: int, side_effect_ran: bool) -> str:
    """`attempts`: how many attempts of the turn were made; said when each one failed alike."""
    tried = f" on all {attempts} attempts" if error.retryable and attempts > 1 else ""
    http = f" (HTTP {error.status})" if error.status is not None else ""
    match error.kind:
        case "authentication":
            sentence = f"The model provider refused the credentials{http}: check the API key."
        case "bad_request":
            said = error.provider_message or "it gave no reason"
            sentence = f"The model provider rejected the request{http}: {said.rstrip('.')}."
            if error.status == 404:  # no such path or model: said by the provider, mended by config
                sentence += (
                    " Check the model's name and base_url (an OpenAI-compatible one ends in /v1; an Anthropic"
                    " one does not: its requests go to {base_url}/v1/messages)."
                )
        case "rate_limited" if error.retry_after_s is not None and not error.retryable:
            sentence = (
                f"The model provider is rate limiting requests and asked to wait {error.retry_after_s:g} s, "
                "longer than this turn may wait."
            )
        case "rate_limited":
            sentence = f"The model provider kept rate limiting requests{http}{tried}."
        case "overloaded":
            sentence = f"The model provider was overloaded{http}{tried}."
        case "server_error":
            sentence = f"The model provider failed{http}{tried}."
        case "timeout":
            sentence = f"The model provider did not answer in time{tried}."
        case "connection":
            sentence = f"The model provider could not be reached{tried}."
        case "malformed_response":
            sentence = f"The model provider sent a reply that could not be used: {error.message.rstrip('.')}."
    return sentence + (SIDE_EFFECT_NOTE if side_effect_ran else "")


# What a user reads when a turn cannot go on after its worker stopped, or the engine broke.
NOT_REPLAYED = (
    "A tool with side effects started before the worker stopped; the turn was not "
    "replayed. Check the operation record before continuing."
)
MAX_ATTEMPTS = "The turn failed after the maximum number of attempts."


def stopped_too_often(stops: int) -> str:
    return (
        f"The turn failed: the worker running it stopped mid-attempt {stops} times (a turn that "
        "takes its worker down each time is not taken over again)."
    )


def failed_by_owner(reason: str, side_effect_ran: bool) -> str:
    """A turn whose worker failed its attempt for good and stopped before saying so: the
    next owner says it, with the attempt's recorded reason."""
    return f"The turn's attempt failed and was not retried: {reason.rstrip('.')}." + (
        SIDE_EFFECT_NOTE if side_effect_ran else ""
    )


INTERNAL_ERROR = "The turn failed because of an internal error."


def too_large_to_record(what: str, event: str, size: int, limit: int, spent: str) -> str:
    """`what`: the model's reply or a tool's result; `spent`: what a reply that could not be
    recorded cost, or ""."""
    return (
        f"{what} is too large to record{spent}: as {event} it is {size:,} bytes, over the "
        f"{limit:,} the events topic takes (at most about 1 MiB, a producer request). Ask for a shorter answer."
    )


def unresumable(tool: str, call_id: str) -> str:
    return (
        f"A tool with side effects ({tool}, call {call_id}) started before the worker "
        "stopped and cannot be run again safely; the turn was not resumed. Check the operation record "
        "before continuing."
    )


def reconcile_unknown(tool: str, call_id: str) -> str:
    return (
        f"A tool with side effects ({tool}, call {call_id}) started before the worker stopped "
        "and its reconciler could not tell whether it ran. Check the operation record before continuing."
    )
