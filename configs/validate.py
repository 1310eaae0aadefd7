"""Checks of a configuration against its model, run before any rank starts.

Each message quotes the numbers and, where it can, the values that would work.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshserve.configs.adapters import AdapterError, check_adapter
from meshserve.configs.cpu_bind import cpu_bind_problems
from meshserve.configs.cpu_features import CpuFeatures, cpu_features, usable_cores
from meshserve.configs.errors import ConfigError
from meshserve.configs.heads_file import file_problem, read_metadata, tree_problem
from meshserve.configs.model_info import ModelInfo, read_model_info
from meshserve.configs.quantization import Quantization
from meshserve.configs.schema import (CacheConfig, ClusterConfig, Config, LoraConfig, ModelConfig, ParallelConfig,
                                      SpeculativeConfig)

DEFAULT_MAX_MODEL_LEN = 8192


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _or_list(values: list) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def valid_tensor_sizes(info: ModelInfo) -> list[int]:
    """tp must divide the query heads; KV heads are sharded (tp divides them) or replicated
    (tp a multiple of them)."""
    kv = info.num_key_value_heads
    return [t for t in divisors(info.num_attention_heads)
            if ((kv % t == 0) or (t % kv == 0)) and info.intermediate_size % t == 0]


def resolved_max_model_len(config: Config, info: ModelInfo) -> int:
    return config.model.max_model_len or min(info.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def cluster_problems(config: Config, info: ModelInfo | None = None) -> list[str]:
    """The nodes must hold every replica's ranks exactly, every tensor-parallel group
    (consecutive ranks, TP innermost) must sit inside one node, and so must every replica
    (several replicas share a node, none is split over two)."""
    p, cluster = config.parallel, config.cluster
    world = config.total_ranks
    sizes = f"{p.sizes()} = {config.world_size}"
    if p.data > 1:
        sizes = f"{p.sizes(with_data=True)} = {world}"
    if cluster.ranks_per_node is None and world % cluster.nodes:
        return [f"cluster.nodes={cluster.nodes} does not divide the world size ({sizes}) "
                f"(try cluster.nodes {_or_list(divisors(world))}, or set cluster.ranks_per_node)"]
    problems = []
    per_node = config.ranks_per_node
    if cluster.nodes * per_node != world:
        problems.append(f"cluster.nodes={cluster.nodes} x cluster.ranks_per_node={per_node} = "
                        f"{cluster.nodes * per_node} ranks, but the world size is {sizes}")
    if per_node % p.tensor:
        fits = [t for t in divisors(per_node) if t <= p.tensor and (info is None or t in valid_tensor_sizes(info))]
        problems.append(f"parallel.tensor={p.tensor} does not divide cluster.ranks_per_node={per_node}: a tensor-"
                        f"parallel group would span nodes (tensor groups stay inside a node, pipeline stages may "
                        f"cross nodes; try parallel.tensor {_or_list(fits)} with more pipeline stages, or more "
                        f"ranks per node)")
    if p.data > 1 and not problems and per_node % config.world_size:
        problems.append(f"parallel.data={p.data}: a replica of {config.world_size} ranks ({p.sizes().split(' = ')[0]}) "
                        f"does not fit whole in cluster.ranks_per_node={per_node}: each replica runs on one "
                        f"node (set cluster.ranks_per_node to a multiple of {config.world_size})")
    return problems


def control_plane_problems(config: Config) -> list[str]:
    """Across nodes the control plane crosses a network: it needs server.secret (CURVE), or
    an explicit cluster.insecure_control_plane. The check sees MESHSERVE_SECRET: the
    launcher fills server.secret from it before validating."""
    cluster = config.cluster
    if cluster.nodes == 1 or config.server.secret is not None or cluster.insecure_control_plane:
        return []
    return [f"cluster.nodes={cluster.nodes} without server.secret: the control plane between the nodes would be "
            f"plain TCP, so whoever reaches the driver's ports reads every prompt and can forge step results; "
            f"set server.secret (or the environment variable MESHSERVE_SECRET) to the same long random value on "
            f"every node, which encrypts it (CURVE), or set cluster.insecure_control_plane=true on a private "
            f"network you trust"]


def client_security_problems(config: Config) -> list[str]:
    if config.server.curve and config.server.secret is None:
        return ["server.curve=true needs server.secret (or MESHSERVE_SECRET): the CURVE keys are derived from it"]
    return []


LOCAL_HOSTS = ("127.", "localhost", "[::1]", "::1")


def _exposed(address: str | None) -> bool:
    """Whether a server address listens beyond this machine (tcp on another interface)."""
    if address is None or "://" in address and not address.startswith("tcp://"):
        return False  # off, ipc:// or inproc://
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return not host.startswith(LOCAL_HOSTS)


def exposure_warnings(config: Config) -> list[str]:
    """Servers listening beyond this machine with nothing asked of their clients: legal
    (a private network may be trusted), but said before start-up."""
    out = []
    if _exposed(config.server.zmq) and config.server.secret is None:
        out.append(f"server.zmq={config.server.zmq} listens beyond this machine without server.secret (or "
                   f"MESHSERVE_SECRET): anyone who reaches it can generate")
    if _exposed(config.server.http) and config.server.api_key is None:
        out.append(f"server.http={config.server.http} listens beyond this machine without server.api_key (or "
                   f"MESHSERVE_API_KEY, or --api-key): anyone who reaches it can generate")
    return out


def kernel_problems(config: Config, cpu: CpuFeatures | None = None) -> list[str]:
    """device.kernels=triton needs CUDA and triton (looked up, not imported: no torch
    here); device.kernels=cpu needs the CPU; device.cpu_isa a build this CPU runs."""
    cpu = cpu or cpu_features()
    isa = config.device.cpu_isa
    if config.device.type == "cpu" and isa != "auto" and not cpu.runs(isa):
        return [f"device.cpu_isa={isa}: this CPU ({cpu.describe()}) cannot run that build of meshserve's C++ kernels "
                f"(use device.cpu_isa {_or_list(['auto', *cpu.runnable_isas])})"]
    if config.device.kernels == "cpu" and config.device.type != "cpu":
        return [f"device.kernels=cpu is meshserve's C++ kernel for the CPU, not for device.type={config.device.type} "
                f"(use device.kernels=auto, triton or torch)"]
    if config.device.kernels != "triton":
        return []
    if config.device.type != "cuda":
        return [f"device.kernels=triton needs device.type=cuda, not {config.device.type} (Triton runs on CPU only in "
                f"its interpreter, for tests; use device.kernels=torch or auto)"]
    if importlib.util.find_spec("triton") is None:
        return ["device.kernels=triton but triton is not installed (pip install 'meshserve[gpu]', or use "
                "device.kernels=auto to fall back to torch)"]
    return []


def kv_cache_problems(config: Config) -> list[str]:
    """cache.dtype=int8 is read by the torch and cpu backends, on the CPU, without context
    parallelism (whose ring passes the cache's rows as they are)."""
    if config.cache.dtype == "auto":
        return []
    problems = []
    if config.device.type != "cpu" or config.device.kernels == "triton":
        problems.append(f"cache.dtype={config.cache.dtype} is read by the CPU kernels; device.type="
                        f"{config.device.type} with device.kernels={config.device.kernels} needs cache.dtype=auto")
    if config.parallel.context > 1:
        problems.append(f"cache.dtype={config.cache.dtype} with parallel.context={config.parallel.context}: context "
                        f"parallelism needs cache.dtype=auto")
    return problems


def quantization_problems(config: Config, info: ModelInfo, cpu: CpuFeatures | None = None) -> list[str]:
    """Quantization runs on CPU kernels; int4 groups of 32 must tile every linear layer's
    input on every tensor-parallel rank; w8a8 calibrates on whole models (no pipeline or
    context parallelism) and needs VNNI."""
    quantization, tp = config.model.quantization, config.parallel.tensor
    if quantization is Quantization.NONE:
        return []
    if config.device.type != "cpu":
        return [f"model.quantization={quantization} runs on CPU kernels; device.type={config.device.type} needs "
                f"model.quantization=none"]
    cpu = cpu or cpu_features()
    if quantization is Quantization.W8A8 and not cpu.vnni:
        # NOTE: without VNNI oneDNN's u8 x s8 product sums pairs in 16 bits (vpmaddubsw), which
        # saturate on 8-bit activations, or runs a reference loop: wrong logits, and orders of
        # magnitude slower than float32.
        return [f"model.quantization=w8a8 multiplies through oneDNN's u8 x s8 kernel, which needs VNNI "
                f"(AVX512-VNNI, AVX-VNNI or AMX); this CPU has {cpu.describe()}: use model.quantization=int8 "
                f"or int4 for few streams, or none (float32) for batches"]
    if quantization is Quantization.W8A8:
        spread = {"parallel.pipeline": config.parallel.pipeline, "parallel.context": config.parallel.context}
        return [f"model.quantization=w8a8 calibrates on one forward of the whole model on each rank, but {name} = "
                f"{size}; use {name}=1 or model.quantization=int8" for name, size in spread.items() if size > 1]
    if quantization is not Quantization.INT4:
        return []
    inputs = {"hidden_size": info.hidden_size,
              "num_attention_heads * head_dim / parallel.tensor": info.num_attention_heads * info.head_dim // tp,
              "intermediate_size / parallel.tensor": info.intermediate_size // tp}
    return [f"model.quantization=int4 quantizes groups of 32 inputs, but {name} = {size} is not a multiple of 32 "
            f"(use model.quantization=int8)" for name, size in inputs.items() if size % 32]


def expert_problems(config: Config, info: ModelInfo) -> list[str]:
    """parallel.expert splits the experts of a mixture-of-experts model evenly; each expert's
    intermediate dimension (and the shared expert's) is split over parallel.tensor."""
    p, moe = config.parallel, info.moe
    if moe is None:
        return [f"parallel.expert={p.expert} splits the experts of a mixture-of-experts model, but {info.architecture} "
                f"has none (use parallel.expert=1)"] if p.expert > 1 else []
    problems = []
    if moe.num_experts % p.expert:
        problems.append(f"parallel.expert={p.expert} does not divide num_experts={moe.num_experts} "
                        f"(try {_or_list(divisors(moe.num_experts))})")
    for name, size in (("moe_intermediate_size", moe.intermediate_size),
                       ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size)):
        if size % p.tensor:
            problems.append(f"parallel.tensor={p.tensor} does not divide {name}={size}")
    if p.expert > 1 and p.context > 1:
        problems.append(f"parallel.expert={p.expert} with parallel.context={p.context}: expert parallelism runs "
                        f"with tensor and pipeline parallelism only (set parallel.context=1)")
    quantization = config.model.quantization
    if quantization is Quantization.W8A8:
        problems.append("model.quantization=w8a8 calibrates its smoothing on dense MLPs; the experts of "
                        f"{info.architecture} would go uncalibrated (use model.quantization=int8 or int4)")
    elif quantization is Quantization.INT4 and (moe.intermediate_size // p.tensor) % 32:
        problems.append(f"model.quantization=int4 quantizes groups of 32 inputs, but moe_intermediate_size / "
                        f"parallel.tensor = {moe.intermediate_size // p.tensor} is not a multiple of 32 "
                        f"(use model.quantization=int8)")
    if config.device.compile is True:
        problems.append(f"device.compile=true with the experts of {info.architecture}: which experts run depends on "
                        f"the data, which the compiled decode step cannot trace (set device.compile=false)")
    return problems


def draft_config(config: Config, info: ModelInfo) -> Config:
    """The config the draft model (speculative.method=draft) runs under: one rank on the
    driver, its own dtype, quantization and KV cache, the target's context length and tokenizer.
    An unquantized draft's `auto` dtype is the target's resolved one (a quantized draft's, the
    quantized kernels' bfloat16)."""
    spec = config.speculative
    dtype = config.torch_dtype_name if spec.dtype == "auto" and spec.quantization == Quantization.NONE else spec.dtype
    return config.model_copy(update={
        "model": ModelConfig(path=spec.model, dtype=dtype, quantization=spec.quantization,
                             tokenizer=config.model.tokenizer, max_model_len=resolved_max_model_len(config, info)),
        "parallel": ParallelConfig(),
        "device": config.device.model_copy(update={"compile": False, "cpu_bind": "none"}),
        "cache": CacheConfig(block_size=config.cache.block_size, memory=spec.draft_memory, prefix_caching=False),
        "speculative": SpeculativeConfig(),
        "scheduler": config.scheduler.model_copy(update={"overlap": False}),  # the proposer reads each step
        "cluster": ClusterConfig(),
        "lora": LoraConfig()})  # the draft proposes without the request's adapter; the target verifies with it


def speculative_problems(config: Config, info: ModelInfo) -> list[str]:
    """A rejected draft's K/V is rolled back by the block tables; with context parallelism
    every rank would also have to roll back its share of the sequence. A draft model must
    share the target's vocabulary and context, and run where the target runs."""
    spec = config.speculative
    if spec.method == "none":
        return []
    if config.parallel.context > 1:
        return [f"speculative.method={spec.method} with parallel.context={config.parallel.context}: context "
                f"parallelism splits each sequence's tokens over its ranks, and rejected drafts are not rolled "
                f"back there; use speculative.method=none or parallel.context=1"]
    if spec.method == "medusa":
        return heads_problems(config, info)
    if spec.method != "draft":
        return []
    try:
        draft = read_model_info(spec.model)
    except ConfigError as e:
        return [f"speculative.model: {e}"]
    problems = []
    if draft.vocab_size != info.vocab_size:
        problems.append(f"speculative.model has a vocabulary of {draft.vocab_size} tokens, the model "
                        f"{info.vocab_size}: a draft must share the model's tokenizer")
    if not problems:
        try:
            check_config(draft_config(config, info), "speculative.model", draft)
        except ConfigError as e:
            problems.append(str(e))
    return problems


def heads_problems(config: Config, info: ModelInfo) -> list[str]:
    """Medusa heads must be a heads file (meshserve.layers.medusa) for this model's hidden
    size and vocabulary; they read the base model's hidden state, which LoRA adapters change."""
    path = Path(config.speculative.heads).expanduser()
    try:
        meta = read_metadata(path)
    except (OSError, ValueError) as e:
        return [f"speculative.heads={path}: not a readable safetensors file ({e})"]
    problem = file_problem(meta, info.hidden_size, info.vocab_size)
    problems = [f"speculative.heads={path}: {problem}"] if problem else []
    tree = config.speculative.tree
    if not problem and tree is not None:
        problem = tree_problem(tree, int(meta["num_heads"]))
        if problem:
            problems.append(f"speculative.tree: {problem}")
    if config.lora.active:
        problems.append("speculative.method=medusa with LoRA adapters: the heads read the base model's hidden "
                        "state (serve adapters without heads, or heads without adapters)")
    return problems


def disaggregation_problems(config: Config) -> list[str]:
    d, p = config.disaggregation, config.parallel
    if not d.enabled:
        return []
    problems = []
    replicas = d.replicas or p.data
    if d.prefill_replicas >= replicas:
        problems.append(f"disaggregation.prefill_replicas={d.prefill_replicas} leaves no decode replica of "
                        f"parallel.data={replicas} (at most {replicas - 1})")
    if p.context > 1:
        problems.append(f"disaggregation.prefill_replicas={d.prefill_replicas} with parallel.context={p.context}: "
                        f"KV transfer sends whole blocks of one rank, and context parallelism spreads a sequence's "
                        f"blocks over ranks")
    if config.speculative.method == "draft":
        problems.append("disaggregation with speculative.method=draft: the draft model's own cache would need the "
                        "prompt too (use speculative.method=ngram)")
    return problems


def lora_problems(config: Config, info: ModelInfo) -> list[str]:
    """LoRA adapters (lora.*): the model and topology they go with, and each adapter named at start."""
    lora = config.lora
    if not lora.active:
        return []
    if info.moe is not None:
        return [f"lora with a mixture-of-experts model ({info.architecture}): adapters are served on dense models"]
    problems = []
    if config.disaggregation.enabled:
        problems.append("lora with disaggregated prefill/decode: a prompt's KV depends on its adapter, which the "
                        "decode replica would have to match (serve adapters on replicas that serve requests whole)")
    for name, path in lora.adapters.items():
        try:
            check_adapter(name, path, info, lora.max_rank)
        except (AdapterError, OSError, ValueError) as e:
            problems.append(f"lora.adapters: {e}")
    return problems


def join_problems(config: Config) -> list[str]:
    """A replica that joins a `meshserve router` (router.join)."""
    r = config.router
    if r.join is None:
        return []
    problems = []
    if config.server.secret is None:
        problems.append(f"router.join={r.join} needs server.secret (or MESHSERVE_SECRET), the router's: it admits "
                        f"only replicas that know it")
    if config.parallel.data > 1:
        problems.append(f"router.join with parallel.data={config.parallel.data}: a replica that joins a router is "
                        f"one replica (start one per launcher job)")
    if config.disaggregation.enabled:
        problems.append("router.join with disaggregated prefill/decode: a router's replicas serve requests whole")
    if config.server.zmq.startswith(("ipc://", "inproc://")) and r.advertise is None:
        problems.append(f"router.join with server.zmq={config.server.zmq}: the router reaches replicas over TCP "
                        f"(set a tcp:// server.zmq, or router.advertise)")
    if r.heartbeat_timeout <= r.heartbeat_interval:
        problems.append(f"router.heartbeat_timeout={r.heartbeat_timeout:g} must exceed router.heartbeat_interval="
                        f"{r.heartbeat_interval:g}")
    return problems


def check_config(config: Config, source: str = "<builtin default>", info: ModelInfo | None = None) -> ModelInfo:
    """Validate `config` against the model it names; returns the model's facts."""
    try:
        info = info or read_model_info(config.model.path)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    problems: list[str] = []
    tp, pp = config.parallel.tensor, config.parallel.pipeline
    heads, kv = info.num_attention_heads, info.num_key_value_heads
    if heads % tp:
        problems.append(
            f"parallel.tensor={tp} does not divide num_attention_heads={heads} (try {_or_list(valid_tensor_sizes(info))})"
        )
    elif kv % tp and tp % kv:
        problems.append(
            f"parallel.tensor={tp} neither divides num_key_value_heads={kv} (to shard them) nor is a multiple of it "
            f"(to replicate them) (try {_or_list(valid_tensor_sizes(info))})"
        )
    if info.intermediate_size % tp:
        problems.append(f"parallel.tensor={tp} does not divide intermediate_size={info.intermediate_size}")
    if config.parallel.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel=true splits a step's tokens over the tensor-parallel ranks, "
                        "but parallel.tensor=1 (set parallel.tensor > 1, or sequence_parallel false)")
    if pp > info.num_hidden_layers:
        problems.append(f"parallel.pipeline={pp} exceeds num_hidden_layers={info.num_hidden_layers}")
    split = config.parallel.pipeline_layers
    if split is not None and len(split) != pp:
        problems.append(f"parallel.pipeline_layers has {len(split)} entries {split}, one per stage needed "
                        f"(parallel.pipeline={pp})")
    elif split is not None and sum(split) != info.num_hidden_layers:
        problems.append(f"parallel.pipeline_layers={split} sums to {sum(split)}, not num_hidden_layers="
                        f"{info.num_hidden_layers}")
    max_len = resolved_max_model_len(config, info)
    if max_len > info.max_position_embeddings:
        problems.append(
            f"model.max_model_len={max_len} exceeds the model's max_position_embeddings={info.max_position_embeddings}"
        )
    if info.sliding_window is not None and max_len > info.sliding_window:
        problems.append(
            f"model.max_model_len={max_len} exceeds sliding_window={info.sliding_window}; sliding-window attention "
            f"is not implemented, so set model.max_model_len <= {info.sliding_window}"
        )
    problems += cluster_problems(config, info)
    problems += control_plane_problems(config)
    problems += client_security_problems(config)
    problems += join_problems(config)
    if config.device.type == "cpu" and config.model.dtype == "float16":
        problems.append("model.dtype=float16 is not supported on device.type=cpu (use float32 or bfloat16)")
    problems += kernel_problems(config)
    if config.device.type == "cpu":
        problems += cpu_bind_problems(config.device.cpu_bind, config.ranks_per_node, usable_cores())
    problems += quantization_problems(config, info)
    problems += kv_cache_problems(config)
    problems += speculative_problems(config, info)
    problems += disaggregation_problems(config)
    problems += expert_problems(config, info)
    problems += lora_problems(config, info)
    if config.device.compile is True and (config.device.type != "cpu" or config.world_size > 1):
        problems.append(f"device.compile=true runs on one CPU rank; here device.type={config.device.type} and "
                        f"{config.world_size} ranks (parallel.tensor={tp}, parallel.pipeline={pp}, "
                        f"parallel.context={config.parallel.context}): collectives are not traced")
    problems += overlap_problems(config)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return info


def overlap_blockers(config: Config) -> list[str]:
    """What rules out overlapped steps (scheduler.overlap) in `config`."""
    p = config.parallel
    found = []
    if p.pipeline > 1:
        found.append(f"parallel.pipeline={p.pipeline} (its micro-batches already keep {p.num_micro_batches} "
                     f"steps in flight)")
    if p.context > 1:
        found.append(f"parallel.context={p.context}")
    if p.expert > 1:
        found.append(f"parallel.expert={p.expert}")
    if config.disaggregation.enabled:
        found.append("disaggregation.enabled=true")
    return found


def overlap_problems(config: Config) -> list[str]:
    blockers = overlap_blockers(config)
    if config.scheduler.overlap is True and blockers:
        return [f"scheduler.overlap=true needs one pipeline stage, no context or expert parallelism and no "
                f"disaggregation; here {', '.join(blockers)} (set scheduler.overlap to auto or false)"]
    return []
