"""The pipeline schedule of meshserve.parallel.pipeline without ranks: which sequences a
new micro-batch may take, how many, and how many sends to the next stage stay open."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.groups import AxisGroup
from meshserve.parallel import pipeline
from meshserve.parallel.pipeline import MicroBatches, StageSender


def test_one_micro_batch_has_no_share_and_fills_at_once():
    steps: MicroBatches[str] = MicroBatches(1)
    assert steps.share(10) is None and not steps.full() and len(steps) == 0
    steps.push("a", [1, 2])
    assert steps.full() and steps.busy() == {1, 2}
    assert steps.pop() == "a" and steps.busy() == frozenset() and not steps.full()


def test_each_free_slot_takes_an_even_share_and_no_seq_is_in_two_steps():
    steps: MicroBatches[str] = MicroBatches(3)
    assert steps.share(7) == 3  # ceil(7 / 3 free slots)
    steps.push("a", [0, 1, 2])
    assert steps.share(4) == 2  # 4 not busy over 2 free slots
    with pytest.raises(ValueError, match=r"seqs \[2\] are already in a step in flight"):
        steps.push("b", [2, 3])
    steps.push("b", [3, 4])
    assert steps.busy() == {0, 1, 2, 3, 4}
    assert steps.share(0) == 1  # at least one, so a step can always be scheduled
    steps.push("c", [])
    assert steps.full()
    with pytest.raises(ValueError, match="no slot to share"):
        steps.share(5)
    with pytest.raises(ValueError, match="already in flight"):
        steps.push("d", [9])
    assert [steps.pop(), steps.pop()] == ["a", "b"]  # oldest first
    assert steps.busy() == frozenset() and len(steps) == 1


def test_micro_batches_must_be_positive():
    with pytest.raises(ValueError, match="micro_batches=0"):
        MicroBatches(0)


class FakeWork:
    def __init__(self, log: list[int], n: int):
        self.log, self.n = log, n

    def wait(self) -> None:
        self.log.append(self.n)


def test_stage_sender_waits_for_the_oldest_sends_beyond_its_bound(monkeypatch):
    sent: list[torch.Tensor] = []
    waited: list[int] = []

    def fake_send(x, group):
        sent.append(x)
        return [FakeWork(waited, len(sent) - 1)]

    monkeypatch.setattr(pipeline, "send_to_next_stage", fake_send)
    sender = StageSender(AxisGroup.single("pp"), max_pending=2)
    for i in range(5):
        sender.send(torch.full((2,), float(i)))
    assert [int(x[0]) for x in sent] == [0, 1, 2, 3, 4]
    assert waited == [0, 1, 2]  # the two newest are still open
