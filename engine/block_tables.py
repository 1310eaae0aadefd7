"""A rank's block tables kept between steps, one row per sequence of one int64 array (vLLM
v1's block table): each plan writes only the blocks it adds (or cuts), and a step's tables
are one gather of its rows, where building them from the sequences' lists walked every
block of the batch each step. The Triton backend's metadata reads these rows
(layers/triton_backend.py build_triton_metadata); entries past a sequence's blocks are stale
and never read."""

from __future__ import annotations

import numpy as np

from meshserve.comm.messages import StepPlan
from meshserve.layers.slot_pool import SlotPool


class BlockTables:
    def __init__(self, width: int, rows: int = 16):
        """`width`: the most blocks a sequence holds (the table widens if one holds more)."""
        self.table = np.zeros((rows, max(1, width)), dtype=np.int64)
        self._rows = SlotPool(rows)
        self._written: dict[int, int] = {}
        """Entries of each sequence's row that hold its blocks."""

    def __len__(self) -> int:
        return len(self._rows.of)

    def apply(self, plan: StepPlan) -> None:
        """Before the plan's step: forget the sequences it drops or sends whole (their rows
        are written afresh), and cut each row the plan cuts (speculative drafts rejected)."""
        for seq_id in (*plan.dropped, *(n.seq_id for n in plan.new)):
            if self._rows.drop(seq_id):
                del self._written[seq_id]
        for d in plan.running:
            if d.num_blocks >= 0 and d.seq_id in self._written:
                self._written[d.seq_id] = min(self._written[d.seq_id], d.num_blocks)

    def rows(self, seq_ids: list[int], block_ids: list[list[int]]) -> np.ndarray:
        """The (len(seq_ids), width) tables of a step's sequences, after writing each one's
        blocks past those its row holds (`block_ids`: each sequence's whole list)."""
        index = np.empty(len(seq_ids), dtype=np.int64)
        for i, (seq_id, blocks) in enumerate(zip(seq_ids, block_ids)):
            row = self._rows.of.get(seq_id)
            if row is None:
                row, grew = self._rows.take(seq_id)
                if grew:
                    self.table = np.pad(self.table, ((0, self._rows.size - len(self.table)), (0, 0)))
                self._written[seq_id] = 0
            written = self._written[seq_id]
            if len(blocks) > written:
                if len(blocks) > self.table.shape[1]:
                    self.table = np.pad(self.table, ((0, 0), (0, len(blocks) - self.table.shape[1])))
                self.table[row, written:len(blocks)] = blocks[written:]
            self._written[seq_id] = len(blocks)
            index[i] = row
        return self.table[index]
