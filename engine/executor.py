"""Runs a StepPlan on the ranks and returns what the sampling rank sampled."""

from __future__ import annotations

from typing import Protocol

from meshserve.comm.messages import StepPlan, StepResult
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
