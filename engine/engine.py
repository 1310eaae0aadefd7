"""The driver's engine: schedule -> run on the ranks -> postprocess, one step at a time.

Single-threaded by design: only this object mutates scheduler state; the ranks see
immutable plans. The server's step loop and offline `generate` both drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

from meshserve.comm.messages import Delta, SamplingParams
from meshserve.configs.memory import MemoryPlan
from meshserve.configs.schema import SchedulerConfig
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.executor import Executor
from meshserve.engine.output import OutputProcessor, RequestState
from meshserve.engine.plan import PlanBuilder
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.validation import RequestError


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


class Engine:
    def __init__(self, executor: Executor, tokenizer: Tokenizer, memory: MemoryPlan, scheduler: SchedulerConfig,
                 vocab_size: int):
        self.executor = executor
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.memory = memory
        self.scheduler = Scheduler(BlockManager(memory.num_blocks, memory.block_size),
                                   scheduler.max_num_seqs, scheduler.max_batched_tokens)
        self.plans = PlanBuilder()
        self.outputs = OutputProcessor(tokenizer.eos_token_ids, memory.max_model_len)
        self.requests: dict[Hashable, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._next_seq_id = 0
        self.stats = EngineStats()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_request(self, key: Hashable, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stream: bool = True) -> None:
        """Queue a validated request. `key` is unique among live requests."""
        if key in self.requests:
            raise RequestError("duplicate_id", f"request_id {request_id!r} is already running")
        seq = Sequence(self._next_seq_id, key, list(prompt_ids), len(prompt_ids), params)
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
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.plans.forget(seq)
        if not len(batch):  # no plan: the dropped ids wait for the next one
            return []
        plan = self.plans.build(batch)
        scheduled = time.perf_counter()
        result = self.executor.execute(plan)
        executed = time.perf_counter()
        sampled = dict(zip(result.seq_ids, result.token_ids))
        logprobs = dict(zip(result.seq_ids, result.logprobs)) if result.logprobs else {}
        out: list[tuple[Hashable, Delta]] = []
        for seq in self.scheduler.update(batch, sampled):
            state = self._by_seq[seq.seq_id]
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            delta = self.outputs.on_token(state, logprobs.get(seq.seq_id))
            if state.finish_reason is not None:
                self._finish(state)
            if delta is not None:
                out.append((seq.key, delta))
        end = time.perf_counter()
        self.stats.steps += 1
        self.stats.step_seconds += end - start
        self.stats.schedule_seconds += scheduled - start
        self.stats.execute_seconds += executed - scheduled
        self.stats.postprocess_seconds += end - executed
        return out

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

    def shutdown(self) -> None:
        self.executor.shutdown()
