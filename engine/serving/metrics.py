"""Prometheus metrics of a serving driver, fed by the engine's observer hooks.

Everything lives on a registry of its own (never prometheus_client's global one), so two
servers in one process, or a test, never share counters. The hooks run on the step loop's
thread; `/metrics` reads the registry from the HTTP thread (prometheus_client locks).

Latencies follow vLLM's definitions, timed at the engine: queue time (arrival to first
scheduled), TTFT (arrival to first token), inter-token latency (between consecutive tokens
of a request), TPOT (a finished request's (last token - first token) / (tokens - 1)), and
end-to-end latency (arrival to finish). Per-step MFU and MBU set the model's FLOPs and bytes
of that step (engine/perf.py ModelCost) against the deployment's peak figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.configs.memory import DTYPE_BYTES
from meshserve.configs.quantization import Quantization
from meshserve.engine.engine import Engine
from meshserve.engine.output_processor import RequestState
from meshserve.engine.perf import ModelCost, measure_matmul_peak, measure_memory_bandwidth
from meshserve.engine.scheduler import ScheduledBatch
from meshserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from meshserve.layers.kernels.cpu_library import CpuLibrary

log = logging.getLogger(__name__)

PREFIX = "meshserve_"

# Buckets as vLLM's, so dashboards built for it read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Roofline:
    """Peak figures of the whole deployment (all ranks), and where they came from."""

    peak_flops: float
    memory_bandwidth: float
    source: str


def measure_roofline(dtype, device: str, world_size: int, peak_flops: float | None = None,
                     memory_bandwidth: float | None = None, quantization: Quantization = Quantization.NONE,
                     library: CpuLibrary | None = None) -> Roofline:
    """Measure what the config does not give: this process's matmul peak in `dtype` (of the
    product `quantization` and `library` choose, engine/perf.py) and its read bandwidth,
    scaled to the deployment.

    NOTE: FLOPs scale with the world size (each rank has its own cores or GPU). Bandwidth does
    on GPUs (each has its own memory) but not on one CPU node, whose ranks share its memory."""
    measured = []
    if peak_flops is None:
        peak_flops = measure_matmul_peak(dtype, n=1024, repeats=3, device=device, quantization=quantization,
                                         library=library) * world_size
        measured.append("peak_flops")
    if memory_bandwidth is None:
        per_process = measure_memory_bandwidth(64 << 20, repeats=3, device=device)
        memory_bandwidth = per_process * (world_size if device != "cpu" else 1)
        measured.append("memory_bandwidth")
    return Roofline(peak_flops, memory_bandwidth, f"measured {', '.join(measured)}" if measured else "config")


RANK_STATS_INTERVAL_S = 1.0


@dataclass
class _Times:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


def _priority_label(priority: int) -> str:
    """A bounded label: a client may send any 32-bit priority."""
    return str(priority) if -16 <= priority <= 16 else "other"


class EngineMetrics:
    """The Prometheus side of one server. Implements the engine's EngineObserver."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per finished request: (last token - first token) / (tokens - 1)", registry=r,
                              buckets=TOKEN_BUCKETS)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             registry=r, buckets=TOKEN_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish of finished requests",
                             registry=r, buckets=REQUEST_BUCKETS)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled", registry=r,
                               buckets=REQUEST_BUCKETS)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)", registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=r)
        self.prompt_computed = Counter(PREFIX + "prompt_tokens_computed", "Prompt tokens run through the model (not "
                                       "those found in the prefix cache or received from a prefill replica)",
                                       registry=r)
        self.finished = Counter(PREFIX + "request_success", "Requests finished, by reason", ["finished_reason"],
                                registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries", "Tokens of admitted prompts looked up in the "
                                      "prefix cache", registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Of those, tokens found in the prefix cache",
                                   registry=r)
        self.prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate", "prefix_cache_hits over prefix_cache_queries "
                                     "since the start (0-1)", registry=r)
        self._prefix_seen = (0, 0)
        self.steps = Counter(PREFIX + "engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Counter(PREFIX + "engine_step_seconds", "Wall time inside engine steps", registry=r)
        self.flops = Counter(PREFIX + "model_flops", "Model FLOPs computed (all ranks)", registry=r)
        self.bytes_read = Counter(PREFIX + "model_bytes_read", "Weight and KV bytes read (all ranks)", registry=r)
        self.mfu = Gauge(PREFIX + "model_flops_utilization", "Last step's model FLOP/s over the peak (0-1)", registry=r)
        self.mbu = Gauge(PREFIX + "memory_bandwidth_utilization", "Last step's bytes read/s over the bandwidth (0-1)",
                         registry=r)
        self.peak_flops = Gauge(PREFIX + "peak_flops", "The FLOP/s behind MFU", registry=r)
        self.peak_bandwidth = Gauge(PREFIX + "peak_memory_bandwidth_bytes", "The bytes/s behind MBU", registry=r)
        self.rank_busy = Gauge(PREFIX + "rank_busy_ratio", "Fraction of wall time each rank computes its shard "
                               "(pipeline stage occupancy)", ["rank"], registry=r)
        self.rank_busy_seconds = Gauge(PREFIX + "rank_busy_seconds", "Seconds each rank has computed its shard "
                                       "(grows like a counter: rate() over a window is the recent occupancy)",
                                       ["rank"], registry=r)
        self.rank_memory = Gauge(PREFIX + "rank_resident_memory_bytes", "Resident memory of each rank", ["rank"],
                                 registry=r)
        self.expert_tokens = Gauge(PREFIX + "expert_tokens", "(token, expert) pairs each rank's experts computed "
                                   "(mixture-of-experts models; grows like a counter: the expert-parallel load)",
                                   ["rank"], registry=r)
        self.expert_comm_seconds = Gauge(PREFIX + "expert_comm_seconds", "Seconds each rank spent exchanging tokens "
                                         "over its expert-parallel group (all-to-all and all-gather)", ["rank"],
                                         registry=r)
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Sequence-steps that verified proposed tokens",
                                   registry=r)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Proposed tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in their draft (0: first)",
                                             ["position"], registry=r)
        self.spec_acceptance = Gauge(PREFIX + "spec_decode_acceptance_rate", "spec_decode_num_accepted_tokens over "
                                     "spec_decode_num_draft_tokens since the start (0-1)", registry=r)
        self.spec_mean_length = Gauge(PREFIX + "spec_decode_mean_accepted_length", "Tokens per verified draft since "
                                      "the start: its accepted tokens plus the one sampled after them", registry=r)
        self.lora_requests = Counter(PREFIX + "lora_requests", "Requests finished, by LoRA adapter", ["adapter"],
                                     registry=r)
        self.lora_prompt_tokens = Counter(PREFIX + "lora_prompt_tokens", "Prompt tokens of admitted requests, by LoRA "
                                          "adapter", ["adapter"], registry=r)
        self.lora_generation_tokens = Counter(PREFIX + "lora_generation_tokens", "Tokens generated, by LoRA adapter",
                                              ["adapter"], registry=r)
        self.lora_served = Gauge(PREFIX + "lora_adapters_served", "LoRA adapters requests may name", registry=r)
        self.lora_resident = Gauge(PREFIX + "lora_adapters_loaded", "LoRA adapters whose weights sit in the ranks' "
                                   "slots (lora.max_loras)", registry=r)
        self.lora_loads = Gauge(PREFIX + "lora_adapter_loads", "LoRA adapters loaded into a slot since the start",
                                registry=r)
        self.lora_evictions = Gauge(PREFIX + "lora_adapter_evictions", "LoRA adapters evicted from their slot (least "
                                    "recently used, unused) since the start", registry=r)
        self.priority_requests = Counter(PREFIX + "priority_requests", "Requests finished, by priority (scheduler."
                                         "policy priority; beyond +-16: 'other')", ["priority"], registry=r)
        self.priority_ttft = Histogram(PREFIX + "priority_time_to_first_token_seconds", "Arrival to first token, by "
                                       "priority (scheduler.policy priority)", ["priority"], registry=r,
                                       buckets=TTFT_BUCKETS)
        self.priority_preemptions = Gauge(PREFIX + "priority_preemptions", "Running requests preempted for a waiting "
                                          "one of a better rank since the start", registry=r)
        self._cost: ModelCost | None = None
        self._roofline: Roofline | None = None
        self._by_priority = False
        self._times: dict[int, _Times] = {}
        self._engine: Engine | None = None
        self._ranks_read = 0.0

    def attach(self, engine: Engine, cost: ModelCost | None = None, roofline: Roofline | None = None) -> None:
        """Observe `engine`. Gauges of its queues read it when scraped (len() is atomic)."""
        sched = engine.scheduler
        self.running.set_function(lambda: len(sched.running))
        self.waiting.set_function(lambda: len(sched.waiting))
        self.kv_usage.set_function(lambda: sched.blocks.usage)
        blocks = sched.blocks
        self.prefix_hit_rate.set_function(lambda: blocks.hit_tokens / blocks.query_tokens if blocks.query_tokens else 0.0)
        runner = engine.executor.runner
        if runner.kv is not None:
            self._kv_transfer_gauges(runner.kv.stats)
        self._cost, self._roofline = cost, roofline
        if roofline is not None:
            self.peak_flops.set(roofline.peak_flops)
            self.peak_bandwidth.set(roofline.memory_bandwidth)
        if engine.loras is not None:
            loras = engine.loras
            self.lora_served.set_function(lambda: len(loras.adapters))
            self.lora_resident.set_function(lambda: len(loras.slots.resident))
            self.lora_loads.set_function(lambda: loras.slots.loads)
            self.lora_evictions.set_function(lambda: loras.slots.evictions)
        self._by_priority = sched.priority_aging is not None
        if self._by_priority:
            self.priority_preemptions.set_function(lambda: sched.num_priority_preemptions)
        if engine.speculator is not None:
            stats = engine.speculator.stats
            self.spec_acceptance.set_function(lambda: stats.acceptance_rate)
            self.spec_mean_length.set_function(lambda: stats.mean_accepted_length)
        engine.observer = self
        self._engine = engine

    # ------------------------------------------------------------------ EngineObserver

    def on_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.seq_id not in self._times:  # first scheduled (not a resume after preemption)
                self._times[seq.seq_id] = _Times(seq.arrival_time)
                self.queue.observe(now - seq.arrival_time)
                self.prompt_tokens.inc(seq.prompt_len)
                if seq.lora is not None:
                    self.lora_prompt_tokens.labels(seq.lora.name).inc(seq.prompt_len)
        if batch.preempted:
            self.preemptions.inc(len(batch.preempted))
        if self._engine is not None:
            blocks = self._engine.scheduler.blocks
            queries, hits = self._prefix_seen
            self.prefix_queries.inc(blocks.query_tokens - queries)
            self.prefix_hits.inc(blocks.hit_tokens - hits)
            self._prefix_seen = (blocks.query_tokens, blocks.hit_tokens)

    def on_token(self, seq: Sequence) -> None:
        now = time.monotonic()
        t = self._times.get(seq.seq_id)
        if t is None:
            return
        if t.first_token is None:
            t.first_token = now
            self.ttft.observe(now - t.arrival)
            if self._by_priority:
                self.priority_ttft.labels(_priority_label(seq.priority)).observe(now - t.arrival)
        else:
            self.itl.observe(now - t.last_token)
        t.last_token = now
        self.generation_tokens.inc()
        if seq.lora is not None:
            self.lora_generation_tokens.labels(seq.lora.name).inc()

    def on_verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        for position in range(accepted):
            self.spec_accepted_per_pos.labels(str(position)).inc()

    def on_finished(self, state: RequestState) -> None:
        t = self._times.pop(state.seq.seq_id, None)
        reason = state.finish_reason or "abort"
        self.finished.labels(reason).inc()
        if state.seq.lora is not None:
            self.lora_requests.labels(state.seq.lora.name).inc()
        if self._by_priority:
            self.priority_requests.labels(_priority_label(state.seq.priority)).inc()
        if t is None or reason == "abort":
            return
        self.e2e.observe(time.monotonic() - t.arrival)
        n = state.seq.num_output_tokens
        if n > 1 and t.first_token is not None:
            self.tpot.observe((t.last_token - t.first_token) / (n - 1))

    def on_step(self, batch: ScheduledBatch, context_lens: list[int], seconds: float) -> None:
        self.steps.inc()
        computed = sum(max(0, min(s.prompt_len, end) - (end - n)) for s, n, end in zip(batch.seqs, batch.num_new, context_lens))
        if computed:
            self.prompt_computed.inc(computed)
        self.step_seconds.inc(seconds)
        self._maybe_read_ranks()
        if self._cost is None:
            return
        cost = self._cost
        flops = sum(cost.flops(n, max(n, ctx)) for n, ctx in zip(batch.num_new, context_lens))
        # every weight once per step, and each sequence's K/V of its whole context
        nbytes = cost.weight_bytes + cost.kv_bytes_per_token * sum(context_lens)
        self.flops.inc(flops)
        self.bytes_read.inc(nbytes)
        if self._roofline is not None and seconds > 0:
            self.mfu.set(flops / seconds / self._roofline.peak_flops)
            self.mbu.set(nbytes / seconds / self._roofline.memory_bandwidth)

    def _kv_transfer_gauges(self, stats) -> None:
        """Disaggregated prefill/decode: the driver rank's KV transfers (engine/kv_agent.py
        KvStats; with tensor or pipeline parallelism each rank moves its own shard too)."""
        r = self.registry
        moved = Gauge(PREFIX + "kv_transfer_bytes", "KV bytes this rank sent (prefill) or landed (decode)",
                      ["direction"], registry=r)
        moved.labels("sent").set_function(lambda: stats.bytes_sent)
        moved.labels("received").set_function(lambda: stats.bytes_received)
        count = Gauge(PREFIX + "kv_transfers", "KV transfers sent whole, landed, or failed to land", ["outcome"],
                      registry=r)
        count.labels("sent").set_function(lambda: stats.transfers_sent)
        count.labels("landed").set_function(lambda: stats.transfers_landed)
        count.labels("failed").set_function(lambda: stats.transfers_failed)
        seconds = Gauge(PREFIX + "kv_transfer_seconds", "Prefill: transfers' first send to last completion "
                        "(total), the part while their steps still computed (overlapped), and posting sends on the "
                        "step's thread (posting); decode: steps held waiting for transfers (land_wait)", ["part"],
                        registry=r)
        seconds.labels("total").set_function(lambda: stats.transfer_seconds)
        seconds.labels("overlapped").set_function(lambda: stats.overlapped_seconds)
        seconds.labels("posting").set_function(lambda: stats.send_seconds)
        seconds.labels("land_wait").set_function(lambda: stats.land_wait_seconds)

    def on_idle(self) -> None:
        self._maybe_read_ranks()

    def _maybe_read_ranks(self) -> None:
        """Every RANK_STATS_INTERVAL_S, take in the ranks' counters: after steps, and while
        idle too (the last ones a burst of requests left)."""
        now = time.monotonic()
        if self._engine is not None and now - self._ranks_read >= RANK_STATS_INTERVAL_S:
            self._ranks_read = now
            self._read_ranks()

    def _read_ranks(self) -> None:
        """Every rank's occupancy and memory, from the counters they send the driver (read
        on the step loop's thread, which owns the control plane)."""
        for rank, stats in self._engine.executor.rank_stats().items():
            self.rank_busy_seconds.labels(str(rank)).set(stats.busy_seconds)
            if stats.wall_seconds > 0:
                self.rank_busy.labels(str(rank)).set(stats.busy_seconds / stats.wall_seconds)
            self.rank_memory.labels(str(rank)).set(stats.rss_bytes)
            if stats.expert_tokens:
                self.expert_tokens.labels(str(rank)).set(stats.expert_tokens)
                self.expert_comm_seconds.labels(str(rank)).set(stats.ep_seconds)


