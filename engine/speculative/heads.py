"""Proposals of Medusa heads (meshserve.layers.medusa), on the driver.

The target's last pipeline stage runs the heads with every step, on the hidden state of
each sequence's last kept token, and returns their guesses with the step's tokens
(StepResult.proposals); the driver keeps each sequence's latest and proposes them before
its next step. A guess is used only while the sequence is as long as when it was made."""

from __future__ import annotations

from meshserve.engine.sequence import Sequence


class HeadsProposer:
    caught_up = 0
    """The heads run inside the target's own steps: no catching up."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[int, list[int]]] = {}
        """seq_id -> (its length then, the heads' guesses after it)."""

    def received(self, seq: Sequence, guesses: list[int]) -> None:
        """A step ended with `seq` at its current length, and the heads guessed `guesses`."""
        self._latest[seq.seq_id] = (seq.num_tokens, guesses)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, max_tokens):
            latest = self._latest.get(seq.seq_id)
            out.append(list(latest[1][:k]) if latest is not None and latest[0] == seq.num_tokens and k > 0 else [])
        return out

    def backlog(self, seq: Sequence) -> int:
        return 0

    def drop(self, seq_id: int) -> None:
        self._latest.pop(seq_id, None)
