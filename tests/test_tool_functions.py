"""Tools declared from typed Python functions: what the model is shown and what runs."""

from __future__ import annotations

import asyncio
import threading

import pytest
from pydantic import BaseModel, SecretStr

from turnstile.events import ToolCall
from turnstile.handlers.tool_functions import tool
from turnstile.handlers.tools import ToolRegistry, ValidCall, validate_call


class Address(BaseModel):
    city: str


def test_signature_and_docstring_become_the_schema_and_description() -> None:
    @tool(side_effect=True, needs_approval=True)
    def ship(order_id: str, address: Address, express: bool = False) -> str:
        """Ship an order to an address.

        More text the model is not shown.

        Args:
            order_id: the order number
            express: next-day delivery
        """
        return "ok"

    spec = ship.spec()
    assert (ship.name, ship.description, ship.kind, ship.needs_approval, ship.isolated_ok) == (
        "ship", "Ship an order to an address.", "side_effect", True, False
    )
    assert spec.parameters["required"] == ["order_id", "address"]
    assert spec.parameters["properties"]["order_id"]["description"] == "the order number"
    assert spec.parameters["properties"]["express"]["default"] is False
    assert spec.parameters["additionalProperties"] is False


def test_a_call_is_validated_against_the_signature_and_runs_sync_or_async() -> None:
    @tool
    def lookup(order_id: str, verbose: bool = False) -> dict[str, object]:
        """Look an order up."""
        return {"id": order_id, "verbose": verbose}

    @tool(name="greet")
    async def greet_async(who: str) -> str:
        """Greet someone."""
        return f"hello {who}"

    registry = ToolRegistry([lookup, greet_async])
    valid = validate_call(registry, ToolCall(call_id="c", name="lookup", arguments='{"order_id": "A-1"}'), False)
    assert isinstance(valid, ValidCall)
    assert asyncio.run(valid.tool.run(valid.arguments)) == '{"id":"A-1","verbose":false}'
    greeted = validate_call(registry, ToolCall(call_id="c", name="greet", arguments='{"who": "Ann"}'), False)
    assert isinstance(greeted, ValidCall) and asyncio.run(greeted.tool.run(greeted.arguments)) == "hello Ann"
    extra = validate_call(registry, ToolCall(call_id="c", name="lookup", arguments='{"order_id": "A", "x": 1}'), False)
    assert not isinstance(extra, ValidCall) and "x: Extra inputs are not permitted" in extra.detail


class Receipt:
    def __str__(self) -> str:
        return "receipt R-7"


@pytest.mark.parametrize(
    ("returned", "read"),
    [
        ("as it is", "as it is"),
        ({"id": "A-1", "n": 2}, '{"id":"A-1","n":2}'),
        ([1, None, True], "[1,null,true]"),
        (3.5, "3.5"),
        (Address(city="Oslo"), '{"city":"Oslo"}'),
        (Receipt(), "receipt R-7"),  # its str(), not a JSON string of it
        ({"receipt": Receipt()}, '{"receipt":"receipt R-7"}'),
        ({1: "a"}, '{"1":"a"}'),
        ({"n": 2**70}, "{'n': 1180591620717411303424}"),  # JSON cannot say it here: its str()
    ],
)
def test_what_a_tool_returns_is_read_back_by_the_model_as_text(returned: object, read: str) -> None:
    @tool
    def give() -> object:
        """Give it."""
        return returned

    valid = validate_call(ToolRegistry([give]), ToolCall(call_id="c", name="give", arguments="{}"), False)
    assert isinstance(valid, ValidCall) and asyncio.run(valid.tool.run(valid.arguments)) == read


def test_a_parameter_without_annotation_or_a_tool_without_description_is_refused() -> None:
    def untyped(order_id):  # type: ignore[no-untyped-def]
        """Look up."""

    with pytest.raises(TypeError, match="parameter 'order_id' has no type annotation"):
        tool(untyped)

    def undocumented(order_id: str) -> str:
        return order_id

    with pytest.raises(TypeError, match="'undocumented' needs a description"):
        tool(undocumented)


class Opaque:
    """No type pydantic can read from JSON."""


def test_a_parameter_type_json_cannot_carry_or_a_misnamed_docstring_arg_is_refused_naming_the_tool() -> None:
    # (pydantic's own error named neither the tool nor the parameter; a docstring typo left the
    # parameter undescribed to the model without a word)
    def lookup(order: Opaque) -> str:
        """Look up."""
        return ""

    with pytest.raises(TypeError, match=r"tool 'lookup': a parameter's type cannot be read .*\(order: Opaque\)"):
        tool(lookup)

    def refund(order_id: str) -> str:
        """Refund an order.

        Args:
            orderid: the order
        """
        return order_id

    with pytest.raises(TypeError, match=r"tool 'refund': its docstring's Args name \['orderid'\]"):
        tool(refund)

    def void(order_id: str) -> str:
        """Void an order.

        Args:
            order_id: the order's id, as printed on the receipt.
                Example: A-1234
        """
        return order_id

    assert tool(void).name == "void"  # a line deeper than the names continues one

