"""What every rank does with a StepPlan: apply it to its mirror of the sequences
(engine/mirror.py), build the flat input batch, run its shard of the model, and (on the
sampling rank) sample.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshserve.comm.collectives import broadcast_from_tp, recv_from_prev_stage, reduce_from_tp
from meshserve.comm.messages import RankStats, SamplingParams, StepPlan, StepResult, TokenLogprob, TokenMasks
from meshserve.configs.memory import MemoryPlan, stage_layer_range
from meshserve.configs.model_info import ModelInfo
from meshserve.engine.block_tables import BlockTables
from meshserve.engine.decode_path import DecodePath
from meshserve.engine.kv_agent import KvAgent
from meshserve.engine.lora.rank_adapters import RankAdapters, lora_kernel
from meshserve.engine.mirror import MirrorSeq, ScheduledChunk, SequenceMirror
from meshserve.engine.pending_result import PendingResult
from meshserve.engine.speculative.tree import TreeShape, accept_path, row_skips, tree_paths
from meshserve.engine.speculative.verify import accept
from meshserve.layers import kv_quant
from meshserve.layers.backend import StepMetadata, select_backend
from meshserve.layers.fused_decode import fused_decode_layers
from meshserve.layers.medusa import MedusaHeads
from meshserve.layers import prompt_logprobs
from meshserve.layers.attention import set_tree_skips
from meshserve.layers.host_memory import zeros_on_touch
from meshserve.layers.kernels import cpu_library
from meshserve.layers.loader import build_model
from meshserve.layers.moe import FusedMoE
from meshserve.layers.prompt_logprobs import PromptSpan
from meshserve.layers.sampler import Sampler, SamplingRow
from meshserve.layers.sampling_state import SamplingState
from meshserve.parallel.context import rank_share
from meshserve.parallel.context_attention import CPSeqStep, build_cp_metadata
from meshserve.parallel.pipeline import StageSender
from meshserve.parallel.topology import Groups

log = logging.getLogger(__name__)

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
class RunnerStats:
    prepare_seconds: float = 0.0
    """Building input tensors and attention metadata on the host."""
    forward_seconds: float = 0.0
    """The model's forward (this rank's shard, its collectives included)."""
    sample_seconds: float = 0.0
    """Logits (and their gather) and sampling."""
    deferred_tokens: int = 0
    """Overlapped steps: input tokens taken on the device from the step before."""


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: StepMetadata
    """The model's backend's metadata of this step (layers.backend)."""
    sample_rows: list[int]
    """Rows of the flat batch whose hidden state is sampled (last token of a finished chunk,
    and each draft token after it)."""
    sample_seq_ids: list[int]
    """The sampled sequences, in order."""
    sampling: list[SamplingRow]
    """One per sampled row."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per sampled sequence, the drafts it verifies (its rows: 1 + len(drafts) of them)."""
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    """Rows whose next-token logprobs a sequence's prompt_logprobs asked for."""
    graph_step: tuple | None = None
    """A decode step that replays a captured graph: its (input_ids, positions, seq_lens,
    block_tables) host lists (engine/decode_graphs.py); `meta` is then None."""
    cp_relay: list[int] = field(default_factory=list)
    """Context parallelism: sampled tokens that another rank of the group computed (the last
    token of a split chunk is its owner's); per token, its row on this rank if this rank
    computed it, else -1. Every rank of the group lists the same tokens; their hidden states
    are summed over the group and appended after the batch's rows (sample_rows point there)."""
    deferred: list[tuple[int, int]] = field(default_factory=list)
    """Overlapped steps: (row, seq_id) of each row whose token the previous step sampled
    (SeqDelta.deferred); input_ids holds it, taken on the device."""
    lora: bool = False
    """Rows of the step use LoRA adapters (their slots are set on the model's LoraBatch)."""
    token_slots: list[int] = field(default_factory=list)
    """Per row of the flat batch, its sequence's adapter slot (-1: none), where LoRA is served."""
    sample_slots: list[int] = field(default_factory=list)
    """Per sampled row, its sequence's adapter slot (for the LM head's adapters)."""


