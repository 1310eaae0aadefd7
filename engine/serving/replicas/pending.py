"""A request the front door has in flight: where it is, and what of its output the front
door has had, which is what it needs to move the request to another replica (migration)
with no token lost or repeated. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgspec

from meshserve.comm.messages import Delta, Resume, Usage
from meshserve.engine.serving.commands import AddCommand


class Phase(str, Enum):
    """Where a request stands in disaggregated prefill/decode (WHOLE: one replica serves it
    from prompt to end). RESERVING: the decode replica reserves its blocks; PREFILLING: the
    prefill replica computes the prompt and sends its KV; DECODING: the decode replica has
    the first token and goes on; PREFILLED: the request ended or started over while
    prefilling, and its prompt no longer counts against the prefill replica."""

    WHOLE = "whole"
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREFILLED = "prefilled"


@dataclass
class Pending:
    cmd: AddCommand
    replica: int
    tried: set[int] = field(default_factory=set)
    output: list[int] = field(default_factory=list)
    """The output tokens so far (those of the client's own resume included): what a replica
    that takes the request over is given."""
    chars: int = 0
    """Characters of output text so far."""
    moves: int = 0
    """Times it moved to another replica with output (router.migration_limit bounds them)."""
    parts: list[Delta] = field(default_factory=list)
    """A whole (unstreamed) request's deltas so far: the replicas stream to the front door,
    which answers the client once, so a whole request moves with its output too."""
    prefill: int | None = None
    """Disaggregated: the prefill replica computing its prompt ..."""
    transfer: int = -1
    prefill_tokens: int = 0
    aborted: bool = False
    phase: Phase = Phase.WHOLE
    """... and where it is."""

    def __post_init__(self) -> None:
        if self.cmd.resume is not None:
            self.output, self.chars = list(self.cmd.resume.token_ids), self.cmd.resume.text_chars

    def resume(self) -> Resume | None:
        """What a replica taking it over starts from (None: it has no output yet)."""
        return Resume(list(self.output), self.chars) if self.output else None

    def took(self, delta: Delta) -> Delta | None:
        """A replica's delta of it: counted, and what the client gets now (None: nothing
        yet, for a whole request before its end)."""
        self.output += delta.token_ids
        self.chars += len(delta.text)
        if self.cmd.stream:
            return delta
        self.parts.append(delta)
        return joined(self.parts) if delta.finish_reason is not None else None

    def aborted_delta(self) -> Delta:
        """Its last delta when it was aborted and its replica went away before saying so."""
        last = Delta(self.cmd.request_id, "", [], "abort", usage=Usage(len(self.cmd.prompt_ids), len(self.output)))
        return last if self.cmd.stream else joined([*self.parts, last])


def joined(parts: list[Delta]) -> Delta:
    """Deltas of one request as one (the last one's finish and usage)."""
    last = parts[-1]
    logprobs = [lp for d in parts for lp in d.logprobs or ()]
    prompt_logprobs = next((d.prompt_logprobs for d in parts if d.prompt_logprobs is not None), None)
    return msgspec.structs.replace(last, text="".join(d.text for d in parts),
                                   token_ids=[t for d in parts for t in d.token_ids],
                                   logprobs=logprobs if any(d.logprobs is not None for d in parts) else None,
                                   prompt_logprobs=prompt_logprobs)