def test_a_side_effect_is_declared_idempotent_with_its_key_or_with_a_reconciler() -> None:
    keys: list[str] = []

    @tool(side_effect=True, idempotent=True)
    async def transfer(to: str, amount: int, idempotency_key: str) -> str:
        """Send money."""
        keys.append(idempotency_key)
        return f"sent {amount} to {to}"

    # the model is shown the arguments, not the key; the engine passes the key on every run
    assert set(transfer.arguments.model_json_schema()["properties"]) == {"to", "amount"}
    assert (transfer.idempotent, transfer.recovery) == (True, "idempotent")
    call = ToolCall(call_id="c", name="transfer", arguments='{"to": "bob", "amount": 5}')
    valid = validate_call(ToolRegistry([transfer]), call, False)
    assert isinstance(valid, ValidCall)
    assert asyncio.run(valid.tool.run(valid.arguments, "turn-1:c")) == "sent 5 to bob" and keys == ["turn-1:c"]

    async def sent(call: ToolCall) -> str | None:
        return None

    @tool(side_effect=True, reconcile=sent)
    def refund(order_id: str) -> str:
        """Refund an order."""
        return "refunded"

    assert (refund.reconcile, refund.recovery) == (sent, "reconcile")


def test_idempotent_or_reconcile_without_a_side_effect_or_without_the_key_is_refused_when_declared() -> None:
    def send(to: str, idempotency_key: str) -> str:
        """Send."""
        return to

    def plain(to: str) -> str:
        """Send."""
        return to

    with pytest.raises(TypeError, match="settle a side effect: add side_effect=True"):
        tool(idempotent=True)(send)
    def positional(idempotency_key: str, /, to: str) -> str:
        """Send."""
        return to

    def sync_check(call: ToolCall) -> str | None:
        return None

    with pytest.raises(TypeError, match=r"an idempotent tool's function needs a \(keyword\) parameter idempotency_key"):
        tool(side_effect=True, idempotent=True)(plain)
    with pytest.raises(TypeError, match=r"an idempotent tool's function needs a \(keyword\) parameter idempotency_key"):
        tool(side_effect=True, idempotent=True)(positional)  # the engine passes it by name
    with pytest.raises(TypeError, match=r"only an idempotent=True tool takes a \(keyword\) parameter idempotency_key"):
        tool(side_effect=True)(send)
    with pytest.raises(TypeError, match="reconcile= is an async function"):
        tool(side_effect=True, reconcile=sync_check)(plain)  # type: ignore[arg-type]


def test_a_plain_function_runs_off_the_event_loop_so_other_turns_go_on() -> None:
    # Given a sync tool that waits for something only another task of the loop can do
    released = threading.Event()

    @tool
    def wait_for_release() -> str:
        """Wait."""
        if not released.wait(timeout=10):
            return "held the loop"
        return "released"

    async def main() -> str:
        async def release() -> None:
            released.set()

        call = asyncio.ensure_future(wait_for_release.run(wait_for_release.arguments()))
        await asyncio.sleep(0)  # the tool starts
        await release()  # ... and the loop is free to run this meanwhile
        return await asyncio.wait_for(call, 10)

    assert asyncio.run(main()) == "released"


def test_calls_that_hang_past_their_timeout_leave_other_plain_tools_their_threads() -> None:
    # Given 40 calls of a plain tool that hang (a dead socket, say) and each timed out
    released = threading.Event()

    @tool
    def hang() -> str:
        """Hang."""
        released.wait(timeout=30)
        return "late"

    @tool
    def echo(text: str) -> str:
        """Echo."""
        if threading.current_thread() is threading.main_thread():
            return "ran on the loop's thread"
        return text

    async def main() -> str:
        hung = [asyncio.ensure_future(hang.run(hang.arguments())) for _ in range(40)]
        done, _ = await asyncio.wait(hung, timeout=0.2)
        assert not done
        for call in hung:  # as the runner's timeout does
            call.cancel()
        # When another plain tool is called, then it runs at once (a pool of 32 threads, all
        # held by hung calls, left it none: it timed out too)
        return await asyncio.wait_for(echo.run(echo.arguments(text="still here")), 10)

    try:
        assert asyncio.run(main()) == "still here"
        # and the hung threads are daemons: they do not hold up the process's exit
        assert all(t.daemon for t in threading.enumerate() if t.name == "turnstile-tool")
    finally:
        released.set()


def test_a_plain_tool_that_exits_is_an_error_of_its_call_not_a_hang() -> None:
    # (a wrapped argparse or click command calls sys.exit: its thread died, the call waited
    # for its whole timeout)
    @tool
    def wrapped_cli() -> str:
        """Run a command."""
        raise SystemExit(2)

    async def main() -> None:
        await asyncio.wait_for(wrapped_cli.run(wrapped_cli.arguments()), 10)

    with pytest.raises(RuntimeError, match="the tool raised SystemExit: 2"):
        asyncio.run(main())


@pytest.mark.parametrize("name", ["résumé", "with space", "a.b", "x" * 65])
def test_a_tool_name_the_model_apis_refuse_is_refused_when_registered(name: str) -> None:
    @tool(name=name)
    def lookup() -> str:
        """Look up."""
        return ""

    with pytest.raises(ValueError, match="a name is 1-64 letters, digits, _ or -"):
        ToolRegistry([lookup])


def test_the_longest_name_the_apis_take_is_registered() -> None:
    @tool(name="x" * 64)
    def lookup() -> str:
        """Look up."""
        return ""

    assert len(ToolRegistry([lookup])) == 1


def test_a_tool_that_needs_approval_may_not_take_a_secret_argument() -> None:
    # an approval matches the call as the log keeps it, and the log keeps secrets redacted
    @tool(side_effect=True, needs_approval=True)
    def charge(card: SecretStr, amount: int) -> str:
        """Charge a card."""
        return "ok"

    with pytest.raises(ValueError, match="an approval could let a call with another secret run"):
        ToolRegistry([charge])
