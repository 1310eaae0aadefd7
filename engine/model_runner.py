"""What every rank does with a StepPlan: update its mirror of the sequences, build the
flat input batch, run its shard of the model, and (on the sampling rank) sample.

The mirror only ever changes through plans, so every rank holds the same token ids
and block tables as the driver without asking it.
"""

from __future__ import annotations

from dataclasses import dataclass

import time
from collections import deque

import torch

from meshserve.comm.collectives import recv_from_prev_stage, send_to_next_stage
from meshserve.comm.messages import RankStats, SamplingParams, StepPlan, StepResult
from meshserve.configs.memory import MemoryPlan, stage_layer_range
from meshserve.configs.model_info import ModelInfo
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.loader import build_model
from meshserve.layers.sampler import Sampler, SamplingRow
from meshserve.parallel.topology import Groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankSeq:
    """A rank's copy of one sequence."""

    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int
    params: SamplingParams


@dataclass
class RunnerStats:
    prepare_seconds: float = 0.0
    """Building input tensors and attention metadata on the host."""
    forward_seconds: float = 0.0
    """The model's forward (this rank's shard, its collectives included)."""
    sample_seconds: float = 0.0
    """Logits (and their gather) and sampling."""


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    """Rows of the flat batch whose hidden state is sampled (last token of a finished chunk)."""
    sample_seq_ids: list[int]
    sampling: list[SamplingRow]


class ModelRunner:
    MAX_PENDING_SENDS = 4
    """Activations sent to the next stage and not yet known to be received."""

    def __init__(self, info: ModelInfo, memory: MemoryPlan, groups: Groups, device: str = "cpu",
                 sampler_seed: int | None = None, show_progress: bool = False,
                 layer_counts: list[int] | None = None):
        """`layer_counts`: layers per pipeline stage (default: all on one stage)."""
        self.info, self.memory, self.groups = info, memory, groups
        self.device = torch.device(device)
        self.dtype = DTYPES[memory.dtype]
        counts = layer_counts or [info.num_hidden_layers]
        if len(counts) != groups.pp.size:
            raise ValueError(f"{len(counts)} stage layer counts for {groups.pp.size} pipeline stages")
        self.model = build_model(info, groups.tp, self.dtype, device=self.device, max_position=memory.max_model_len,
                                 layer_range=stage_layer_range(counts, groups.pp.rank),
                                 is_first_stage=groups.pp.is_first, is_last_stage=groups.pp.is_last,
                                 show_progress=show_progress)
        self._pending_sends: deque = deque()
        model = self.model.model
        heads = model.layers[0].self_attn.local_num_kv_heads if len(model.layers) else 1
        shape = (memory.num_blocks, memory.block_size, heads, info.head_dim)
        # Zeros, not empty: attention masks unwritten slots, but 0 * NaN would still be NaN.
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in model.layers]
        self.sampler = Sampler(info.eos_token_ids, sampler_seed) if groups.is_sampler else None
        self.seqs: dict[int, RankSeq] = {}
        self.stats = RunnerStats()

    def apply_plan(self, plan: StepPlan) -> list[tuple[int, RankSeq, int]]:
        """Update the mirror; returns the batch as (seq_id, seq, num_new) in batch order."""
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        batch = []
        for d in plan.running:
            seq = self.seqs[d.seq_id]
            seq.token_ids.extend(d.new_token_ids)
            seq.block_ids.extend(d.new_block_ids)
            batch.append((d.seq_id, seq, d.num_new))
        for n in plan.new:
            seq = RankSeq(list(n.token_ids), n.prompt_len, list(n.block_ids), n.num_computed, n.params)
            self.seqs[n.seq_id] = seq
            batch.append((n.seq_id, seq, n.num_new))
        return batch

    def prepare(self, batch: list[tuple[int, RankSeq, int]]) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        inputs = StepInputs(None, None, [], [], [], [], [], [])  # type: ignore[arg-type]
        for seq_id, seq, n in batch:
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            inputs.query_lens.append(n)
            inputs.seq_lens.append(end)
            inputs.block_tables.append(seq.block_ids)
            if end == len(seq.token_ids):
                inputs.sample_rows.append(len(ids) - 1)
                inputs.sample_seq_ids.append(seq_id)
                inputs.sampling.append(SamplingRow(seq.params, len(seq.token_ids), seq.prompt_len))
        inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        return inputs

    def busy_seconds(self) -> float:
        """Time computing this rank's shard: the forward and sampling, less the waits for
        (and sends to) other pipeline stages."""
        return self.stats.forward_seconds + self.stats.sample_seconds - self.groups.pp.timer.seconds

    def rank_stats(self, wall_seconds: float, steps: int) -> RankStats:
        return RankStats(self.groups.global_rank, self.busy_seconds(), wall_seconds, steps)

    def _send(self, x: torch.Tensor) -> None:
        self._pending_sends.append((x, send_to_next_stage(x, self.groups.pp)))
        while len(self._pending_sends) > self.MAX_PENDING_SENDS:
            _, works = self._pending_sends.popleft()
            for work in works:
                work.wait()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step. Returns the sampled tokens on the sampling rank, None elsewhere."""
        start = time.perf_counter()
        batch = self.apply_plan(plan)
        if not batch:
            return StepResult(plan.step_id, [], []) if self.sampler else None
        inputs = self.prepare(batch)
        meta = build_attention_metadata(inputs.query_lens, inputs.seq_lens, inputs.block_tables,
                                        self.memory.block_size, self.device)
        prepared = time.perf_counter()
        pp = self.groups.pp
        received = None
        if not pp.is_first:  # (num_tokens, hidden_size): the previous stage's hidden + residual
            received = recv_from_prev_stage((len(inputs.input_ids), self.info.hidden_size), self.dtype,
                                            self.device, pp)
        hidden, residual = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, hidden=received)
        for _, seq, n in batch:
            seq.num_computed += n
        if not pp.is_last:
            # NOTE: the next stage's first layer adds hidden and residual before its norm; sending
            # the sum is the same arithmetic with half the bytes.
            self._send(hidden if residual is None else hidden + residual)
        forwarded = time.perf_counter()
        self.stats.prepare_seconds += prepared - start
        self.stats.forward_seconds += forwarded - prepared
        if not inputs.sample_rows or self.model.lm_head is None:
            return StepResult(plan.step_id, [], []) if self.sampler else None
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        result = None
        if self.sampler is not None:
            tokens, logprobs = self.sampler(logits, inputs.sampling)
            result = StepResult(plan.step_id, inputs.sample_seq_ids, tokens, logprobs)
        self.stats.sample_seconds += time.perf_counter() - forwarded
        return result
