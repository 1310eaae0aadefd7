"""The driver's engine: schedule -> run on the ranks -> postprocess, one step at a time.

Single-threaded by design: only this object mutates scheduler state; the ranks see
immutable plans. The server's step loop and offline `generate` both drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Hashable, Protocol

import msgspec

from meshserve.comm.messages import (Delta, ErrorReply, KvHandoff, NewSeq, PrefillDone, PromptLogprobs, Resume,
                                     SamplingParams, TokenLogprob, encoder)
from meshserve.configs.memory import MemoryPlan
from meshserve.configs.schema import SchedulerConfig
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.executor import Executor
from meshserve.engine.handoff import Handoffs
from meshserve.engine.lora.adapter import AdapterError
from meshserve.engine.lora.registry import LoraRegistry
from meshserve.engine.output_processor import OutputProcessor, RequestState
from meshserve.engine.plan import PlanBuilder
from meshserve.engine.scheduler import ScheduledBatch, Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.engine.speculative.speculator import Speculator
from meshserve.engine.structured import Grammar, GuidedDecoding
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.admission import RequestError
from meshserve.parallel.pipeline import MicroBatches


@dataclass
class EngineStats:
    steps: int = 0
    finished: int = 0
    """Requests finished or aborted."""
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0
    """Scheduling and building the plan."""
    postprocess_seconds: float = 0.0
    """Appending tokens, stop checks, detokenization."""


class EngineObserver(Protocol):
    """Hooks for metrics, called on the step loop's thread. The engine imports none of
    what implements them (engine/serving/metrics.py does, for Prometheus)."""

    def on_scheduled(self, batch: ScheduledBatch) -> None:
        """A step was scheduled (its sequences, and any preempted for it)."""

    def on_token(self, seq: Sequence) -> None:
        """`seq` got a token."""

    def on_finished(self, state: RequestState) -> None:
        """A request finished or was aborted."""

    def on_step(self, batch: ScheduledBatch, context_lens: list[int], seconds: float) -> None:
        """A step finished: each sequence's tokens in context after it, and the step's wall
        time (overlapped steps: its submit, the wait for its tokens and their processing)."""

    def on_verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """`seq` verified `drafted` proposed tokens in a step and kept `accepted` of them."""

    def on_idle(self) -> None:
        """The step loop woke with no work (it wakes at its idle poll interval while idle)."""


@dataclass
class InFlight:
    """A submitted step: its batch, and the executor's handle for its result."""

    batch: ScheduledBatch
    handle: Any
    context_lens: list[int]
    """Each sequence's tokens in context once the step has run."""
    submit_seconds: float = 0.0
    """How long its submit took (on the CPU, the whole step: the kernels run in it)."""


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, memory: MemoryPlan, scheduler: SchedulerConfig,
                 vocab_size: int, micro_batches: int = 1, cp_size: int = 1, prefix_caching: bool = False,
                 speculator: Speculator | None = None, role: str | None = None, overlap: bool = False,
                 loras: LoraRegistry | None = None):
        """`micro_batches`: steps kept in flight at once (pipeline parallelism); each
        takes its share of the sequences, and no sequence is in two at once
        (meshserve.parallel.pipeline). `cp_size`: ranks a sequence's tokens are split
        over (context parallelism). `prefix_caching`: requests reuse the KV blocks of
        prefixes already computed (meshserve.engine.block_manager). `speculator`: drafts
        tokens for the decoding sequences, which each step verifies (meshserve.engine.speculative).
        `role`: this replica's in disaggregated prefill/decode ("prefill" or "decode";
        meshserve.engine.handoff), None without it. `overlap`: schedule and submit each step
        while the one before it runs (one stage, `micro_batches` 1): a sequence that step
        samples computes its sampled token next, which the ranks take from the device; the
        driver receives the tokens of step n, checks stops and detokenizes while step n + 1
        runs. A stop found so finishes its request a step late; the token computed after it
        is dropped, never streamed. Sequences whose next step needs their last token here
        wait for it instead: a grammar's mask, speculative drafts. `loras`: the LoRA adapters
        served (engine/lora/registry.py), None where the server serves none."""
        if overlap and micro_batches != 1:
            raise ValueError(f"overlapped steps with {micro_batches} pipeline micro-batches: they already "
                             f"keep {micro_batches} steps in flight")
        self.overlap = overlap
        self.speculator = speculator
        self.executor = executor
        self._in_flight: MicroBatches[InFlight] = (MicroBatches(2, overlapping=True) if overlap
                                                   else MicroBatches(micro_batches))
        self.vocab_size = vocab_size
        self.cp_size = cp_size
        self.tokenizer = tokenizer
        self.memory = memory
        # the KV of a block depends on its tokens, the model and what the cache holds
        cache_kind = f"{memory.dtype}/{memory.kv_dtype}/{memory.quantization}"
        blocks = BlockManager(memory.num_blocks, memory.block_size, cp_size, prefix_caching, cache_kind)
        self.loras = loras
        self.scheduler = Scheduler(blocks, scheduler.max_num_seqs, scheduler.max_batched_tokens, loras,
                                   scheduler.priority_aging if scheduler.policy == "priority" else None,
                                   scheduler.background_max_seqs, scheduler.background_share,
                                   scheduler.background_step_tokens)
        if speculator is not None and speculator.tree is not None:
            self.scheduler.tree_parents = speculator.tree.parents
        self.plans = PlanBuilder()
        self.handoffs = Handoffs(role, memory.block_size)
        self._events: list[tuple[Hashable, object]] = []
        """Replies that come of scheduling rather than of a step's tokens (engine/handoff.py)."""
        self.outputs = OutputProcessor(tokenizer.eos_token_ids, memory.max_model_len)
        self.guided = GuidedDecoding(vocab_size)
        """Matchers of the requests with structured outputs (engine/structured.py)."""
        self.requests: dict[Hashable, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._next_seq_id = 0
        self.stats = EngineStats()
        self.observer: EngineObserver | None = None
        self._encoder = encoder()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._in_flight) or self.handoffs.pending() or bool(self._events)

    def add_request(self, key: Hashable, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream: bool = True, cache_salt: str | None = None, grammar: Grammar | None = None,
                    handoff: KvHandoff | None = None, resume: Resume | None = None, lora: str | None = None,
                    priority: int = 0, background: bool = False) -> None:
        """Queue a validated request. `key` is unique among live requests. `cache_salt`: the
        request shares cached KV blocks only with requests of the same salt. `grammar`: the
        compiled constraint its output follows (engine/structured.py). `handoff`: this
        replica's part of a request two replicas serve (engine/handoff.py). `resume`: the
        output so far of a stream another replica started (migration). `lora`: the name of the
        adapter it runs with (None: the base model). `priority`: its rank under
        scheduler.policy priority (lower first); under fcfs only 0 is taken. `background`: a
        Batch API request, scheduled below every online one."""
        self.handoffs.check(handoff)
        if priority and self.scheduler.priority_aging is None:
            raise RequestError("bad_request", f"priority={priority}: this server schedules first come, first served; "
                                              f"start it with scheduler.policy=priority", "priority")
        adapter = self._adapter(lora)
        if resume is not None and handoff is not None:
            raise RequestError("bad_request", "a resumed request is served whole, without a handoff", "handoff")
        if handoff is not None and params.prompt_logprobs is not None:
            raise RequestError("bad_request", "prompt_logprobs is not available with disaggregated prefill/decode",
                               "prompt_logprobs")
        if key in self.requests:
            raise RequestError("duplicate_id", f"request_id {request_id!r} is already running")
        if params.prompt_logprobs is not None and self.cp_size > 1:
            raise RequestError("bad_request", f"prompt_logprobs is not available with context parallelism "
                                              f"(this server splits each prompt over {self.cp_size} ranks)",
                               "prompt_logprobs")
        try:  # what a plan will carry of it: a request the ranks cannot be sent fails here, alone
            self._encoder.encode(NewSeq(self._next_seq_id, prompt_ids, len(prompt_ids), [], 0, 0, params))
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            raise RequestError("bad_request", f"request {request_id!r} cannot be sent to the ranks: {e}") from None
        output_ids = list(resume.token_ids) if resume is not None else []
        seq = Sequence(self._next_seq_id, key, list(prompt_ids) + output_ids, len(prompt_ids), params,
                       cache_salt=cache_salt, handoff=handoff, lora=adapter, priority=priority, background=background)
        self._next_seq_id += 1
        if grammar is not None:
            self.guided.add(seq.seq_id, grammar)
        state = RequestState(seq, request_id, stream, self.tokenizer.detokenizer(prompt_ids, params.skip_special_tokens))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_ids)
        if resume is not None:
            self._resume(state, resume)
        self.requests[key] = state
        self._by_seq[seq.seq_id] = state
        self.scheduler.add(seq)

    def _adapter(self, name: str | None):
        if name is None:
            return None
        adapter = self.loras.adapters.get(name) if self.loras is not None else None
        if adapter is None:
            served = ", ".join(sorted(self.loras.adapters)) if self.loras is not None else ""
            raise RequestError("bad_request", f"no LoRA adapter named {name!r} is loaded"
                                              f"{f' (loaded: {served})' if served else ''}", "lora")
        return adapter

    def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` (AdapterError: why it cannot be); its weights
        reach the ranks when a request first needs them."""
        if self.loras is None:
            raise AdapterError("this server serves no LoRA adapters (start it with lora.enabled=true)")
        self.loras.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`; the requests running with it finish with it."""
        if self.loras is None:
            raise AdapterError("this server serves no LoRA adapters")
        self.loras.unregister(name)

    def _resume(self, state: RequestState, resume: Resume) -> None:
        """A migrated stream: its output so far goes through the constraint and the output
        processor as if sampled here (the detokenizer, stop strings held back and the length
        counted as on the replica that started it), and what its client has is marked sent.
        Seeded sampling needs nothing carried: a row's seed is the request's seed and the
        sequence's length (layers/sampler.py, _row_seed), the same on any replica."""
        seq = state.seq
        for i, token in enumerate(resume.token_ids):
            ended = self.guided.accept(seq.seq_id, token) if self.guided else False
            self.outputs.add_token(state, None, ended, seq.prompt_len + i + 1)
            if state.finish_reason is not None:
                self.guided.drop(seq.seq_id)
                raise RequestError("bad_request", f"the resumed output ends the request at its token {i} "
                                                  f"({state.finish_reason}): there is nothing to resume", "resume")
        state.sent_tokens = seq.num_output_tokens
        state.sent_chars = min(resume.text_chars, len(state.text))

    def abort(self, key: Hashable) -> Delta | None:
        """Stop a request; returns its final delta (finish_reason "abort"), or None if unknown."""
        state = self.requests.get(key)
        if state is None:
            return None
        delta = self.outputs.abort(state)
        self._finish(state)
        return delta

    def kv_ready(self, key: Hashable, token_id: int, logprob: TokenLogprob | None) -> ErrorReply | None:
        """Disaggregated decode: the prefill replica sent `key`'s KV and sampled `token_id`;
        the next plan lands it. An error reply if the request is not waiting for its KV."""
        state = self.requests.get(key)
        if state is None:
            return None  # aborted meanwhile
        seq = state.seq
        if seq.handoff is None or seq.handoff.role != "decode" or seq.handoff.transfer in self.handoffs.landing:
            return ErrorReply(state.request_id, "bad_request", f"request {state.request_id!r} waits for no KV")
        if not 0 <= token_id < self.vocab_size:
            return ErrorReply(state.request_id, "bad_request", f"token {token_id} is not in the vocabulary")
        self.handoffs.ready(seq, token_id, logprob)
        return None

    def step(self) -> list[tuple[Hashable, object]]:
        """Fill the free micro-batch slots, then finish the oldest step in flight."""
        start = time.perf_counter()
        self._fill()
        if not self._in_flight:
            return self._take_events()
        done = self._in_flight.pop()
        waited = time.perf_counter()
        result = self.executor.wait(done.handle)
        executed = time.perf_counter()
        per_seq = result.per_sequence()
        sampled = {seq_id: tokens for seq_id, tokens, _ in per_seq}
        logprobs = {seq_id: lps for seq_id, _, lps in per_seq if lps is not None}
        for run in result.prompt_logprobs or ():
            self._add_prompt_logprobs(run)
        out: list[tuple[Hashable, object]] = self._take_events()
        context_lens = done.context_lens
        drafted = {s.seq_id: len(s.draft) for s in done.batch.seqs if s.draft}
        guesses = dict(zip(result.seq_ids, result.proposals)) if result.proposals is not None else {}
        for seq, tokens in self.scheduler.update(done.batch, sampled):
            if seq.seq_id in guesses:
                self.speculator.received(seq, guesses[seq.seq_id])
            if seq.seq_id in drafted:
                self.speculator.verified(seq, drafted[seq.seq_id], len(tokens) - 1)
                if self.observer is not None:
                    self.observer.on_verified(seq, drafted[seq.seq_id], len(tokens) - 1)
            state = self._by_seq[seq.seq_id]
            if seq.handoff is not None and seq.handoff.role == "prefill":
                lps = logprobs.get(seq.seq_id)
                out.append((seq.key, PrefillDone(state.request_id, tokens[0], lps[0] if lps else None)))
                self._finish(state)
                continue
            delta = self._append(state, tokens, logprobs.get(seq.seq_id))
            if delta is not None:
                out.append((seq.key, delta))
        end = time.perf_counter()
        self.stats.steps += 1
        self.stats.step_seconds += end - start
        self.stats.postprocess_seconds += end - executed
        if self.speculator is not None:
            self.speculator.step_done(done.batch.num_tokens, end - start)
        if self.observer is not None:
            # overlapped: the next step's scheduling, done meanwhile, is not this step's time
            seconds = done.submit_seconds + end - waited if self.overlap else end - start
            self.observer.on_step(done.batch, context_lens, seconds)
        return out

    def _append(self, state: RequestState, tokens: list[int], logprobs: list | None) -> Delta | None:
        """Account for the step's tokens of a request (appended by the scheduler) one by one,
        up to the one that finishes it: the rest are dropped, as a stop is a stop wherever in
        a run of accepted drafts it falls. Returns what its client receives of them."""
        seq = state.seq
        first = seq.num_tokens - len(tokens)
        for i, token in enumerate(tokens):
            if self.observer is not None:
                self.observer.on_token(seq)
            ended = self.guided.accept(seq.seq_id, token) if self.guided else False
            self.outputs.add_token(state, logprobs[i] if logprobs else None, ended, first + i + 1)
            if state.finish_reason is not None:
                del seq.token_ids[first + i + 1:]
                self._finish(state)
                break
        return self.outputs.delta(state)

    def _add_prompt_logprobs(self, run: PromptLogprobs) -> None:
        """Keep a run of prompt logprobs by position (a prompt recomputed after preemption
        computes them again: the same values, in the same slots)."""
        state = self._by_seq.get(run.seq_id)
        if state is None:  # aborted while the step ran
            return
        state.prompt_logprobs[run.start:run.start + len(run.logprobs)] = run.logprobs

    def _fill(self) -> None:
        """Schedule and submit steps until every micro-batch is in flight or nothing is left."""
        while not self._in_flight.full():
            started = time.perf_counter()
            busy = self._in_flight.busy()
            ready = sum(1 for s in self.scheduler.running if s.seq_id not in busy) + len(self.scheduler.waiting)
            share = self._in_flight.share(ready)
            drafting = self._draft(busy, share)
            batch = self.scheduler.schedule(busy, share, self._ahead(busy))
            if self.observer is not None and (len(batch) or batch.preempted):
                self.observer.on_scheduled(batch)
            for seq in batch.preempted:
                self.plans.forget(seq)
            scheduled = {s.seq_id for s in batch.seqs} if drafting else set()
            for seq in drafting:
                if seq.draft and seq.seq_id not in scheduled:
                    seq.draft = []  # not scheduled this step: propose afresh for the next
            for seq in batch.reserved:
                self._events.append((seq.key, self.handoffs.reserved(seq, self._by_seq[seq.seq_id].request_id)))
            for seq in batch.seqs:
                if seq.handoff is not None and seq.handoff.role == "prefill":
                    self.handoffs.scheduled(seq)
            if not len(batch) and not self.handoffs.pending():  # no plan: the dropped ids wait for the next one
                return
            masks = None
            if self.guided:  # the constrained sequences this step samples: all known tokens computed
                sampled = [s for s, n in zip(batch.seqs, batch.num_new) if s.num_computed + n - len(s.draft) == s.num_tokens]
                masks = self.guided.masks([s.seq_id for s in sampled], [s.draft for s in sampled])
            plan = self.plans.build(batch, masks, self.handoffs.take())
            context_lens = [s.num_computed + n for s, n in zip(batch.seqs, batch.num_new)]
            self.scheduler.launched(batch)
            self.stats.schedule_seconds += time.perf_counter() - started
            submitted = time.perf_counter()
            handle = self.executor.submit(plan)
            self._in_flight.push(InFlight(batch, handle, context_lens, time.perf_counter() - submitted),
                                 (s.seq_id for s in batch.seqs))
            if plan.kv is not None and plan.kv.land:
                self._land(plan.kv.land)
            if not len(batch):
                return

    def _land(self, transfers: list[int]) -> None:
        """After submitting a plan that landed `transfers` (the ranks agreed on each before
        the step ran): start each sequence whose KV arrived whole, from its first token;
        fail the others."""
        outcome = self.executor.landed()
        for transfer in transfers:
            landing = self.handoffs.landing.pop(transfer, None)
            if landing is None:
                continue
            seq = landing.seq
            state = self._by_seq[seq.seq_id]
            if outcome.get(transfer):
                self.handoffs.landed(transfer)
                self.scheduler.landed(seq, landing.token_id)
                delta = self._append(state, [landing.token_id], [landing.logprob] if landing.logprob else None)
                if delta is not None:
                    self._events.append((seq.key, delta))
                continue
            self._events.append((seq.key, ErrorReply(
                state.request_id, "unavailable",
                f"the prompt's KV did not arrive whole from prefill replica {seq.handoff.peer} within "
                f"disaggregation.transfer_timeout")))
            self._finish(state)

    def _ahead(self, busy: frozenset[int]) -> frozenset[int]:
        """Overlapped steps: the sequences of the step in flight that the next step may
        take too. Not those whose next step needs their pending token on the driver (a
        grammar's mask, the speculator's drafts), nor a prefill replica's (done once it has
        sampled), nor those whose pending token is their last by length."""
        if not self.overlap or not busy or self.speculator is not None:
            return frozenset()
        limit = self.memory.max_model_len
        return frozenset(
            s.seq_id for s in self.scheduler.running
            if s.seq_id in busy and s.seq_id not in self.guided and s.handoff is None
            and s.num_tokens + s.num_pending - s.prompt_len < s.params.max_tokens
            and s.num_tokens + s.num_pending < limit)

    def _take_events(self) -> list[tuple[Hashable, object]]:
        events, self._events = self._events, []
        return events

    def _draft(self, busy: frozenset[int], share: int | None) -> list[Sequence]:
        """Proposals for the running sequences that decode in the coming step (one token to
        compute); a constrained sequence's cut where its grammar stops allowing them. Returns
        those sequences."""
        if self.speculator is None:
            return []
        seqs = [s for s in self.scheduler.running if s.seq_id not in busy and s.num_uncomputed == 1]
        if share is not None:
            seqs = seqs[:share]
        self.speculator.draft(seqs)
        if self.guided:
            for seq in seqs:
                seq.draft = self.guided.valid_draft(seq.seq_id, seq.draft[:self.speculator.chain])
        return seqs

    def _finish(self, state: RequestState) -> None:
        seq = state.seq
        if seq.handoff is not None:
            self.handoffs.ended(seq)
        self.scheduler.finish(seq)
        self.plans.forget(seq)
        del self.requests[seq.key]
        del self._by_seq[seq.seq_id]
        self.guided.drop(seq.seq_id)
        if self.speculator is not None:
            self.speculator.drop(seq.seq_id)
        self.stats.finished += 1
        if self.observer is not None:
            self.observer.on_finished(state)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (running requests keep theirs); returns how many."""
        return self.scheduler.blocks.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
