"""Runs a StepPlan on the ranks and returns what the sampling rank sampled."""

from __future__ import annotations

import time
from typing import Protocol

from meshserve.comm.control import DriverChannel
from meshserve.comm.messages import Shutdown, StepPlan, StepResult
from meshserve.engine.model_runner import ModelRunner


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """World size 1: the driver is the only rank."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def shutdown(self) -> None:
        pass


class DistributedExecutor:
    """World size > 1: the driver publishes each plan to every rank, runs its own shard,
    and takes the tokens from the sampling rank (itself, or over the control plane)."""

    def __init__(self, runner: ModelRunner, channel: DriverChannel, result_timeout: float):
        self.runner, self.channel, self.result_timeout = runner, channel, result_timeout
        self.control_seconds = 0.0
        """Publishing plans and waiting for the sampling rank's tokens after our own shard ran."""

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        self.channel.publish(plan)
        self.control_seconds += time.perf_counter() - start
        local = self.runner.execute(plan)
        if self.runner.groups.is_sampler:
            return local
        start = time.perf_counter()
        result = self.channel.recv_result(self.result_timeout)
        self.control_seconds += time.perf_counter() - start
        return result

    def shutdown(self) -> None:
        self.channel.publish(Shutdown("driver finished"))
        self.channel.close()