def serving_metrics(info, dtype_name: str, device: str, world_size: int, peak_flops: float | None,
                    memory_bandwidth: float | None, engine: Engine, metrics: EngineMetrics,
                    quantization: Quantization = Quantization.NONE, kv_dtype: str = "auto") -> Roofline:
    """Measure (or take) the roofline and attach `metrics` to `engine`; returns the roofline."""
    import torch

    if peak_flops is None or memory_bandwidth is None:
        log.info("measuring the roofline for the MFU/MBU gauges (server.metrics.peak_flops and "
                 "memory_bandwidth skip it)")
    matmuls = engine.executor.runner.model.matmuls  # the products the model runs (layers.matmul_plan)
    roofline = measure_roofline(getattr(torch, dtype_name), device, world_size, peak_flops, memory_bandwidth,
                                quantization, matmuls.library)
    kept, dense = matmuls.kept_in_bf16()
    stored = 2 if dense and kept == dense else None  # a float32 model's bf16 numbers kept in bf16
    metrics.attach(engine, ModelCost(info, DTYPE_BYTES[dtype_name], quantization, kv_dtype, stored), roofline)
    log.info("MFU/MBU roofline (%s): %.3g FLOP/s, %.3g bytes/s", roofline.source, roofline.peak_flops,
             roofline.memory_bandwidth)
    return roofline
