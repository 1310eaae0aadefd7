"""What every rank does with a StepPlan: update its mirror of the sequences, build the
flat input batch, run its shard of the model, and (on the sampling rank) sample.

The mirror only ever changes through plans, so every rank holds the same token ids
and block tables as the driver without asking it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import time
from collections import deque

import torch

from meshserve.comm.collectives import recv_from_prev_stage, send_to_next_stage
from meshserve.comm.messages import RankStats, SamplingParams, StepPlan, StepResult
from meshserve.configs.memory import MemoryPlan, stage_layer_range
from meshserve.configs.model_info import ModelInfo
from meshserve.engine.compiled_decode import CompiledDecode
from meshserve.layers.backend import select_backend
from meshserve.layers import kv_quant
from meshserve.layers.context_attention import CPSeqStep, build_cp_metadata
from meshserve.parallel.context import advance, chunk_owners, is_split
from meshserve.layers.loader import build_model
from meshserve.layers.sampler import Sampler, SamplingRow
from meshserve.parallel.topology import Groups

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resident_memory() -> tuple[int, int]:
    """(resident bytes now, highest so far) of this process, from /proc (0, 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return 0, 0

    def size(key: str) -> int:
        return int(fields.get(key, "0 kB").split()[0]) * 1024

    return size("VmRSS"), size("VmHWM")


@dataclass
class RankSeq:
    """A rank's copy of one sequence."""

    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int
    params: SamplingParams
    local_lens: list[int]
    """Context parallelism: tokens each rank of the group holds."""
    local_positions: list[int] = field(default_factory=list)
    """Context parallelism: positions of the tokens this rank holds, ascending."""


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
    meta: object
    """AttentionMetadata, or ContextParallelMetadata with a context-parallel group."""
    sample_rows: list[int]
    """Rows of the flat batch whose hidden state is sampled (last token of a finished chunk)."""
    sample_seq_ids: list[int]
    sampling: list[SamplingRow]


class ModelRunner:
    MAX_PENDING_SENDS = 4
    """Activations sent to the next stage and not yet known to be received."""

    def __init__(self, info: ModelInfo, memory: MemoryPlan, groups: Groups, device: str = "cpu",
                 sampler_seed: int | None = None, show_progress: bool = False,
                 layer_counts: list[int] | None = None, kernels: str = "auto", compile_decode: bool = False,
                 calibration: list[int] | None = None, cpu_isa: str = "auto"):
        """`layer_counts`: layers per pipeline stage (default: all on one stage). `kernels`:
        the config's device.kernels (auto | torch | triton | cpu). `compile_decode`: run decode
        steps through torch.compile (engine/compiled_decode.py), compiled here.
        `calibration`: token ids w8a8 calibrates on (engine/calibration.py). `cpu_isa`: the
        build of the C++ CPU kernels (device.cpu_isa: auto | avx512 | avx2 | scalar)."""
        self.info, self.memory, self.groups = info, memory, groups
        self.device = torch.device(device)
        self.dtype = DTYPES[memory.dtype]
        counts = layer_counts or [info.num_hidden_layers]
        if len(counts) != groups.pp.size:
            raise ValueError(f"{len(counts)} stage layer counts for {groups.pp.size} pipeline stages")
        self.model = build_model(info, groups.tp, self.dtype, device=self.device, max_position=memory.max_model_len,
                                 layer_range=stage_layer_range(counts, groups.pp.rank),
                                 is_first_stage=groups.pp.is_first, is_last_stage=groups.pp.is_last,
                                 show_progress=show_progress, cp=groups.cp,
                                 backend=select_backend(kernels, self.device, cpu_isa), quantization=memory.quantization,
                                 calibration=calibration)
        self._pending_sends: deque = deque()
        model = self.model.model
        heads = model.layers[0].self_attn.local_num_kv_heads if len(model.layers) else 1
        int8 = memory.kv_dtype == "int8"
        shape = (memory.num_blocks, memory.block_size, heads, kv_quant.row_length(info.head_dim) if int8 else info.head_dim)
        cache_dtype = torch.int8 if int8 else self.dtype
        # Zeros, not empty: attention masks unwritten slots, but 0 * NaN would still be NaN.
        self.kv_caches = [(torch.zeros(shape, dtype=cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=cache_dtype, device=self.device)) for _ in model.layers]
        self.compiled = None
        if compile_decode:
            self.compiled = CompiledDecode(self.model)
            self.compiled.warm_up(self.model.backend, self.kv_caches, memory.block_size, self.device)
        self.sampler = Sampler(info.eos_token_ids, sampler_seed) if groups.is_sampler else None
        self.seqs: dict[int, RankSeq] = {}
        self.stats = RunnerStats()
        self.ready_rss_bytes = resident_memory()[0]

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
            if n.num_computed and self.groups.cp.size > 1:
                raise ValueError(f"seq {n.seq_id}: a cached prefix with context parallelism is not supported")
            seq = RankSeq(list(n.token_ids), n.prompt_len, list(n.block_ids), n.num_computed, n.params,
                          [0] * self.groups.cp.size)
            self.seqs[n.seq_id] = seq
            batch.append((n.seq_id, seq, n.num_new))
        return batch

    def prepare(self, batch: list[tuple[int, RankSeq, int]]) -> StepInputs:
        """This rank's flat batch: every new token (one rank per context), or with context
        parallelism this rank's share of the long chunks and all of the short ones."""
        if self.groups.cp.size > 1:
            return self._prepare_cp(batch)
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        inputs = StepInputs(None, None, None, [], [], [])  # type: ignore[arg-type]
        for seq_id, seq, n in batch:
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(seq.block_ids)
            if end == len(seq.token_ids):
                self._add_sample(inputs, len(ids) - 1, seq_id, seq)
        inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        inputs.meta = self.model.backend.build_metadata(query_lens, seq_lens, block_tables, self.memory.block_size,
                                                        self.device)
        return inputs

    def _prepare_cp(self, batch: list[tuple[int, RankSeq, int]]) -> StepInputs:
        cp = self.groups.cp
        ids: list[int] = []
        positions: list[int] = []
        steps: list[CPSeqStep] = []
        inputs = StepInputs(None, None, None, [], [], [])  # type: ignore[arg-type]
        for seq_id, seq, n in batch:
            start = seq.num_computed
            owners = chunk_owners(seq.local_lens, n)
            split = is_split(n, cp.size)
            mine = [start + i for i, o in enumerate(owners) if o == cp.rank]
            queries = mine if split else list(range(start, start + n))
            row0 = len(ids)
            ids.extend(seq.token_ids[p] for p in queries)
            positions.extend(queries)
            held = seq.local_lens[cp.rank]
            stored_rows = list(range(row0, row0 + len(mine))) if split else [row0 + p - start for p in mine]
            seq.local_positions.extend(mine)
            seq.local_lens = advance(seq.local_lens, owners)
            steps.append(CPSeqStep(row0, queries, split, seq.block_ids, seq.local_positions, seq.local_lens,
                                   stored_rows, list(range(held, held + len(mine)))))
            # the last token of a split chunk is in the last segment, which is cp rank 0's
            if start + n == len(seq.token_ids) and cp.rank == 0:
                self._add_sample(inputs, len(ids) - 1, seq_id, seq)
        inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        inputs.meta = build_cp_metadata(steps, cp.rank, self.memory.block_size, self.dtype, self.device)
        return inputs

    def sampled_after(self, plan: StepPlan) -> list[tuple[int, SamplingParams]]:
        """(seq_id, params) of the sequences of `plan`, just executed, that the sampling rank
        sampled: those whose known tokens are all computed now, in batch order (what `prepare`
        picks, on any rank, since every mirror holds the same tokens and counts)."""
        ids = [d.seq_id for d in plan.running] + [n.seq_id for n in plan.new]
        return [(i, self.seqs[i].params) for i in ids if self.seqs[i].num_computed == len(self.seqs[i].token_ids)]

    @staticmethod
    def _add_sample(inputs: StepInputs, row: int, seq_id: int, seq: RankSeq) -> None:
        inputs.sample_rows.append(row)
        inputs.sample_seq_ids.append(seq_id)
        inputs.sampling.append(SamplingRow(seq.params, len(seq.token_ids), seq.prompt_len))

    def busy_seconds(self) -> float:
        """Time computing this rank's shard: the forward and sampling, less the waits for
        (and sends to) other pipeline stages."""
        return self.stats.forward_seconds + self.stats.sample_seconds - self.groups.pp.timer.seconds

    def rank_stats(self, wall_seconds: float, steps: int) -> RankStats:
        rss, peak = resident_memory()
        return RankStats(self.groups.global_rank, self.busy_seconds(), wall_seconds, steps, rss, peak,
                         self.ready_rss_bytes, self.groups.cp.timer.seconds, self.groups.cp.timer.exposed_seconds)

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
        prepared = time.perf_counter()
        pp = self.groups.pp
        received = None
        if not pp.is_first:  # (num_tokens, hidden_size): the previous stage's hidden + residual
            received = recv_from_prev_stage((len(inputs.input_ids), self.info.hidden_size), self.dtype,
                                            self.device, pp)
        forward = self.compiled if self.compiled is not None and self.compiled.applies(inputs.meta) else self.model
        hidden, residual = forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, hidden=received)
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
