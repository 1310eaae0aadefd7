"""A request as the driver's scheduler sees it. Plain Python: no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Hashable

from meshserve.comm.messages import KvHandoff, SamplingParams
from meshserve.engine.lora.registry import Registered


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RECEIVING = "receiving"
    """Disaggregated decode: its prompt's blocks are reserved and its KV is on its way."""
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    key: Hashable
    """Who asked: (client identity, request id) on the server, an index offline."""
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    """Tokens whose K/V are in the cache."""
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_pending: int = 0
    """Tokens sampled by steps in flight whose values the driver has not received yet
    (overlapped steps): they follow token_ids, and a step may already compute them."""
    # What the ranks already hold (control-plane deltas); 0 tokens: the ranks do not know it.
    sent_tokens: int = 0
    sent_blocks: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    """Its request's priority (lower first) under scheduler.policy priority."""
    background: bool = False
    """A Batch API request: scheduled after every online request, and preempted first."""
    # Prefix caching (meshserve.engine.block_manager)
    cache_salt: str | None = None
    """Requests share cached blocks only with requests of the same salt (None: unsalted)."""
    hash_root: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """The hash of each full block of token_ids known so far (computed as needed)."""
    num_registered: int = 0
    """Tokens of the leading blocks already offered to the prefix cache."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first admitted."""
    # Speculative decoding (meshserve.engine.speculative)
    draft: list[int] = field(default_factory=list)
    """Tokens proposed after token_ids for the step being scheduled or in flight."""
    num_draft_tokens: int = 0
    """Proposed tokens verified so far."""
    num_accepted_tokens: int = 0
    """Of those, the tokens accepted."""
    # Disaggregated prefill/decode (meshserve.engine.handoff)
    handoff: KvHandoff | None = None
    """This replica's part of a request two replicas serve."""
    # LoRA (meshserve.engine.lora)
    lora: Registered | None = None
    """The adapter it runs with, or None."""
    lora_slot: int = -1
    """Its adapter's slot on the ranks, from admission to its end (-1: none yet)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens to compute: the known ones not in the cache, and any still pending."""
        return len(self.token_ids) + self.num_pending - self.num_computed
