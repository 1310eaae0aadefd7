"""The role of a replica in disaggregated prefill/decode, one type from the config to the
engine: the config (disaggregation.prefill_replicas, and the replica index the front door
gives each replica) decides it, the front door tags each request's KV handoff with it
(comm.messages.KvHandoff), and the engine's Handoffs and scheduler branch on it. The values
are the wire's: msgspec encodes a member as its string and refuses any other string."""

from __future__ import annotations

from meshserve.configs.wire_enum import WireEnum


class ReplicaRole(WireEnum):
    """`prefill`: computes prompts, sends their KV and the first token. `decode`: reserves
    the blocks, receives the KV and decodes from the first token on."""

    PREFILL = "prefill"
    DECODE = "decode"


def role_of(replica: int, prefill_replicas: int) -> ReplicaRole:
    """Replica `replica`'s role when the first `prefill_replicas` replicas prefill."""
    return ReplicaRole.PREFILL if replica < prefill_replicas else ReplicaRole.DECODE
