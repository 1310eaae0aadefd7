"""Runs a StepPlan on the ranks and returns what the sampling rank sampled."""

from __future__ import annotations

import time
from typing import Any, Protocol

from meshserve.comm.control import DriverChannel
from meshserve.comm.failure import FailureSignal
from meshserve.comm.messages import RankStats, Shutdown, StepPlan, StepResult
from meshserve.comm.step_results import ExpectedResult
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.pending_result import PendingResult, resolved


class Executor(Protocol):
    def submit(self, plan: StepPlan) -> Any:
        """Start the step on every rank (the driver's own shard runs now); returns a handle."""

    def wait(self, handle: Any) -> StepResult:
        """The tokens of a submitted step; steps finish in submission order."""

    def rank_stats(self) -> dict[int, RankStats]:
        """The latest counters of every rank (pipeline stage occupancy)."""

    failure: FailureSignal
    """Triggered once the ranks can no longer serve (comm/failure.py)."""

    runner: ModelRunner
    """The driver's own shard (rank 0): what the metrics read of the model and its KV transfers."""

    def landed(self) -> dict[int, bool]:
        """Disaggregated decode: whether each KV transfer the last submitted plan landed
        arrived whole (every rank agreed before the step ran)."""

    def shutdown(self) -> None: ...


class LocalExecutor:
    """World size 1: the driver is the only rank; a step is done when submit returns."""

    def __init__(self, runner: ModelRunner, failure: FailureSignal | None = None):
        self.runner = runner
        self.started = time.monotonic()
        self.failure = failure or FailureSignal()

    def submit(self, plan: StepPlan) -> StepResult | PendingResult:
        return self.runner.execute(plan)

    def rank_stats(self) -> dict[int, RankStats]:
        return {0: self.runner.rank_stats(time.monotonic() - self.started, 0)}

    def wait(self, handle: StepResult | PendingResult) -> StepResult:
        return resolved(handle)

    def landed(self) -> dict[int, bool]:
        return self.runner.take_landed()

    def shutdown(self) -> None:
        pass


class DistributedExecutor:
    """World size > 1: the driver publishes each plan to every rank, runs its own shard,
    and takes the tokens from the sampling rank (itself, or over the control plane)."""

    def __init__(self, runner: ModelRunner, channel: DriverChannel, result_timeout: float, failure: FailureSignal):
        self.runner, self.channel, self.result_timeout = runner, channel, result_timeout
        self.failure = failure
        """Set when a rank is known dead: waiting for a result gives up at once."""
        self.control_seconds = 0.0
        """Publishing plans and waiting for the sampling rank's tokens after our own shard ran."""
        self.started = time.monotonic()

    def rank_stats(self) -> dict[int, RankStats]:
        """Every rank's latest counters, the driver's own included."""
        self.channel.drain()
        return {0: self.runner.rank_stats(time.monotonic() - self.started, 0), **self.channel.rank_stats}

    def submit(self, plan: StepPlan) -> StepResult | PendingResult | int:
        """Publish `plan` and run the driver's shard; returns the driver's own result when it
        samples, else the step id, whose result the channel then expects from the sampling
        rank in the shape the driver's mirror predicts (comm/step_results.py)."""
        start = time.perf_counter()
        self.channel.publish(plan)
        self.control_seconds += time.perf_counter() - start
        local = self.runner.execute(plan)
        if self.runner.groups.is_sampler:
            return local
        sampled = self.runner.sampled_after(plan)
        self.channel.expect(ExpectedResult(plan.step_id, tuple(seq_id for seq_id, _, _ in sampled),
                                           tuple(params.logprobs for _, params, _ in sampled),
                                           self.runner.info.vocab_size, tuple(k for _, _, k in sampled)))
        return plan.step_id

    def landed(self) -> dict[int, bool]:
        return self.runner.take_landed()

    def wait(self, handle: StepResult | PendingResult | int) -> StepResult:
        if not isinstance(handle, int):
            self.channel.drain()
            return resolved(handle)
        start = time.perf_counter()
        result = self.channel.recv_result(handle, self.result_timeout, check=self.failure.check)
        self.control_seconds += time.perf_counter() - start
        return result

    def shutdown(self) -> None:
        self.channel.publish(Shutdown("driver finished"))
        self.channel.close()
