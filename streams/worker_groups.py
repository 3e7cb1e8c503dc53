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
too -- the check cannot tell it from workers -- so it is a warning, never a refusal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
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
    client_id: str
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


def beside_warning(beside: Sequence[ConsumerGroup], topic: str, own_group: str) -> str:
    """What the operator reads: who else reads the topic, what that does, and what to do."""
    named = "; ".join(f"{printable(g.group_id)!r} ({_members(g, topic)})" for g in beside)
    return (
        f"consumer group {printable(own_group)!r} is starting on {topic}, which another group already reads: "
        f"{named}. If those are turnstile workers, both groups run every turn (each model call twice, each "
        f"group taking the other's turns over): give this worker their group (--group, or `group` in "
        f"turnstile.toml), or stop theirs "
        f"first (a stopped static member leaves its group when its session times out). A consumer of your own "
        f"on the events topic is no harm."
    )


def _members(group: ConsumerGroup, topic: str) -> str:
    reading = [m for m in group.members if topic in m.topics]
    hosts = sorted({printable(m.host.removeprefix("/")) for m in reading})  # Kafka's "/10.0.0.7"
    shown = ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more" if len(hosts) > 3 else "")
    return f"{len(reading)} member{'s' if len(reading) != 1 else ''} on {shown}"


async def warn_of_groups_beside(bootstrap: str, topic: str, own_group: str) -> list[ConsumerGroup]:
    """Logs `beside_warning` if other groups read `topic`; the groups found. An admin API
    that fails or is refused (no describe rights) leaves the check undone, said once."""
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            beside = groups_beside(await consumer_groups(bootstrap), topic, own_group)
    except Exception as exc:
        log.warning("could not check whether another consumer group reads %s: %r", topic, exc)
        return []
    if beside:
        log.error("%s", beside_warning(beside, topic, own_group))
    return beside


async def consumer_groups(bootstrap: str) -> list[ConsumerGroup]:
    """Every consumer group of the cluster with its live members: each broker lists the
    groups it coordinates (ListGroups) and describes them (DescribeGroups), two requests
    a broker however many groups there are."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    try:
        await client.bootstrap()
        groups = []
        for broker in client.cluster.brokers():
            listed = await client.send(broker.nodeId, ListGroupsRequest())
            ids = [group for group, protocol_type, *_ in listed.groups if protocol_type == "consumer"]
            if ids:
                described = await client.send(broker.nodeId, _DescribeGroups(ids))
                groups += [_group(g) for g in described.to_object()["groups"] if g["error_code"] == 0]
        return groups
    finally:
        await client.close()


class _DescribeGroups(DescribeGroupsRequest):  # type: ignore[misc]  # aiokafka.protocol is untyped
    """DescribeGroups at v1-v2: aiokafka 0.14 reads a v3 answer with the v2 schema (its
    `DescribeGroupsRequest_v3.RESPONSE_TYPE`), which the answer of a Kafka 4 broker underruns,
    dropping the connection. Every broker since Kafka 1.1 answers v2, and 4.x still does."""


_DescribeGroups._CLASSES = (DescribeGroupsRequest_v1, DescribeGroupsRequest_v2)


def _group(described: dict[str, Any]) -> ConsumerGroup:
    members = tuple(
        GroupMember(m["client_id"], m["client_host"], _topics(m["member_metadata"], m["member_assignment"]))
        for m in described["members"]
    )
    return ConsumerGroup(described["group"], described["state"], members)


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
