"""The driver's engine: schedule -> run on the ranks -> postprocess, one step at a time.

Single-threaded by design: only this object mutates scheduler state; the ranks see
immutable plans. The server's step loop and offline `generate` both drive it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

import msgspec

from meshserve.comm.messages import Delta, NewSeq, SamplingParams, encoder
from meshserve.configs.memory import MemoryPlan
from meshserve.configs.schema import SchedulerConfig
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.executor import Executor
from meshserve.engine.output import OutputProcessor, RequestState
from meshserve.engine.plan import PlanBuilder
from meshserve.engine.scheduler import ScheduledBatch, Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.admission import RequestError


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0
    """Scheduling and building the plan."""
    execute_seconds: float = 0.0
    """The executor: this rank's shard of the model, plus the control plane."""
    postprocess_seconds: float = 0.0
    """Appending tokens, stop checks, detokenization."""
    finish_reasons: dict[str, int] = field(default_factory=dict)


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
        """A step finished: each sequence's tokens in context after it, and the step's wall time."""


@dataclass
class InFlight:
    batch: ScheduledBatch
    handle: Any


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, memory: MemoryPlan, scheduler: SchedulerConfig,
                 vocab_size: int, micro_batches: int = 1, cp_size: int = 1):
        """`micro_batches`: steps kept in flight at once (pipeline parallelism); each
        takes its share of the sequences, and no sequence is in two at once. `cp_size`:
        ranks a sequence's tokens are split over (context parallelism)."""
        self.executor = executor
        self.micro_batches = micro_batches
        self._in_flight: deque[InFlight] = deque()
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.memory = memory
        self.scheduler = Scheduler(BlockManager(memory.num_blocks, memory.block_size, cp_size),
                                   scheduler.max_num_seqs, scheduler.max_batched_tokens)
        self.plans = PlanBuilder()
        self.outputs = OutputProcessor(tokenizer.eos_token_ids, memory.max_model_len)
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
        return self.scheduler.has_work() or bool(self._in_flight)

    def add_request(self, key: Hashable, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a validated request. `key` is unique among live requests."""
        if key in self.requests:
            raise RequestError("duplicate_id", f"request_id {request_id!r} is already running")
        try:  # what a plan will carry of it: a request the ranks cannot be sent fails here, alone
            self._encoder.encode(NewSeq(self._next_seq_id, prompt_ids, len(prompt_ids), [], 0, 0, params))
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            raise RequestError("bad_request", f"request {request_id!r} cannot be sent to the ranks: {e}") from None
        seq = Sequence(self._next_seq_id, key, list(prompt_ids), len(prompt_ids), params,
                       cp_local_lens=[0] * self.scheduler.blocks.cp_size)
        self._next_seq_id += 1
        state = RequestState(seq, request_id, stream, self.tokenizer.detokenizer(prompt_ids, params.skip_special_tokens))
        self.requests[key] = state
        self._by_seq[seq.seq_id] = state
        self.scheduler.add(seq)

    def abort(self, key: Hashable) -> Delta | None:
        """Stop a request; returns its final delta (finish_reason "abort"), or None if unknown."""
        state = self.requests.get(key)
        if state is None:
            return None
        delta = self.outputs.abort(state)
        self._finish(state)
        return delta

    def step(self) -> list[tuple[Hashable, Delta]]:
        """Fill the free micro-batch slots, then finish the oldest step in flight."""
        start = time.perf_counter()
        self._fill()
        if not self._in_flight:
            return []
        submitted = time.perf_counter()
        done = self._in_flight.popleft()
        result = self.executor.wait(done.handle)
        executed = time.perf_counter()
        sampled = dict(zip(result.seq_ids, result.token_ids))
        logprobs = dict(zip(result.seq_ids, result.logprobs)) if result.logprobs else {}
        out: list[tuple[Hashable, Delta]] = []
        context_lens = [s.num_computed + n for s, n in zip(done.batch.seqs, done.batch.num_new)]
        for seq in self.scheduler.update(done.batch, sampled):
            state = self._by_seq[seq.seq_id]
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if self.observer is not None:
                self.observer.on_token(seq)
            delta = self.outputs.on_token(state, logprobs.get(seq.seq_id))
            if state.finish_reason is not None:
                self._finish(state)
            if delta is not None:
                out.append((seq.key, delta))
        end = time.perf_counter()
        self.stats.steps += 1
        self.stats.step_seconds += end - start
        self.stats.execute_seconds += executed - submitted
        self.stats.postprocess_seconds += end - executed
        if self.observer is not None:
            self.observer.on_step(done.batch, context_lens, end - start)
        return out

    def _fill(self) -> None:
        """Schedule and submit steps until micro_batches are in flight or nothing is left."""
        while len(self._in_flight) < self.micro_batches:
            started = time.perf_counter()
            busy = frozenset(s.seq_id for f in self._in_flight for s in f.batch.seqs)
            cap = None
            if self.micro_batches > 1:  # an even share of what can run, over the free slots
                ready = sum(1 for s in self.scheduler.running if s.seq_id not in busy) + len(self.scheduler.waiting)
                cap = max(1, math.ceil(ready / (self.micro_batches - len(self._in_flight))))
            batch = self.scheduler.schedule(busy, cap)
            if self.observer is not None and (len(batch) or batch.preempted):
                self.observer.on_scheduled(batch)
            for seq in batch.preempted:
                self.plans.forget(seq)
            if not len(batch):  # no plan: the dropped ids wait for the next one
                return
            plan = self.plans.build(batch)
            scheduled = time.perf_counter()
            self._in_flight.append(InFlight(batch, self.executor.submit(plan)))
            self.stats.schedule_seconds += scheduled - started
            self.stats.execute_seconds += time.perf_counter() - scheduled

    def _finish(self, state: RequestState) -> None:
        seq = state.seq
        self.scheduler.finish(seq)
        self.plans.forget(seq)
        del self.requests[seq.key]
        del self._by_seq[seq.seq_id]
        self.stats.finished += 1
        self.stats.prompt_tokens += seq.prompt_len
        self.stats.generation_tokens += seq.num_output_tokens
        reason = state.finish_reason or "abort"
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        if self.observer is not None:
            self.observer.on_finished(state)

    def shutdown(self) -> None:
        self.executor.shutdown()
