"""The driver's side of disaggregated prefill/decode: which KV transfers a step's plan
starts, lands or ends on the ranks (comm.messages.KvOps), and what the front door is told.

A prefill replica computes a request's prompt as any other; its ranks send the prompt's
blocks (from the first one the decode replica lacks) layer by layer as the steps write them
(engine/kv_agent.py), and once the first token is sampled the request ends here with a
PrefillDone. A decode replica reserves the blocks (Scheduler: `receiving`), has its ranks
post the receives, answers KvReserved, and when KvReady says the prefill is done, lands the
transfer (every rank agrees whether it arrived whole) and runs the sequence from its first
token on. Every transfer a plan started is ended on the ranks, whatever becomes of its
request: a prefill rank then sends what it never sent (zeros), so no receive waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.comm.messages import KvHandoff, KvOps, KvReserved, KvTransfer, TokenLogprob
from meshserve.configs.roles import ReplicaRole
from meshserve.engine.admission import RequestError
from meshserve.engine.sequence import Sequence


@dataclass
class Landing:
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


class Handoffs:
    def __init__(self, role: ReplicaRole | None, block_size: int):
        """`role`: this replica's, None where there is no disaggregation."""
        self.role, self.block_size = role, block_size
        self._ops = KvOps([], [], [], [])
        self.landing: dict[int, Landing] = {}
        """Transfers in the plan being submitted that land, by transfer id."""
        self._open: dict[int, KvTransfer] = {}
        """Transfers the ranks know and have not ended."""

    def check(self, handoff: KvHandoff | None) -> None:
        """A request's handoff fits this replica (a client cannot set one on a plain server)."""
        if handoff is None:
            return
        if self.role is None:
            raise RequestError("bad_request", "this server is not a replica of a disaggregated deployment: it takes "
                                              "no handoff", "handoff")
        if handoff.role != self.role:
            raise RequestError("bad_request", f"this replica is a {self.role} replica; the request's handoff asks "
                                              f"for {handoff.role}", "handoff")

    def _transfer(self, handoff: KvHandoff, prompt_len: int, **fields) -> KvTransfer:
        num_blocks = -(-prompt_len // self.block_size) - handoff.first_block
        return KvTransfer(handoff.transfer, handoff.peer, handoff.first_block, num_blocks, **fields)

    def reserved(self, seq: Sequence, request_id: str) -> KvReserved:
        """A decode sequence's blocks were reserved: its ranks post the receives."""
        first = seq.num_computed // self.block_size
        handoff = seq.handoff = KvHandoff(seq.handoff.transfer, seq.handoff.peer, ReplicaRole.DECODE, first)
        transfer = self._transfer(handoff, seq.prompt_len,
                                  block_ids=seq.block_ids[first:-(-seq.prompt_len // self.block_size)])
        self._ops.receive.append(transfer)
        self._open[handoff.transfer] = transfer
        return KvReserved(request_id, seq.num_computed)

    def scheduled(self, seq: Sequence) -> None:
        """A prefill sequence is in a plan: the first time, its ranks learn to send its blocks."""
        transfer = seq.handoff.transfer
        if transfer not in self._open:
            sent = self._transfer(seq.handoff, seq.prompt_len, seq_id=seq.seq_id)
            self._ops.send.append(sent)
            self._open[transfer] = sent

    def ready(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        """The prefill replica is done: land the transfer in the next plan."""
        self._ops.land.append(seq.handoff.transfer)
        self.landing[seq.handoff.transfer] = Landing(seq, token_id, logprob)

    def landed(self, transfer: int) -> None:
        self._open.pop(transfer, None)

    def ended(self, seq: Sequence) -> None:
        """`seq`'s request ended (finished, aborted, failed): end its transfer on the ranks."""
        transfer = self._open.pop(seq.handoff.transfer, None)
        if transfer is not None:
            self._ops.end.append(transfer)
        elif seq.handoff.role == ReplicaRole.PREFILL:  # ended before a plan carried it: the ranks never heard of it
            self.refused(seq.handoff, seq.prompt_len)
        self.landing.pop(seq.handoff.transfer, None)

    def refused(self, handoff: KvHandoff | None, prompt_len: int) -> None:
        """A prefill request refused, or ended before any plan carried it: its ranks still
        send the decode replica's ranks what they wait for (zeros)."""
        if handoff is not None and handoff.role == ReplicaRole.PREFILL and self.role == ReplicaRole.PREFILL:
            self._ops.end.append(self._transfer(handoff, prompt_len, seq_id=-1))

    def pending(self) -> bool:
        """Whether the next plan has transfer ops, even with no sequence to compute."""
        ops = self._ops
        return bool(ops.receive or ops.send or ops.land or ops.end)

    def take(self) -> KvOps | None:
        """The ops of the plan being built (None: none)."""
        if not self.pending():
            return None
        ops, self._ops = self._ops, KvOps([], [], [], [])
        return ops
