"""A customer-support agent: it looks orders up (read-only) and sends e-mails (a side
effect a person approves first), on gpt-4.1-mini with gpt-4.1-nano as its fallback.

    export TURNSTILE_API_KEY=sk-...            # read when the agent is served
    turnstile run examples.support_agent:agent                 # embedded log in .turnstile
    turnstile run examples.support_agent:agent --broker kafka://127.0.0.1:9092
    turnstile send --conversation c1 --text "Where is order A-1001?"

TURNSTILE_BASE_URL points it at another OpenAI-compatible endpoint (a proxy, a local
server). An e-mail the model asks for waits for `turnstile approve c1 CALL_ID`.
"""

from __future__ import annotations

import os

from turnstile import Agent, DebouncePolicy, Model, ModelPrice, TurnBudget

ORDERS = {
    "A-1001": {"status": "shipped", "carrier": "DHL", "eta": "2026-12-05"},
    "A-1002": {"status": "processing", "carrier": None, "eta": None},
}
OUTBOX: list[dict[str, str]] = []  # stands in for your mail service

BASE_URL = os.environ.get("TURNSTILE_BASE_URL") or None  # empty: the provider's own

agent = Agent(
    "support",
    system_prompt=(
        "You are the support desk of an online shop. Look orders up before you answer about them; "
        "offer to e-mail the customer a summary, and never invent an order's status."
    ),
    # USD per million tokens: input, output, cached input, cache write (OpenAI bills none).
    model=Model("gpt-4.1-mini", base_url=BASE_URL, price=ModelPrice(0.40, 1.60, 0.10, 0.0)),
    fallbacks=[Model("gpt-4.1-nano", base_url=BASE_URL, price=ModelPrice(0.10, 0.40, 0.025, 0.0))],
    budget=TurnBudget(max_iterations=6, max_tool_calls=8, max_cost_usd=0.05, deadline_ms=60_000),
    debounce=DebouncePolicy(quiet_ms=800, max_wait_ms=3000),
    double_text="enqueue",
)


@agent.tool
def lookup_order(order_id: str) -> dict[str, str | None]:
    """The status, carrier and expected delivery date of one order.

    Args:
        order_id: the order number, e.g. A-1001
    """
    return ORDERS.get(order_id, {"status": "unknown order"})


@agent.tool(side_effect=True, needs_approval=True)
def send_email(to: str, subject: str, body: str) -> str:
    """Send an e-mail to the customer.

    Args:
        to: the recipient's address
        subject: the subject line
        body: the plain-text message
    """
    OUTBOX.append({"to": to, "subject": subject, "body": body})
    return f"sent to {to}"
