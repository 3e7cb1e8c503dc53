"""Another consumer group already running the turns of this worker's events topic.

Each consumer group reads every partition of the topics it subscribes to: a second group of
workers on the same events topic (a typo'd `--group`, two agents started on one broker with
the default topics) runs every turn a second time. The claims fence the side effects -- the
log keeps the first claim, and a side-effecting tool runs only once its start is read back
as accepted -- but every model call is made twice over, and the two groups take each
other's turns over until they give up (an outside run: 129 model requests for 30 messages,
2 turns failed). Nothing in Kafka refuses it, so the worker looks at start and says so.

Which groups count: those with a live member subscribed to the events topic, other than the
worker's own. A consumer of the events topic of a service's own (an analytics job) counts
too -- the check cannot tell it from workers -- so it is a warning, never a refusal. Only
the group that starts later is told (the other is not restarting); a group that is
rebalancing at that moment has its members' topics described again, and what could not be
read is said, not passed over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.errors import for_code
from aiokafka.protocol.admin import (
    DescribeGroupsRequest,
    DescribeGroupsRequest_v1,
    DescribeGroupsRequest_v2,
    ListGroupsRequest,
)
from aiokafka.protocol.struct import Struct

from turnstile.projections.inert import printable

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 10.0  # a slow or refusing admin API must not hold up a start


@dataclass(frozen=True, slots=True)
class GroupMember:
    host: str
    topics: frozenset[str]  # subscribed to or assigned partitions of


@dataclass(frozen=True, slots=True)
class ConsumerGroup:
    group_id: str
    state: str
    members: tuple[GroupMember, ...]


def groups_beside(groups: Iterable[ConsumerGroup], topic: str, own_group: str) -> list[ConsumerGroup]:
    """The groups other than `own_group` with a live member reading `topic`, by name."""
    found = [g for g in groups if g.group_id != own_group and any(topic in m.topics for m in g.members)]
    return sorted(found, key=lambda g: g.group_id)


def unread_groups(groups: Iterable[ConsumerGroup], own_group: str) -> list[ConsumerGroup]:
    """Groups whose members' topics were not given: Kafka describes a group's members with
    their subscriptions only while it is Stable, so one that is rebalancing (another set of
    workers starting at the same moment, or restarting) may read any topic."""
    found = [
        g for g in groups
        if g.group_id != own_group and g.members and g.state != "Stable" and not any(m.topics for m in g.members)
    ]  # fmt: skip
    return sorted(found, key=lambda g: g.group_id)


def beside_warning(
    beside: Sequence[ConsumerGroup], topic: str, own_group: str, own: ConsumerGroup | None = None
) -> str:
    """What the operator reads: who else reads the topic, what that does, and what to do.
    `own`: the worker's own group as described, when it has members already -- then which
    group is the wrong one cannot be told from here, and joining the other is no advice."""
    named = "; ".join(f"'{printable(g.group_id)}' ({_members(g, topic)})" for g in beside)
    harm = "both groups run every turn (each model call twice, each group taking the other's turns over)"
    stopped = "a stopped static member leaves its group when its session times out"
    yours = "A consumer of your own on the events topic is no harm."
    if own is not None and any(topic in m.topics for m in own.members):
        return (
            f"consumer group '{printable(own_group)}' ({_members(own, topic)}) reads {topic}, and so does "
            f"another group: {named}. If those are turnstile workers, {harm}: one of the groups is misconfigured; "
            f"stop the workers of the one that should not be there ({stopped}). {yours}"
        )
    return (
        f"consumer group '{printable(own_group)}' is starting on {topic}, which another group already reads: "
        f"{named}. If those are turnstile workers, {harm}: give this worker their group (--group, or `group` "
        f"in turnstile.toml), or stop theirs first ({stopped}). {yours}"
    )


def _members(group: ConsumerGroup, topic: str) -> str:
    reading = [m for m in group.members if topic in m.topics]
    hosts = sorted({printable(m.host.removeprefix("/")) for m in reading})  # Kafka's "/10.0.0.7"
    shown = ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")
    return f"{len(reading)} member{'s' if len(reading) != 1 else ''} on {shown}"


@dataclass(frozen=True, slots=True)
class Survey:
    """The cluster's consumer groups as the admin API gave them, and what it refused."""

    groups: list[ConsumerGroup]
    problems: list[str]  # e.g. "group 'billing': GroupAuthorizationFailedError" (no describe rights)