@dataclass
class LastSampled:
    """Overlapped steps: what the previous step sampled, kept where it was sampled."""

    row_of: dict[int, int]
    """seq_id -> its row of `tokens` (sequences that verified no drafts)."""
    tokens: torch.Tensor
    """On the device; on every rank of the tensor-parallel group (the sampling rank's, broadcast)."""


class ModelRunner:
    def __init__(self, info: ModelInfo, memory: MemoryPlan, groups: Groups, device: str = "cpu",
                 sampler_seed: int | None = None, show_progress: bool = False,
                 layer_counts: list[int] | None = None, kernels: str = "auto", compile_decode: bool | str = False,
                 calibration: list[int] | None = None, cpu_isa: str = "auto", expert_exchange: str = "all_to_all",
                 decode_graphs: int = 0, compile_in_background: bool = False, overlap: bool = False,
                 lora: tuple[int, int] | None = None, sequence_parallel_min_tokens: int | None = None,
                 heads: str | None = None, tree: list[list[int]] | None = None):
        """`layer_counts`: layers per pipeline stage (default: all on one stage). `kernels`:
        the config's device.kernels (auto | torch | triton | cpu). `compile_decode`: run decode
        steps through torch.compile (engine/compiled_decode.py; engine/decode_path.py chooses);
        "auto": only where the eager steps do not run the fused C++ layers.
        `calibration`: token ids w8a8 calibrates on (engine/calibration.py). `cpu_isa`: the
        build of the C++ CPU kernels (device.cpu_isa: auto | avx512 | avx2 | scalar).
        `expert_exchange`: parallel.expert_exchange (layers.moe). `decode_graphs`: the
        largest batch whose decode steps replay captured graphs (engine/decode_graphs.py;
        0: none); the KV cache then has one more block, the padding rows' scratch.
        `compile_in_background`: compile in a thread of its own while decode steps run
        eagerly, and switch to the graphs once they are ready (device.compile_wait=false).
        `overlap`: the driver overlaps steps (scheduler.overlap): each step's sampled tokens
        stay on the device, on every rank of the tensor-parallel group, for the next step's
        deferred inputs, and `execute` returns the sampling rank's result unread. `lora`:
        (lora.max_loras, lora.max_rank) where the server serves LoRA adapters (engine/lora).
        `sequence_parallel_min_tokens`: parallel.sequence_parallel's line (layers.loader).
        `heads`: the Medusa heads file (speculative.method=medusa), loaded on the last
        pipeline stage, whose ranks return the heads' guesses with each step's tokens. `tree`:
        their candidate tree's paths (speculative.tree; None: a chain): a draft of k tokens
        is its first k nodes (engine/speculative/tree.py)."""
        self.overlap = overlap
        self._last: LastSampled | None = None
        self.info, self.memory, self.groups = info, memory, groups
        self.device = torch.device(device)
        self.dtype = DTYPES[memory.dtype]
        counts = layer_counts or [info.num_hidden_layers]
        if len(counts) != groups.pp.size:
            raise ValueError(f"{len(counts)} stage layer counts for {groups.pp.size} pipeline stages")
        # The C++ CPU kernels (None off the CPU or without a compiler), loaded once and passed to
        # what calls them: the cpu backend, the products, the sampler.
        library = cpu_library.load(cpu_isa) if self.device.type == "cpu" else None
        self.adapters: RankAdapters | None = None
        """The adapters' slots on this rank's layers, where the server serves LoRA adapters."""

        def attach_adapters(model) -> None:
            self.adapters = RankAdapters(model, info, *lora, self.dtype, lora_kernel(self.device, library))
        self.model = build_model(info, groups.tp, self.dtype, device=self.device, max_position=memory.max_model_len,
                                 layer_range=stage_layer_range(counts, groups.pp.rank),
                                 is_first_stage=groups.pp.is_first, is_last_stage=groups.pp.is_last,
                                 show_progress=show_progress, cp=groups.cp,
                                 backend=select_backend(kernels, self.device, library), library=library,
                                 quantization=memory.quantization, calibration=calibration, ep=groups.ep,
                                 expert_exchange=expert_exchange, before_pack=attach_adapters if lora else None,
                                 sequence_parallel_min_tokens=sequence_parallel_min_tokens)
        self.heads = MedusaHeads.load(heads, info.hidden_size, info.vocab_size, self.dtype, self.device) \
            if heads is not None and groups.pp.is_last else None
        self.tree = TreeShape(tree) if tree else None
        self.hidden_tap: Callable[[list[int], torch.Tensor], None] | None = None
        """Called after each step that samples, with the sampling rows' sequence ids and
        final-normed hidden states (rows, hidden_size), on the last pipeline stage: what
        scripts/train_heads.py learns from as the engine generates, instead of computing every
        answer again. A step with drafts has several rows per sequence."""
        if self.heads is not None and self.model.matmuls is not None:
            self.heads.use_products(self.model.matmuls.router)  # the unquantized products of the model's plan
        self.sender = StageSender(groups.pp)
        model = self.model.model
        heads = model.layers[0].self_attn.local_num_kv_heads if len(model.layers) else 1
        int8 = memory.kv_dtype == "int8"
        shape = (memory.num_blocks, memory.block_size, heads, kv_quant.row_length(info.head_dim) if int8 else info.head_dim)
        cache_dtype = torch.int8 if int8 else self.dtype
        fused = fused_decode_layers(self.model) if self.device.type == "cpu" else None
        if compile_decode == "auto":  # the fused layers serve faster than the compiled step (README, AMX)
            compile_decode = self.device.type == "cpu" and fused is None
        if decode_graphs or compile_decode:
            shape = (shape[0] + 1, *shape[1:])  # block num_blocks: the graphs' or the warm-up's scratch
        # Zeros, not empty: attention masks unwritten slots, but 0 * NaN would still be NaN.
        self.kv_caches = [(zeros_on_touch(shape, cache_dtype, self.device),
                           zeros_on_touch(shape, cache_dtype, self.device)) for _ in model.layers]
        self.decode = DecodePath(self.model, fused, self.kv_caches, memory.block_size, memory.num_blocks,
                                 memory.max_model_len, self.device, compile_decode=compile_decode,
                                 compile_in_background=compile_in_background, decode_graphs=decode_graphs)
        """What runs each step's forward (graphs, compiled, fused C++ layers or eager)."""
        self.block_tables = (BlockTables(-(-memory.max_model_len // memory.block_size))
                             if self.model.backend.name == "triton" and groups.cp.size == 1 else None)
        """The Triton backend's block tables, kept between steps (engine/block_tables.py)."""
        self._moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        """Read for each RankStats (every STATS_INTERVAL_S on a follower): found once."""
        self.sampler = (Sampler(info.eos_token_ids, sampler_seed, library, SamplingState(info.vocab_size, self.device))
                        if groups.is_sampler else None)
        self.mirror = SequenceMirror(groups.cp.rank, groups.cp.size, memory.block_size)
        self.stats = RunnerStats()
        self.ready_rss_bytes = resident_memory()[0]
        self.kv: KvAgent | None = None
        """Disaggregated prefill/decode: this rank's KV transfers (engine/kv_agent.py)."""

    def take_landed(self) -> dict[int, bool]:
        """Whether each transfer the last plan landed arrived whole (KvAgent)."""
        return self.kv.take_landed() if self.kv is not None else {}

    def prepare(self, batch: list[ScheduledChunk]) -> StepInputs:
        """This rank's flat batch of a step the mirror applied: every new token (one rank
        per context), or with context parallelism this rank's share of the long chunks and
        all of the short ones."""
        if self.groups.cp.size > 1:
            return self._prepare_cp(batch)
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        inputs = StepInputs(None, None, None, [], [], [])  # type: ignore[arg-type]
        lora_slots: list[int] = []
        skips: list[int] = []
        """Per row, the keys it skips (a tree's rows; layers.attention.set_tree_skips)."""
        for c in batch:
            end = c.start + c.num_new
            tree = self.tree is not None and bool(c.draft)
            if c.seq.params.prompt_logprobs is not None:
                span = prompt_logprobs.prompt_span(c.seq_id, len(ids), c.start, c.num_new, c.seq.token_ids,
                                                   c.seq.prompt_len, c.seq.params.prompt_logprobs)
                if span is not None:
                    inputs.prompt_spans.append(span)
            ids.extend(c.input_ids)
            lora_slots.extend([c.seq.lora_slot] * c.num_new)
            if tree:  # the known tokens, then each node at the last one's position + its depth
                known_end = end - len(c.draft)
                positions.extend(range(c.start, known_end))
                positions.extend(known_end - 1 + d for d in self.tree.depths[:len(c.draft)])
                skips.extend([0] * (known_end - 1 - c.start) + row_skips(self.tree.parents[:len(c.draft)]))
            else:
                positions.extend(range(c.start, end))
                skips.extend([0] * c.num_new)
            query_lens.append(c.num_new)
            seq_lens.append(end)
            block_tables.append(c.seq.block_ids)
            if c.deferred:
                inputs.deferred.append((len(ids) - 1, c.seq_id))
            if c.sampled:
                self._add_sample(inputs, len(ids) - 1 - len(c.draft), c.seq_id, c.seq, c.draft,
                                 self.tree.parents[:len(c.draft)] if tree else None)
        inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        if inputs.deferred:
            self._take_deferred(inputs)
        if self.block_tables is not None:
            block_tables = self.block_tables.rows([c.seq_id for c in batch], block_tables)
        inputs.lora = self._set_adapters(inputs, lora_slots)
        branching = any(skips)
        if not inputs.prompt_spans and not inputs.lora and not branching and self.decode.replays(query_lens):
            inputs.graph_step = (inputs.input_ids, positions, seq_lens, block_tables)
            return inputs
        inputs.meta = self.model.backend.build_metadata(query_lens, seq_lens, block_tables, self.memory.block_size,
                                                        self.device)
        if branching:
            set_tree_skips(inputs.meta, skips)
        return inputs

    def _set_adapters(self, inputs: StepInputs, slots: list[int]) -> bool:
        """Tell the LoRA layers each row's adapter slot; whether any row has one."""
        if self.adapters is None:
            return False
        inputs.token_slots = slots
        self.adapters.batch.set(slots, self.device)
        return self.adapters.batch.slots is not None

    def _logits(self, hidden: torch.Tensor, rows: list[int], slots: list[int] | None) -> torch.Tensor | None:
        """The head's logits of `hidden`'s `rows`, each with its adapter's LM head pair, if
        any (`slots`: per row)."""
        if self.adapters is not None:
            self.adapters.head_batch.set(slots, self.device)
        return self.model.compute_logits(hidden[rows])

    def _take_deferred(self, inputs: StepInputs) -> None:
        """The deferred rows' tokens, from the previous step's on the device (no host wait)."""
        last = self._last
        missing = [s for _, s in inputs.deferred if last is None or s not in last.row_of]
        if missing:
            raise RuntimeError(f"a step defers the tokens of seqs {missing}, which the step before it did not sample")
        rows = torch.tensor([r for r, _ in inputs.deferred], dtype=torch.long, device=self.device)
        src = torch.tensor([last.row_of[s] for _, s in inputs.deferred], dtype=torch.long, device=self.device)
        inputs.input_ids[rows] = last.tokens[src]
        self.stats.deferred_tokens += len(inputs.deferred)

    def _keep_sampled(self, tokens: torch.Tensor | None, inputs: StepInputs) -> None:
        """Overlapped steps: keep this step's sampled tokens on the device for the next
        step's deferred rows, on every rank of the tensor-parallel group. `tokens`: the
        sampling rank's (None elsewhere)."""
        if any(inputs.drafts):  # the speculator's sequences wait for their tokens on the driver
            self._last = None
            return
        if self.groups.tp.size > 1:
            if tokens is None:
                tokens = torch.empty(len(inputs.sample_rows), dtype=torch.long, device=self.device)
            tokens = broadcast_from_tp(tokens.to(torch.long).contiguous(), self.groups.tp)
        self._last = LastSampled({s: i for i, s in enumerate(inputs.sample_seq_ids)}, tokens)

    def _prepare_cp(self, batch: list[ScheduledChunk]) -> StepInputs:
        cp = self.groups.cp
        ids: list[int] = []
        positions: list[int] = []
        steps: list[CPSeqStep] = []
        lora_slots: list[int] = []
        inputs = StepInputs(None, None, None, [], [], [])  # type: ignore[arg-type]
        for c in batch:
            share = rank_share(c.start, c.owners, cp.rank, cp.size)
            row0 = len(ids)
            ids.extend(c.seq.token_ids[p] for p in share.queries)
            lora_slots.extend([c.seq.lora_slot] * len(share.queries))
            positions.extend(share.queries)
            # the mirror already counts this step: local_positions and local_lens are those after it
            steps.append(CPSeqStep(row0, share.queries, share.split, c.seq.block_ids, c.seq.local_positions,
                                   c.seq.local_lens, [row0 + r for r in share.stored_rows],
                                   list(range(c.held, c.held + len(share.stored)))))
            if not c.sampled:
                continue
            # the last token of a split chunk is computed by its owner only; else by every rank
            owner = c.owners[-1] if share.split else 0
            if owner == 0:
                if cp.rank == 0:
                    self._add_sample(inputs, len(ids) - 1, c.seq_id, c.seq)
                continue
            inputs.cp_relay.append(len(ids) - 1 if cp.rank == owner else -1)
            if cp.rank == 0:
                self._add_sample(inputs, -len(inputs.cp_relay), c.seq_id, c.seq)
        inputs.sample_rows = [r if r >= 0 else len(ids) - r - 1 for r in inputs.sample_rows]
        inputs.input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        inputs.positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        inputs.meta = build_cp_metadata(steps, cp.rank, self.memory.block_size, self.dtype, self.device)
        inputs.lora = self._set_adapters(inputs, lora_slots)
        return inputs

    def sampled_after(self, plan: StepPlan) -> list[tuple[int, SamplingParams, int]]:
        """(seq_id, params, drafts verified) of the sequences of `plan`, just executed, that the sampling rank
        sampled: those whose known tokens are all computed now, in batch order (what `prepare`
        picks, on any rank, since every mirror holds the same tokens and counts)."""
        return self.mirror.sampled_after(plan)

    def _relay_samples(self, hidden: torch.Tensor, relay: list[int]) -> torch.Tensor:
        """`hidden` with the relayed tokens' hidden states appended (StepInputs.cp_relay)."""
        rows = hidden.new_zeros(len(relay), hidden.shape[-1])
        for k, row in enumerate(relay):
            if row >= 0:
                rows[k] = hidden[row]
        return torch.cat([hidden, reduce_from_tp(rows, self.groups.cp)])

    @staticmethod
    def _add_sample(inputs: StepInputs, row: int, seq_id: int, seq: MirrorSeq, draft: list[int] = (),
                    parents: list[int] | None = None) -> None:
        """Sample `seq` at `row`, and after each of its `draft` tokens in the rows after it:
        each row as if the drafts before it were the sequence's (its length, its tokens);
        with `parents` (a tree's), the drafts before a node are those of its path."""
        inputs.sample_seq_ids.append(seq_id)
        inputs.drafts.append(list(draft))
        known = len(seq.token_ids)
        if parents is None:
            tokens = seq.token_ids + list(draft) if draft else seq.token_ids
            histories = [(known + j, tokens) for j in range(len(draft) + 1)]
        else:
            paths = tree_paths(draft, parents)
            histories = [(known, seq.token_ids)] + [(known + len(p), seq.token_ids + p) for p in paths]
        for j, (length, tokens) in enumerate(histories):
            inputs.sample_rows.append(row + j)
            inputs.sample_slots.append(seq.lora_slot)
            inputs.sampling.append(SamplingRow(seq.params, length, seq.prompt_len, tokens, seq_id, known))

    @staticmethod
    def _first_rows(drafts: list[list[int]]) -> list[int]:
        """Each sequence's first sampled row: a sequence samples its next token's row and one
        after each of its draft tokens, in plan order."""
        starts, row = [], 0
        for draft in drafts:
            starts.append(row)
            row += len(draft) + 1
        return starts

    @staticmethod
    def _grammar_masks(masks: TokenMasks | None, seq_ids: list[int], drafts: list[list[int]],
                       device: torch.device) -> tuple[torch.Tensor | None, list[int] | None]:
        """The plan's grammar masks as an int32 (k, words) tensor, and the sampled row each
        one applies to (engine/structured.py: a sequence's rows in order, its next token's,
        then one after each draft)."""
        if masks is None:
            return None, None
        row_of = dict(zip(seq_ids, ModelRunner._first_rows(drafts)))
        counts = masks.rows or [1] * len(masks.seq_ids)
        bits = torch.frombuffer(bytearray(masks.bits), dtype=torch.int32).view(sum(counts), masks.words)
        keep, rows, first = [], [], 0
        for s, n in zip(masks.seq_ids, counts):
            if s in row_of:
                keep += range(first, first + n)
                rows += range(row_of[s], row_of[s] + n)
            first += n
        return bits[keep].to(device), rows

    def _propose(self, rows: torch.Tensor, tokens: torch.Tensor, last: list[int] | None) -> list[list[int]]:
        """The heads' guesses after each sequence's last kept token, from the hidden state of
        the row that sampled it (`rows`: the step's sampled rows; `tokens`: theirs; `last`:
        each sequence's last kept row among them, None: every row is one sequence's), on the
        sampling rank: a chain of first guesses, or every node of the candidate tree."""
        if last is not None:
            picks = torch.tensor(last, device=rows.device)
            rows, tokens = rows[picks], tokens[picks]
        if self.tree is None:
            return self.heads.guess(rows, tokens).tolist()
        return self.heads.tree_guess(rows, tokens, self.tree.paths).tolist()

    def _verify(self, tokens: list[int], logprobs: list[TokenLogprob | None] | None, drafts: list[list[int]]
                ) -> tuple[list[int], list[TokenLogprob | None] | None, list[int], list[int]]:
        """The tokens (and their logprobs) each sequence keeps of its rows' samples, how many,
        and the row of each one's last kept token (meshserve.engine.speculative.verify; a
        tree's drafts: engine/speculative/tree.py accept_path)."""
        kept_tokens: list[int] = []
        kept_logprobs: list[TokenLogprob | None] = []
        counts, last = [], []
        if self.tree is None:
            counts = accept(tokens, drafts)
            kept = [list(range(row, row + n)) for row, n in zip(self._first_rows(drafts), counts)]
        else:
            kept = []
            for row, draft in zip(self._first_rows(drafts), drafts):
                nodes = accept_path(tokens[row:row + len(draft) + 1], draft, self.tree.parents[:len(draft)])
                kept.append([row] + [row + 1 + n for n in nodes])
                counts.append(len(nodes) + 1)
        for rows in kept:
            kept_tokens.extend(tokens[r] for r in rows)
            if logprobs is not None:
                kept_logprobs.extend(logprobs[r] for r in rows)
            last.append(rows[-1])
        return kept_tokens, kept_logprobs if logprobs is not None else None, counts, last

    def busy_seconds(self) -> float:
        """Time computing this rank's shard: the forward and sampling, less the waits for
        (and sends to) other pipeline stages."""
        return self.stats.forward_seconds + self.stats.sample_seconds - self.groups.pp.timer.seconds

    def rank_stats(self, wall_seconds: float, steps: int) -> RankStats:
        rss, peak = resident_memory()
        return RankStats(self.groups.global_rank, self.busy_seconds(), wall_seconds, steps, rss, peak,
                         self.ready_rss_bytes, self.groups.cp.timer.seconds, self.groups.cp.timer.exposed_seconds,
                         self.expert_tokens(), self.groups.ep.timer.seconds)

    def expert_tokens(self) -> int:
        """(token, expert) pairs this rank's experts have computed (layers.moe), all layers."""
        return sum(m.tokens_computed for m in self._moe_layers)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | PendingResult | None:
        """Run one step. Returns the sampled tokens on the sampling rank (with `overlap`,
        unread: engine/pending_result.py), None elsewhere."""
        start = time.perf_counter()
        if plan.kv is not None and self.kv is not None:
            self.kv.apply(plan.kv)
        if self.sampler is not None:  # a sequence sent again in full is counted afresh
            self.sampler.state.forget([*plan.dropped, *(n.seq_id for n in plan.new)])
        if self.block_tables is not None:
            self.block_tables.apply(plan)
        for load in plan.loras:
            self.adapters.load(load.slot, load.name, load.path)
        batch = self.mirror.apply(plan)
        if not batch:
            self._last = None
            return StepResult(plan.step_id, [], []) if self.sampler else None
        inputs = self.prepare(batch)
        prepared = time.perf_counter()
        pp = self.groups.pp
        received = None
        if not pp.is_first:  # (num_tokens, hidden_size): the previous stage's hidden + residual
            received = recv_from_prev_stage((len(inputs.input_ids), self.info.hidden_size), self.dtype,
                                            self.device, pp)
        sending = self.kv is not None and self.kv.due(batch)
        try:
            hidden, residual = self.decode.run(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                               received, inputs.graph_step,
                                               after_layer=self.kv.after_layer if sending else None,
                                               lora=inputs.lora)
        finally:
            if sending:
                self.kv.after_step()
        if not pp.is_last:
            # NOTE: the next stage's first layer adds hidden and residual before its norm; sending
            # the sum is the same arithmetic with half the bytes.
            self.sender.send(hidden if residual is None else hidden + residual)
        if inputs.cp_relay and self.model.lm_head is not None:
            hidden = self._relay_samples(hidden, inputs.cp_relay)
        forwarded = time.perf_counter()
        self.stats.prepare_seconds += prepared - start
        self.stats.forward_seconds += forwarded - prepared
        if self.model.lm_head is None:  # not the last pipeline stage
            return None
        prompt = None
        if inputs.prompt_spans:
            prompt = prompt_logprobs.compute(
                lambda rows: self._logits(hidden, rows, [inputs.token_slots[r] for r in rows] if inputs.lora else None),
                inputs.prompt_spans, hidden.device)
        if not inputs.sample_rows:
            self._last = None
            return StepResult(plan.step_id, [], [], prompt_logprobs=prompt) if self.sampler else None
        if self.hidden_tap is not None:
            self.hidden_tap(inputs.sample_seq_ids, hidden[inputs.sample_rows])
        logits = self._logits(hidden, inputs.sample_rows, inputs.sample_slots if inputs.lora else None)
        result, tokens, counts, last = None, None, None, None
        if self.sampler is not None:
            bitmask, mask_rows = self._grammar_masks(plan.masks, inputs.sample_seq_ids, inputs.drafts, logits.device)
            sampled = self.sampler.sample(logits, inputs.sampling, bitmask, mask_rows)
            tokens = sampled.tokens
            if any(inputs.drafts):
                token_list, logprobs = sampled.to_lists()
                token_list, logprobs, counts, last = self._verify(token_list, logprobs, inputs.drafts)
        proposals = None
        if self.heads is not None and self.sampler is not None:
            proposals = self._propose(hidden[inputs.sample_rows], tokens, last)
        if self.sampler is not None:
            if counts is not None:
                result = StepResult(plan.step_id, inputs.sample_seq_ids, token_list, logprobs, prompt, counts,
                                    proposals)
                self.sampler.state.record(inputs.sample_seq_ids, [tokens for _, tokens, _ in result.per_sequence()])
            else:
                result = PendingResult(plan.step_id, inputs.sample_seq_ids, sampled, prompt, proposals)
                self.sampler.state.record(inputs.sample_seq_ids, tokens)
        if self.overlap:
            self._keep_sampled(tokens, inputs)
        elif isinstance(result, PendingResult):
            result = result.resolve()
        self.stats.sample_seconds += time.perf_counter() - forwarded
        return result
