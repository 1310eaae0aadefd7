"""Every message that crosses a socket: typed msgspec structs, encoded as msgpack.

Two families:
- the client protocol (client <-> driver, ZMQ DEALER/ROUTER): GenerateRequest and
  AbortRequest in, Delta and ErrorReply out;
- the control plane (driver <-> ranks): StepPlan out, StepResult back.

Nothing here is ever pickled; a frame that does not decode to one of these types is an
error for that frame only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

INT32_MAX = (1 << 31) - 1
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_PROMPT_TOKENS = 1 << 20
"""Token ids in one prompt (a frame's limit; the model's context is checked at admission)."""
MAX_PROMPT_CHARS = 16 << 20

# The bounds of a request's numbers, declared and enforced once, by the types here: a ZMQ
# frame is checked as it decodes, an HTTP request when its SamplingParams is built from it
# (engine/serving/openai_protocol.py, which names the request's parameter in its 400).
# Every count is below 2**31, so no plan built from a request can overflow an encoder or a kernel.
COUNT = Meta(ge=0, le=INT32_MAX)
MAX_TOKENS = Meta(ge=1, le=INT32_MAX)
TEMPERATURE = Meta(ge=0.0, le=100.0)
TOP_P = Meta(gt=0.0, le=1.0)
SEED = Meta(ge=0, le=(1 << 63) - 1)
LOGPROBS = Meta(ge=0, le=MAX_LOGPROBS)
STOP_STRINGS = Meta(max_length=MAX_STOP_STRINGS)
STOP_TOKEN_IDS = Meta(max_length=64)
PENALTY = Meta(ge=-2.0, le=2.0)
"""OpenAI's presence_penalty and frequency_penalty."""
REPETITION_PENALTY = Meta(gt=0.0, le=100.0)
LOGIT_BIAS = Meta(ge=-100.0, le=100.0)
MAX_LOGIT_BIAS = 1024
"""Entries of one request's logit_bias."""
MIN_P = Meta(ge=0.0, le=1.0)

NonNegInt = Annotated[int, COUNT]
TokenId = Annotated[int, COUNT]


class ParamError(ValueError):
    """A SamplingParams that breaks a bound its model sets (SamplingParams.check)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class SamplingParams(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Per-request sampling. Defaults follow OpenAI/vLLM (temperature 1, no top-k/p)."""

    max_tokens: Annotated[int, MAX_TOKENS] = 16
    min_tokens: NonNegInt = 0
    temperature: Annotated[float, TEMPERATURE] = 1.0
    top_p: Annotated[float, TOP_P] = 1.0
    top_k: NonNegInt = 0
    """0 disables top-k."""
    seed: Annotated[int, SEED] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], STOP_STRINGS] = []
    """Strings that end generation; they are not part of the output."""
    stop_token_ids: Annotated[list[TokenId], STOP_TOKEN_IDS] = []
    ignore_eos: bool = False
    logprobs: Annotated[int, LOGPROBS] | None = None
    """None: no logprobs; n >= 0: the sampled token's logprob plus the top n."""
    skip_special_tokens: bool = True
    presence_penalty: Annotated[float, PENALTY] = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI's)."""
    frequency_penalty: Annotated[float, PENALTY] = 0.0
    """Subtracted from a token's logit once per time the output already holds it (OpenAI's)."""
    repetition_penalty: Annotated[float, REPETITION_PENALTY] = 1.0
    """vLLM's (CTRL's): the logit of a token in the prompt or the output is divided by it if
    positive, multiplied if negative. 1 is off."""
    logit_bias: Annotated[list[tuple[TokenId, Annotated[float, LOGIT_BIAS]]], Meta(max_length=MAX_LOGIT_BIAS)] = []
    """(token id, bias) pairs added to the logits (OpenAI's logit_bias)."""
    min_p: Annotated[float, MIN_P] = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's. 0 is off."""
    include_stop_str_in_output: bool = False
    """vLLM's: the stop string that ended the request stays in its text."""
    prompt_logprobs: Annotated[int, LOGPROBS] | None = None
    """vLLM's: each prompt token's logprob given the tokens before it, plus the top n. A
    request that asks for them computes its whole prompt (no prefix cache hits)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, vocab_size: int) -> None:
        """The bounds the Meta annotations cannot state, for a model of `vocab_size` tokens;
        ParamError naming the first field that breaks one."""
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.top_k > vocab_size:
            raise ParamError("top_k", f"top_k={self.top_k} exceeds the vocabulary's {vocab_size} tokens")
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ParamError("stop_token_ids", f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ParamError("logit_bias", f"logit_bias token ids {bad[:5]} are outside the vocabulary (size "
                                           f"{vocab_size})")


MAX_CONSTRAINT_CHARS = 64 << 10
"""Characters of one structured-output constraint (a schema, a regex, a grammar)."""
MAX_CHOICES = 1024


class StructuredOutputs(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What the output must match (vLLM's `structured_outputs`): exactly one of these."""

    json: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] | dict[str, Any] | None = None
    """A JSON schema (an object, or its JSON text)."""
    regex: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] | None = None
    choice: Annotated[list[Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)]], Meta(max_length=MAX_CHOICES)] | None = None
    grammar: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] | None = None
    """An EBNF grammar (xgrammar's dialect of GBNF; the start rule is `root`)."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""


class Constraint(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A constraint as the server's frontends resolve one (engine/structured.py GrammarSpec),
    which StructuredOutputs cannot always say: a front door (engine/serving/replicas) forwards the
    constraint of an HTTP request (a forced tool call's markers around a schema) to a
    replica in this form."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    prefix: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    suffix: Annotated[str, Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    param: Annotated[str, Meta(max_length=64)] = "structured_outputs"
    reasoning: Literal["", "inside", "optional"] = ""
    reasoning_budget: Annotated[int, Meta(ge=0)] = 0


# ---------------------------------------------------------------- client protocol


class KvHandoff(Struct, frozen=True, forbid_unknown_fields=True):
    """A request served by two replicas (disaggregated prefill/decode, from the front door).
    `decode`: reserve the prompt's blocks, receive their KV from replica `peer`'s ranks, and
    answer KvReserved; decode once KvReady comes. `prefill`: compute the prompt, send its KV
    from block `first_block` on to replica `peer`'s ranks as layers finish, sample the first
    token and answer PrefillDone."""

    transfer: Annotated[int, Meta(ge=0, lt=1 << 31)]
    """Unique in the deployment: tags the KV messages of this request."""
    peer: Annotated[int, Meta(ge=0)]
    role: Literal["prefill", "decode"]
    first_block: Annotated[int, Meta(ge=0)] = 0
    """`prefill`: the leading blocks the decode replica's prefix cache holds (not sent)."""


