"""The one way to assemble a rank's share of an engine from a validated config: the
launcher, offline generation, the scripts and the tests all call these.

    runner = build_runner(config, info, memory, groups, device, tokenizer)   # every rank
    engine = build_engine(config, info, memory, executor, tokenizer)         # the driver
    engine = build_single_rank_engine(config, info, memory)                  # both, world size 1
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from meshserve.comm.kv_transfer import TorchKvTransport
from meshserve.configs.memory import MemoryPlan, plan_memory, stage_layer_range, stage_layers
from meshserve.configs.model_info import ModelInfo, read_model_info
from meshserve.configs.schema import Config
from meshserve.configs.validate import draft_config, overlap_blockers
from meshserve.engine.calibration import calibration_ids
from meshserve.engine.engine import Engine
from meshserve.engine.executor import Executor, LocalExecutor
from meshserve.engine.kv_agent import KvAgent
from meshserve.engine.lora.registry import LoraRegistry
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.speculative.draft_model import DraftModelProposer
from meshserve.engine.speculative.heads import HeadsProposer
from meshserve.engine.speculative.policy import DraftPolicy
from meshserve.engine.speculative.proposer import NgramProposer
from meshserve.engine.speculative.speculator import Speculator
from meshserve.engine.speculative.tree import TreeShape
from meshserve.engine.tokenizer import Tokenizer
from meshserve.parallel.topology import Groups

KV_PAIR_TIMEOUT_S = 7 * 24 * 3600.0
"""A KV pair group's own timeout: a receive waits as long as its prefill may take (and ends
when the peer's process does); the decode replica's landing has its own deadline."""


def build_runner(config: Config, info: ModelInfo, memory: MemoryPlan, groups: Groups, device: str,
                 tokenizer: Tokenizer | None = None, show_progress: bool = False) -> ModelRunner:
    """This rank's shard of the model, its KV cache and its kernels. `tokenizer`: for w8a8's
    calibration prompts (a rank without one reads them from the model's files)."""
    device_cfg = config.device
    return ModelRunner(info, memory, groups, device, show_progress=show_progress,
                       layer_counts=stage_layers(config, info), kernels=device_cfg.kernels, cpu_isa=device_cfg.cpu_isa,
                       compile_decode=decode_compile(config, info), calibration=calibration_ids(config, info, tokenizer),
                       expert_exchange=config.parallel.expert_exchange,
                       decode_graphs=config.scheduler.max_num_seqs if uses_decode_graphs(config) else 0,
                       compile_in_background=not device_cfg.compile_wait, overlap=uses_overlap(config),
                       lora=(config.lora.max_loras, config.lora.max_rank) if config.lora.active else None,
                       sequence_parallel_min_tokens=config.parallel.sequence_parallel_min_tokens
                       if config.parallel.sequence_parallel else None,
                       heads=config.speculative.heads if config.speculative.method == "medusa" else None,
                       tree=config.speculative.tree if config.speculative.method == "medusa" else None)


def decode_compile(config: Config, info: ModelInfo) -> bool | str:
    """device.compile as the runner takes it: `auto` stays `auto` (the runner decides by its
    eager path) only where a compile can run, one CPU rank of a model without experts
    (configs/validate.py refuses `true` elsewhere); there it is False."""
    setting = config.device.compile
    if setting == "auto" and (config.device.type != "cpu" or config.world_size > 1 or info.moe is not None):
        return False
    return setting


def uses_overlap(config: Config) -> bool:
    """scheduler.overlap resolved: `auto` is on CUDA where nothing rules it out
    (configs/validate.py refuses `true` there)."""
    setting = config.scheduler.overlap
    if setting == "auto":
        return config.device.type == "cuda" and not overlap_blockers(config)
    return setting


def uses_decode_graphs(config: Config) -> bool:
    """CUDA graphs for decode steps: on CUDA, one stage, no context or expert parallelism,
    no KV transfer (its sends run between the layers)."""
    p = config.parallel
    return (config.device.type == "cuda" and config.device.cuda_graphs and p.pipeline == 1 and p.context == 1
            and p.expert == 1 and not config.disaggregation.enabled)


def build_engine(config: Config, info: ModelInfo, memory: MemoryPlan, executor: Executor,
                 tokenizer: Tokenizer) -> Engine:
    """The driver's engine over `executor` (the ranks, or this process alone)."""
    return Engine(executor, tokenizer, memory, config.scheduler, info.vocab_size,
                  micro_batches=config.parallel.num_micro_batches, cp_size=config.parallel.context,
                  prefix_caching=config.cache.prefix_caching, speculator=build_speculator(config, info, memory),
                  role=replica_role(config), overlap=uses_overlap(config), loras=build_loras(config, info))


def build_loras(config: Config, info: ModelInfo) -> LoraRegistry | None:
    """The LoRA adapters served, those of lora.adapters registered (checked at start-up)."""
    if not config.lora.active:
        return None
    registry = LoraRegistry(info, config.lora.max_loras, config.lora.max_rank)
    for name, path in config.lora.adapters.items():
        registry.register(name, path)
    return registry


def replica_role(config: Config) -> str | None:
    """This replica's role in disaggregated prefill/decode ("prefill" or "decode"), or None."""
    d = config.disaggregation
    if not d.enabled or d.replica is None:
        return None
    return "prefill" if d.replica < d.prefill_replicas else "decode"


def attach_kv_transfer(config: Config, info: ModelInfo, memory: MemoryPlan, groups: Groups, runner: ModelRunner) -> None:
    """Disaggregated prefill/decode: connect this rank to the ranks with its place in every
    replica of the other role (each pair a torch.distributed group of its own, met through
    the front door's store), and give the runner its KvAgent. Pairs connect in one global
    order (prefill replica, then decode replica), so no two ranks wait on each other."""
    role = replica_role(config)
    if role is None:
        return
    d = config.disaggregation
    host, port = d.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=config.cluster.rendezvous_timeout))

    def name(replica: int) -> str:
        return f"replica{replica}/rank{groups.global_rank}"

    transport = TorchKvTransport(name(d.replica), store, timeout_s=KV_PAIR_TIMEOUT_S, interface=config.cluster.interface)
    peers = range(d.prefill_replicas, d.replicas) if role == "prefill" else range(d.prefill_replicas)
    for peer in peers:
        transport.connect(name(peer))
    transport.watch([name(peer) for peer in peers])
    counts = stage_layers(config, info)
    runner.kv = KvAgent(transport, name, runner.kv_caches, stage_layer_range(counts, groups.pp.rank)[0],
                        info.num_hidden_layers, memory.block_size, -(-memory.max_model_len // memory.block_size),
                        runner.device, groups.world_size, d.transfer_timeout)


def build_speculator(config: Config, info: ModelInfo, memory: MemoryPlan) -> Speculator | None:
    """The driver's proposer and draft policy (config.speculative), or None. A draft model
    is loaded here, on the driver (meshserve.engine.speculative.draft_model)."""
    spec = config.speculative
    if spec.method == "none":
        return None
    tree = None
    if spec.method == "draft":
        draft = draft_config(config, info)
        draft_info = read_model_info(spec.model)
        runner = build_runner(draft, draft_info, plan_memory(draft, draft_info), Groups.single(), config.device.type)
        proposer = DraftModelProposer(runner)
    elif spec.method == "medusa":
        proposer = HeadsProposer()
        tree = TreeShape(spec.tree) if spec.tree else None
    else:
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return Speculator(proposer, DraftPolicy(spec.num_speculative_tokens, spec.adaptive), memory.max_model_len, tree)


def build_single_rank_engine(config: Config, info: ModelInfo, memory: MemoryPlan, *, threads: int | None = None,
                             show_progress: bool = False) -> Engine:
    """World size 1, in this process (offline generation, scripts, tests)."""
    if config.world_size != 1:
        raise ValueError(f"a single-rank engine for a config of world size {config.world_size}: "
                         f"`meshserve serve` starts its ranks")
    if threads:
        torch.set_num_threads(threads)
    tokenizer = Tokenizer(info, config.model.tokenizer)
    runner = build_runner(config, info, memory, Groups.single(), config.device.type, tokenizer, show_progress)
    return build_engine(config, info, memory, LocalExecutor(runner), tokenizer)