async def warn_of_groups_beside(
    bootstrap: str,
    topic: str,
    own_group: str,
    survey: Callable[[str, str], Awaitable[Survey]] | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> list[ConsumerGroup]:
    """Logs `beside_warning` if other groups read `topic`; the groups found. What could not
    be checked -- an admin API that fails, times out or is refused (no describe rights), a
    group that stayed rebalancing -- is said in one warning, never passed over in silence."""
    try:
        async with asyncio.timeout(timeout_s):
            seen = await (survey or survey_groups)(bootstrap, own_group)
    except Exception as exc:
        log.warning("could not check whether another consumer group reads %s: %r", topic, exc)
        return []
    beside = groups_beside(seen.groups, topic, own_group)
    if beside:
        own = next((g for g in seen.groups if g.group_id == own_group), None)
        log.warning("%s", beside_warning(beside, topic, own_group, own))
    unread = [f"group '{printable(g.group_id)}' stayed {g.state} (what it reads is not given)"
              for g in unread_groups(seen.groups, own_group)]  # fmt: skip
    if seen.problems or unread:
        log.warning("could not check whether every other consumer group reads %s: %s", topic,
                    "; ".join(seen.problems + unread))  # fmt: skip
    return beside


async def survey_groups(bootstrap: str, own_group: str, rounds: int = 3, pause_s: float = 1.0) -> Survey:
    """Every consumer group of the cluster with its live members: each broker, all at once,
    lists the groups it coordinates (ListGroups) and describes them (DescribeGroups), two
    requests a broker however many groups there are; a group that was rebalancing is
    described again, `rounds` times at most, `pause_s` apart."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    try:
        await client.bootstrap()
        nodes = [broker.nodeId for broker in client.cluster.brokers()]
        found = await asyncio.gather(*(_listed_and_described(client, node) for node in nodes))
        coordinators = {g.group_id: node for node, (groups, _) in zip(nodes, found, strict=True) for g in groups}
        groups = {g.group_id: g for listed, _ in found for g in listed}
        problems = [problem for _, listed in found for problem in listed]
        for _ in range(rounds):
            unread = unread_groups(groups.values(), own_group)
            if not unread:
                break
            await asyncio.sleep(pause_s)
            for group in unread:
                again, more = described_groups(await _describe(client, coordinators[group.group_id], [group.group_id]))
                groups.update((g.group_id, g) for g in again)
                problems += more
        return Survey(list(groups.values()), problems)
    finally:
        await client.close()


async def _listed_and_described(client: AIOKafkaClient, node: int) -> tuple[list[ConsumerGroup], list[str]]:
    listed = await client.send(node, ListGroupsRequest())
    if listed.error_code:
        return [], [f"ListGroups on broker {node}: {_error(listed.error_code)}"]
    ids = [group for group, protocol_type, *_ in listed.groups if protocol_type == "consumer"]
    return described_groups(await _describe(client, node, ids)) if ids else ([], [])


async def _describe(client: AIOKafkaClient, node: int, group_ids: list[str]) -> dict[str, Any]:
    response = await client.send(node, _DescribeGroups(group_ids))
    described: dict[str, Any] = response.to_object()
    return described


def described_groups(response: dict[str, Any]) -> tuple[list[ConsumerGroup], list[str]]:
    """A DescribeGroups answer (as `to_object` gives it): the groups it describes, and a
    problem for each it refused (the per-group error code: no rights, coordinator loading)."""
    groups, problems = [], []
    for described in response["groups"]:
        if described["error_code"]:
            problems.append(f"group '{printable(described['group'])}': {_error(described['error_code'])}")
            continue
        members = tuple(
            GroupMember(m["client_host"], _topics(m["member_metadata"], m["member_assignment"]))
            for m in described["members"]
        )
        groups.append(ConsumerGroup(described["group"], described["state"], members))
    return groups, problems


def _error(code: int) -> str:
    return f"{for_code(code).__name__} (error {code})"


class _DescribeGroups(DescribeGroupsRequest):  # type: ignore[misc]  # aiokafka.protocol is untyped
    """DescribeGroups at v1-v2: aiokafka 0.14 reads a v3 answer with the v2 schema (its
    `DescribeGroupsRequest_v3.RESPONSE_TYPE`), which the answer of a Kafka 4 broker underruns,
    dropping the connection. Brokers since Kafka 2.0 answer v2 (KIP-219), since 0.11 v1; 4.x
    answers both."""


# Set after the class body: `Request.__init_subclass__` derives `_CLASSES` from the generic
# base (v0-v3) and would overwrite it there.
_DescribeGroups._CLASSES = (DescribeGroupsRequest_v1, DescribeGroupsRequest_v2)


def _topics(metadata: bytes, assignment: bytes) -> frozenset[str]:
    """The topics a member subscribed to (its join's metadata) and was assigned. Both are
    the consumer protocol's: later versions only add fields after these, and a member of
    another protocol (Connect, a group of the new KIP-848 kind) has none we can read."""
    subscribed = _decoded(ConsumerProtocolMemberMetadata, metadata)
    assigned = _decoded(ConsumerProtocolMemberAssignment, assignment)
    topics = set(subscribed.subscription) if isinstance(subscribed, ConsumerProtocolMemberMetadata) else set()
    if isinstance(assigned, ConsumerProtocolMemberAssignment):
        topics.update(topic for topic, _ in assigned.assignment)
    return frozenset(topics)


def _decoded(struct: type[Struct], data: bytes) -> Struct | None:
    try:
        return struct.decode(data)
    except Exception:
        return None  # empty, or not the consumer protocol's bytes