class KvReady(Struct, tag="kv_ready", frozen=True, forbid_unknown_fields=True):
    """To the decode replica: the prefill replica sent the request's KV; `token_id` is the
    first output token (and its logprob, if asked for)."""

    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    token_id: TokenId
    logprob: TokenLogprob | None = None


class Resume(Struct, frozen=True, forbid_unknown_fields=True):
    """A stream another replica started and could not finish (its replica failed): the front
    door sends it on with what its client already has. The replica takes `token_ids` as
    output it sampled itself (after the prompt: penalties, min_tokens, max_tokens, stop
    strings and a constraint go on from them), computes their KV with the prompt's, and
    sends only what follows: text from character `text_chars` of the output on."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    text_chars: Annotated[int, Meta(ge=0)] = 0


class GenerateRequest(Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    params: SamplingParams = SamplingParams()
    stream: bool = True
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    """Share cached KV blocks only with requests of the same salt (vLLM's extension), so one
    tenant cannot learn another's prompts from how fast its own are answered."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output (engine/structured.py)."""
    constraint: Constraint | None = None
    """Constrain the output, in the resolved form (not with structured_outputs)."""
    handoff: KvHandoff | None = None
    """Disaggregated prefill/decode: this replica's part of the request (the front door sets it)."""
    resume: Resume | None = None
    """Migration: the output so far of a stream another replica started (the front door sets it)."""
    lora: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    """The LoRA adapter the request runs with (its name as the server serves it); None: the base model."""
    priority: Annotated[int, Meta(ge=-(1 << 31), lt=1 << 31)] = 0
    """Its rank under scheduler.policy priority (lower first, as vLLM's); fcfs takes only 0."""
    background: bool = False
    """A Batch API request: scheduled below every online request, preempted first."""


class AbortRequest(Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]


ClientMessage = Union[GenerateRequest, AbortRequest, KvReady]

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The top-n alternatives, most likely first, as (token_id, logprob)."""
    rank: int | None = None
    """The token's rank in the vocabulary (1: the most likely), where it is known (prompt logprobs)."""


class Usage(Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's prompt_tokens_details.cached_tokens)."""
    accepted_draft_tokens: int = 0
    """Speculative decoding: proposed tokens the model accepted (part of completion_tokens;
    OpenAI's completion_tokens_details.accepted_prediction_tokens)."""
    rejected_draft_tokens: int = 0
    """Speculative decoding: proposed tokens the model rejected (not part of the output;
    OpenAI's completion_tokens_details.rejected_prediction_tokens)."""


class Delta(Struct, tag="delta", frozen=True):
    """New output of one request. The last one has a finish_reason and the usage."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    stop_reason: str | int | None = None
    """The stop string or token id that ended the request, if one did."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """In the request's first delta, if its params asked: one per prompt token, the first None."""


class Completion(Struct):
    """All deltas of one request, accumulated (what a non-streaming caller gets)."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: Delta) -> "Completion":
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids = self.token_ids + delta.token_ids
        if delta.logprobs:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = delta.finish_reason, delta.stop_reason, delta.usage
        return self


ErrorCode = Literal["bad_request", "too_long", "overloaded", "duplicate_id", "internal", "unavailable",
                    "unauthorized"]


class ErrorReply(Struct, tag="error", frozen=True):
    request_id: str | None
    code: ErrorCode
    message: str


class KvReserved(Struct, tag="kv_reserved", frozen=True):
    """From a decode replica: the request's blocks are reserved and their receives posted;
    its prefix cache held the first `cached_tokens` of the prompt (whole blocks)."""

    request_id: str
    cached_tokens: int


class PrefillDone(Struct, tag="prefill_done", frozen=True):
    """From a prefill replica: the prompt is computed and its KV sent; the first token."""

    request_id: str
    token_id: int
    logprob: TokenLogprob | None = None


ServerMessage = Union[Delta, ErrorReply, KvReserved, PrefillDone]

# ---------------------------------------------------------------- control plane


class NewSeq(Struct, array_like=True, frozen=True):
    """A sequence the ranks have not seen (or resume after preemption), sent in full."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int
    """Tokens whose K/V are already in the cache (0 unless a prefix is cached)."""
    num_new: int
    """Tokens to compute in this step, starting at num_computed (drafts included)."""
    params: SamplingParams
    draft: list[int] = []
    """Speculative decoding: tokens proposed after the known ones, computed in this step
    (the last `len(draft)` of num_new) and verified by the sampling rank."""
    lora_slot: int = -1
    """The slot of the LoRA adapter it runs with (the same while it lives); -1: none."""


class LoraLoad(Struct, array_like=True, frozen=True):
    """Before the step: read an adapter into a slot (whatever the slot held gives way)."""

    slot: int
    name: str
    path: str


class SeqDelta(Struct, array_like=True, frozen=True):
    """A running sequence: what changed since the last plan that mentioned it."""

    seq_id: int
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_new: int
    """Tokens to compute in this step (drafts included)."""
    num_computed: int = -1
    """The driver's count of tokens whose K/V are in the cache before this step; -1: what the
    rank's mirror counts. After a speculative step the mirror counts only the known tokens:
    the accepted drafts (the first of new_token_ids) were computed in it too."""
    num_blocks: int = -1
    """Entries of the block table the ranks keep before appending new_block_ids; -1: all.
    Fewer after a speculative step gave back the blocks only its rejected drafts used."""
    draft: list[int] = []
    """Speculative decoding: as NewSeq.draft."""
    deferred: bool = False
    """Overlapped steps (engine/engine.py): the step computes one token the driver has not
    seen, the one the previous step sampled for this sequence. The ranks append it
    themselves, from the sampled tokens they kept on the device; new_token_ids is empty."""


class TokenMasks(Struct, array_like=True, frozen=True):
    """The tokens each constrained sequence may sample this step (engine/structured.py):
    rows of `words` int32, bit j of word w allowing token 32 * w + j (xgrammar's layout),
    little-endian; `rows[i]` consecutive rows for seq_ids[i] (1 + its drafts: the mask after
    each proposed token), or one row each if `rows` is empty."""

    seq_ids: list[int]
    words: int
    bits: bytes
    rows: list[int] = []


class KvTransfer(Struct, array_like=True, frozen=True):
    """One request's KV between two replicas' ranks (comm/kv_transfer.py): blocks
    `first_block` .. `first_block + num_blocks - 1` of the prompt, in messages of up to
    BLOCKS_PER_MESSAGE blocks per layer."""

    transfer: int
    peer: int
    """The other replica."""
    first_block: int
    num_blocks: int
    block_ids: list[int] = []
    """Receiving: where the blocks land (this replica's ids)."""
    seq_id: int = -1
    """Sending: the sequence whose blocks are sent as its prefill computes them."""


class KvOps(Struct, array_like=True, frozen=True):
    receive: list[KvTransfer] = []
    """Post the receives of these transfers."""
    send: list[KvTransfer] = []
    """Send these sequences' blocks as each layer computes them, in this step and later ones."""
    land: list[int] = []
    """Before the step: wait for these transfers (every rank agrees whether each arrived
    whole) and copy them into their blocks."""
    end: list[KvTransfer] = []
    """Forget these transfers: receives are left to arrive in their staging buffers; the
    messages not sent yet are sent as zeros, so the peer's receives complete."""


class StepPlan(Struct, frozen=True, tag="plan"):
    """One engine step. Batch order: `running`, then `new`. `dropped` lists sequences the
    ranks should forget (finished, aborted or preempted) before running this step."""

    step_id: int
    running: list[SeqDelta]
    new: list[NewSeq]
    dropped: list[int]
    masks: TokenMasks | None = None
    """Grammar masks of the constrained sequences this step samples (None: none is)."""
    kv: KvOps | None = None
    """Disaggregated prefill/decode: the KV transfers this step starts, lands or ends."""
    loras: list[LoraLoad] = []
    """LoRA adapters to load before the step (the ones its new sequences need that no slot held)."""

    @property
    def num_seqs(self) -> int:
        return len(self.running) + len(self.new)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.running) + sum(s.num_new for s in self.new)


class Shutdown(Struct, frozen=True, tag="shutdown"):
    reason: str = ""


class Hello(Struct, frozen=True, tag="hello"):
    """Published by the driver until every rank has answered Ready: a SUB socket that
    has seen a Hello is subscribed, so it cannot miss the first plan."""

    session: str


class Ready(Struct, frozen=True, tag="ready"):
    rank: int
    session: str


ControlMessage = Union[StepPlan, Shutdown, Hello]


class PromptLogprobs(Struct, array_like=True, frozen=True):
    """The logprobs of a run of one sequence's prompt tokens, computed in one step."""

    seq_id: int
    start: int
    """The position of the first token they are of (>= 1: the first prompt token has none)."""
    logprobs: list[TokenLogprob]


class StepResult(Struct, frozen=True, tag="result"):
    """Tokens sampled in one step, for the sequences whose known tokens were all computed."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    """Every sequence's tokens, one after the other (one each unless `counts` says more)."""
    logprobs: list[TokenLogprob | None] | None = None
    """One per token of token_ids."""
    prompt_logprobs: list[PromptLogprobs] | None = None
    """For the sequences that asked (SamplingParams.prompt_logprobs) and computed prompt
    tokens in this step."""
    counts: list[int] | None = None
    """Speculative decoding: tokens per sequence (its accepted drafts, then the token sampled
    after them); None: one each."""
    proposals: list[list[int]] | None = None
    """Medusa heads (speculative.method=medusa): per sequence, the heads' guesses at the
    tokens after its last one here, nearest first; None without heads."""

    def per_sequence(self) -> list[tuple[int, list[int], list[TokenLogprob | None] | None]]:
        """(seq_id, its tokens, their logprobs or None) of every sequence, in order."""
        counts = self.counts or [1] * len(self.seq_ids)
        out, at = [], 0
        for seq_id, n in zip(self.seq_ids, counts):
            out.append((seq_id, self.token_ids[at:at + n], self.logprobs[at:at + n] if self.logprobs else None))
            at += n
        return out


class RankStats(Struct, frozen=True, tag="stats"):
    """A rank's counters, sent to the driver now and then (pipeline stage occupancy)."""

    rank: int
    busy_seconds: float
    """Time spent computing this rank's shard (waits for other stages excluded)."""
    wall_seconds: float
    """Time since the rank started following plans."""
    steps: int
    rss_bytes: int = 0
    """Resident memory now."""
    peak_rss_bytes: int = 0
    """Highest resident memory so far."""
    ready_rss_bytes: int = 0
    """Resident memory once the model and the KV cache were in place."""
    cp_wait_seconds: float = 0.0
    """Context parallelism: time waiting for K/V blocks (a late peer included)."""
    cp_exposed_seconds: float = 0.0
    """Context parallelism: the part of those waits spent on transfers compute did not hide."""
    expert_tokens: int = 0
    """Expert parallelism: (token, expert) pairs this rank's experts computed (its load)."""
    ep_seconds: float = 0.0
    """Expert parallelism: time in the all-to-all token exchanges and all-gathers."""


RankMessage = Union[StepResult, Ready, RankStats]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what clients send to the driver."""
    return msgspec.msgpack.Decoder(ClientMessage)


def server_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the driver sends to clients."""
    return msgspec.msgpack.Decoder(ServerMessage)


def control_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the driver publishes to the ranks."""
    return msgspec.msgpack.Decoder(ControlMessage)


def rank_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the ranks send back to the driver."""
    return msgspec.msgpack.Decoder(RankMessage)
