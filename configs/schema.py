"""The typed configuration tree. One YAML file (or none) -> one frozen `Config`.

Every section forbids unknown keys, so a typo fails before any rank starts. Values
that follow from others (world size, per-rank head counts, number of KV blocks) are
derived elsewhere and are never fields here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, NonNegativeInt, PositiveFloat,
                      PositiveInt, StrictInt, StrictStr, field_validator, model_validator)

from meshserve.configs.cpu_features import CpuFeatures, cpu_features
from meshserve.configs.heads_file import tree_problem
from meshserve.configs.quantization import Quantization

BUILTIN_DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+)(:\d{1,5})?")
"""A web origin as a browser sends it in `Origin`: scheme://host[:port], no path."""


def _parse_quantization(value: Any, auto: bool = False) -> Any:
    """The config's string as a Quantization (with `auto`, that string stays), or one message
    naming them."""
    if isinstance(value, str) and not isinstance(value, Quantization) and not (auto and value == "auto"):
        try:
            return Quantization(value)
        except ValueError:
            names = [q.value for q in Quantization] + (["auto"] if auto else [])
            raise ValueError(f"unknown quantization {value!r} ({', '.join(names)})") from None
    return value


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(Section):
    path: str = BUILTIN_DEFAULT_MODEL
    """HF directory (config.json + *.safetensors), a .gguf file, or `builtin:<name>`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto`: bfloat16 on CUDA, with model.quantization, or on a CPU with bf16 dot products
    (AMX or AVX512-BF16); float32 on other CPUs. The start-up line says which and why."""
    tokenizer: str | None = None
    """Tokenizer directory; by default the model's own (HF directory or GGUF file)."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + output in tokens; by default the model's context, capped at 8192."""
    quantization: Annotated[Quantization | Literal["auto"],
                            BeforeValidator(lambda v: _parse_quantization(v, auto=True))] = Quantization.NONE
    """Quantization of the linear layers (meshserve.configs.quantization), on CPU: `int4`
    (groups of 32 with a scale and min each, GGUF's Q4_1 layout; the LM head then takes
    int8), `int8` (one scale per output row): weight-only, activations stay in model.dtype (`auto` then means bfloat16), for one
    or a few streams. `w8a8`: int8 weights times activations quantized to 8 bits per row,
    smoothed (SmoothQuant) on a calibration prefill at load: for batches, which are compute
    bound. Weights are read at full precision and quantized at load. `auto`: the fastest path
    for this machine (dtype too while model.dtype is auto), for one stream when
    scheduler.max_num_seqs is 1 and for batches otherwise, as `meshserve advise` measured it
    here, or by a rule per CPU kind (meshserve.configs.auto_choice)."""


class ParallelConfig(Section):
    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    context: PositiveInt = 1
    expert: PositiveInt = 1
    """Expert parallelism (mixture-of-experts models): the experts of every MoE layer split
    over this many groups of `tensor` ranks, which exchange tokens all-to-all; attention and
    the dense layers are replicated over them (meshserve.layers.moe). Multiplies the ranks
    of a replica: tensor x expert x context x pipeline."""
    expert_exchange: Literal["all_to_all", "all_reduce"] = "all_to_all"
    """How a MoE layer's expert group exchanges tokens (parallel.expert > 1): `all_to_all`
    dispatches each (token, expert) pair to its expert's ranks and combines the results back
    (two all-to-alls and an all-gather); `all_reduce` has each rank compute its experts for
    all the tokens it already holds and sums over the group (one all-reduce)."""
    sequence_parallel: bool = False
    """With tensor > 1: between the row-parallel and the next column-parallel linear (the
    residual stream and the norms), each tensor-parallel rank holds only its share of a
    step's tokens, not all of them: a reduce-scatter replaces each all-reduce and an
    all-gather comes before each column-parallel product (meshserve.parallel.sequence), on
    steps of at least sequence_parallel_min_tokens tokens."""
    sequence_parallel_min_tokens: PositiveInt = 512
    """The smallest step that sequence parallelism splits; smaller steps (decode steps: one
    token per sequence) keep the all-reduce."""
    data: PositiveInt = 1
    """Replicas: each a whole tensor x pipeline x context group of ranks with its own driver,
    scheduler and KV cache, behind one front door (server.zmq and server.http) that routes
    each request to one of them (`router`); a replica that fails is taken out, and the others
    go on serving (meshserve.engine.serving.replicas)."""
    pipeline_layers: list[PositiveInt] | None = None
    """Layers per pipeline stage, first to last (default: even decode cost per stage; the last
    stage, which also runs the LM head, takes fewer layers)."""
    micro_batches: PositiveInt | None = None
    """Micro-batches in flight through the pipeline (default: one per stage)."""

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches or self.pipeline

    def sizes(self, with_data: bool = False) -> str:
        """The product that makes the world size, for messages: `parallel.tensor x pipeline x
        context = 2 x 1 x 1` (expert and data only where they are not 1)."""
        axes = [("data", self.data)] if with_data else []
        axes += [("tensor", self.tensor)] + ([("expert", self.expert)] if self.expert > 1 else [])
        axes += [("pipeline", self.pipeline), ("context", self.context)]
        return (f"parallel.{' x '.join(n for n, _ in axes)} = {' x '.join(str(v) for _, v in axes)}")


class DeviceConfig(Section):
    type: Literal["cpu", "cuda"] = "cpu"
    threads: PositiveInt | None = None
    """Intra-op threads per rank on CPU; by default (and OMP_NUM_THREADS, if set) the rank's
    cores, capped so that a node's ranks never run more threads than it has cores."""
    cpu_bind: Literal["auto", "none"] | list[StrictStr | StrictInt] = "auto"
    """Cores of each local rank (meshserve.configs.cpu_bind): `auto` splits the launcher's
    cores evenly over the node's ranks; `none` leaves placement to the OS; or one CPU list
    per local rank, e.g. ["0-3", "4-7"]."""
    kernels: Literal["auto", "torch", "triton", "cpu"] = "auto"
    """What computes attention, RMSNorm and rotary: `torch` (the reference), `triton`
    (meshserve's kernels, CUDA only, `pip install 'meshserve[gpu]'`), `cpu` (torch with
    meshserve's C++ decode attention, built on first use); `auto`: triton on CUDA when
    installed, cpu on the CPU when its kernel builds, else torch."""
    cpu_isa: Literal["auto", "avx512", "avx2", "scalar"] = "auto"
    """Which build of meshserve's C++ CPU kernels runs (meshserve.configs.cpu_features):
    `auto`, the fastest this CPU runs; `avx512`, `avx2` or `scalar` to force one (a build the
    CPU cannot run is a config error)."""
    cuda_graphs: bool = True
    """device.type=cuda: decode steps replay CUDA graphs captured at start-up, one per batch
    bucket up to scheduler.max_num_seqs (meshserve.engine.decode_graphs), where the model
    runs on one pipeline stage without context or expert parallelism; false: every step
    launches its kernels one by one."""
    compile: bool | Literal["auto"] = False
    """Run decode steps through torch.compile (inductor, weights frozen): fuses the small
    ops between matmuls, for one or a few streams on CPU. Compiles for tens of seconds, in
    the background while decode steps run eagerly (see compile_wait); one rank only
    (parallel sizes 1), device.type=cpu, no experts. `auto`: compile where that holds and
    the eager decode steps do not already run the layers in one C++ call
    (meshserve.layers.fused_decode), which on an AMX CPU serves faster than the compiled
    step; elsewhere decode steps stay eager."""
    compile_wait: bool = False
    """With compile: true, false (the default) serves from the start, decode steps eager
    until the compiled graphs are ready; true waits for the compile before the server is
    ready (every decode step compiled from the first)."""


class CacheConfig(Section):
    block_size: PositiveInt = 16
    memory: ByteSize = ByteSize(1 << 30)
    """KV-cache budget per rank (e.g. `512MiB`, `4GiB`)."""
    num_blocks: PositiveInt | None = None
    """Fix the number of KV blocks per rank instead of deriving it from `memory`."""
    dtype: Literal["auto", "int8"] = "auto"
    """What the KV cache holds: `auto`, model.dtype; `int8`, 8-bit codes with a float32
    scale per token and KV head (meshserve.layers.kv_quant): about half the bytes of bf16,
    so twice the tokens in `memory` and half the cache reads of a decode step. CPU only
    (device.kernels torch or cpu), without context parallelism."""
    prefix_caching: bool = True
    """Keep the KV blocks of finished requests and reuse them for any later request that
    starts with the same tokens (multi-turn chat, shared system prompts); evicted least
    recently used when memory is needed. Every topology and cache kind (meshserve.engine.block_manager)."""

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size={v} must be a power of two (e.g. 16 or 32)")
        return v


class SchedulerConfig(Section):
    max_num_seqs: PositiveInt = 64
    """Most sequences in one step."""
    max_batched_tokens: PositiveInt = 1536
    """Token budget of one step: prefill chunks plus one token per decoding sequence. The
    default is measured (README, the AMX section): against 2048, a lower TTFT p50 when many
    prompts arrive together, at the same tokens/s and TTFT p99; against 1024, the same p50
    gain cost throughput and p99."""
    overlap: bool | Literal["auto"] = "auto"
    """Schedule step n + 1 and submit it while step n runs, SGLang's overlap scheduler and
    vLLM's async scheduling: the tokens step n samples feed step n + 1 on the device, and
    the driver reads them, checks stops and detokenizes behind it (engine/engine.py). The
    same tokens either way. One pipeline stage, no context or expert parallelism, no
    disaggregation. `auto`: on CUDA; off on the CPU, where the host work and the kernels
    share the cores and each token reaches its client one step later (README measures it)."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """`fcfs`: first come, first served. `priority`: by each request's `priority` (an integer,
    lower first, as vLLM's --scheduling-policy priority), aged by its wait (priority_aging);
    a waiting request of a better rank preempts running ones when it finds no room."""
    priority_aging: PositiveFloat = 10.0
    """`priority`: seconds a waiting request waits to gain one level, which bounds starvation:
    a request is never overtaken by one that arrived more than (the difference of their
    priorities) x priority_aging seconds after it."""
    background_max_seqs: PositiveInt | None = None
    """Most background requests (the Batch API's) running at once, so that a batch leaves
    room and step time to online traffic; null: max_num_seqs. They are scheduled below every
    online request and preempted first whatever this is."""
    background_share: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    """While any online request runs or waits, a step gives background requests (their
    decodes and prefill chunks) at most this share of the tokens it gives online ones (at
    least one token, if above 0). 0: they run only in steps with no online work, the
    capacity online traffic leaves idle (on a CPU, where a step's time grows with every
    token in it, any share slows the online requests by about as much); null: no share
    limit. On a GPU, where a decode step's time hardly grows with its tokens, a share costs
    the online requests little."""
    background_step_tokens: PositiveInt | None = 32
    """Most tokens background requests take in any step: an online request that arrives
    while such a step runs waits for it, so this bounds what a batch job adds to the time to
    first token (null: the step's budget, max_batched_tokens). Raise it on a GPU."""
    max_waiting: PositiveInt = 4096
    """Most requests queued before admission refuses new ones."""
    max_waiting_tokens: PositiveInt = 1 << 20
    """Most prompt tokens queued (not yet computed) before admission refuses new requests."""


class SpeculativeConfig(Section):
    """Speculative decoding (meshserve.engine.speculative): each decoding sequence proposes
    the tokens likely to follow, and one step of the model verifies them all; the output is
    exactly what it would be without (greedy and sampled alike), in fewer steps when the
    proposals are right. Off by default, as in vLLM."""

    method: Literal["none", "ngram", "draft", "medusa"] = "none"
    """`ngram`: prompt lookup, which proposes what followed the latest earlier occurrence of
    the last few tokens in the prompt and output (model-free: for output that copies its
    input, such as code edits, quoting summaries, extraction). `draft`: a draft model
    (`model`) proposes greedily, on the driver, in a KV cache of its own. `medusa`: draft
    heads (`heads`) on the model's last hidden state guess the next tokens with every step:
    Medusa heads, or sequential heads that also read the tokens before their guess (Hydra;
    meshserve.layers.medusa, the file says which)."""
    num_speculative_tokens: int = Field(8, ge=1, le=16)
    """The most tokens a sequence proposes per step."""
    prompt_lookup_min: PositiveInt = 2
    """`ngram`: the fewest last tokens that must match."""
    prompt_lookup_max: PositiveInt = 4
    """`ngram`: the most last tokens matched (a longer match wins)."""
    adaptive: bool = True
    """Each sequence proposes only as many tokens as its acceptance so far pays for at the
    step's batch size (none once decoding is compute bound and proposals are often wrong);
    false: always num_speculative_tokens where a proposal has them."""
    model: str | None = None
    """`draft`: the draft model (an HF directory, a .gguf file or builtin:<name>) with the
    target's vocabulary, e.g. a smaller checkpoint of the same family, or the target itself
    with cheaper weights (`quantization`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`draft`: the draft's dtype (auto as model.dtype's)."""
    quantization: Annotated[Quantization, BeforeValidator(_parse_quantization)] = Quantization.NONE
    """`draft`: the draft's weight quantization (as model.quantization)."""
    draft_memory: ByteSize = ByteSize(256 << 20)
    """`draft`: the draft's KV cache, on the driver (a sequence it cannot hold gets no proposal)."""
    heads: str | None = None
    """`medusa`: the heads file, trained for this model (scripts/train_heads.py writes one);
    a sequence proposes at most one token per head along a path of `tree`."""
    tree: list[list[NonNegativeInt]] | None = None
    """`medusa`: the candidate tree each step verifies (Medusa's choices): a path [i1, ...,
    id] is a node holding the i_d-th best guess of head d under the node of the path's
    prefix (every prefix of a path is a path too); at most 15 nodes. None: the chain of each
    head's first guess. A sequence with a grammar keeps the chain."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"speculative.prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative.method=draft needs speculative.model (the draft model's path)")
        if self.method == "medusa" and not self.heads:
            raise ValueError("speculative.method=medusa needs speculative.heads (a heads file: scripts/train_heads.py)")
        if self.tree is not None:
            if self.method != "medusa":
                raise ValueError(f"speculative.tree is the candidate tree of speculative.method=medusa, not "
                                 f"speculative.method={self.method}")
            problem = tree_problem(self.tree)
            if problem:
                raise ValueError(f"speculative.tree: {problem}")
        if self.method != "medusa" and self.heads:
            raise ValueError(f"speculative.heads are the heads of speculative.method=medusa, not "
                             f"speculative.method={self.method}")
        if self.method != "draft" and self.model:
            raise ValueError(f"speculative.model is the draft model of speculative.method=draft, not "
                             f"method={self.method}")
        return self


class LoraConfig(Section):
    """LoRA adapters (meshserve.engine.lora) in PEFT's format, served beside the base model:
    a request names one as its `model` (OpenAI API) or `lora` (ZMQ), and the rows of one
    batch may each use another, without merging any weight. More can be loaded and unloaded
    at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)."""

    enabled: bool = False
    """Serve adapters (implied by `adapters`; vLLM's --enable-lora)."""
    adapters: dict[StrictStr, StrictStr] = {}
    """name -> the adapter's directory (adapter_config.json, adapter_model.safetensors), loaded at start."""
    max_loras: int = Field(4, ge=1, le=256)
    """Adapters whose weights sit on the ranks at once: more are loaded as requests need them,
    the least recently used one that no running request uses giving way."""
    max_rank: int = Field(16, ge=1, le=512)
    """The highest adapter rank served (vLLM's --max-lora-rank); every slot is this wide."""

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.adapters)

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, path in adapters.items():
            if not name or len(name) > 128 or not path:
                raise ValueError(f"lora.adapters: {name!r}: {path!r} needs a name of 1..128 characters and a path")
        return adapters


class ResponsesConfig(Section):
    """The Responses API's stored responses (`store`, `previous_response_id`)."""

    max_stored: NonNegativeInt = 1000
    """Responses kept in memory for follow-ups (the least recently used dropped first); 0:
    none (`store` is then false in every response)."""


class BatchConfig(Section):
    """The Batch API (`/v1/files`, `/v1/batches`): offline jobs whose requests run below every
    online request, in the capacity online traffic leaves idle. Files and jobs live under
    `data_dir`, so a job survives a restart and resumes where it stopped."""

    data_dir: str | None = None
    """Where files and jobs are kept; null: no Batch API (its paths answer 404). One directory
    per server: a server resumes every unfinished job it finds there."""
    max_file_bytes: PositiveInt = 200 << 20
    """Largest file uploaded (OpenAI's limit)."""
    max_files: PositiveInt = 1000
    """Most files kept per API key; outputs of jobs count."""
    max_requests: PositiveInt = 50_000
    """Most requests in one job (OpenAI's limit)."""
    max_in_flight: PositiveInt = 64
    """Most of the jobs' requests handed to the scheduler at once (they wait there below
    online requests; more would only hold their prompts in memory)."""


class MetricsConfig(Section):
    """`/metrics`: who may read it, and the roofline behind its MFU and MBU gauges."""

    public: bool = False
    """With server.api_key, /metrics needs the key too unless this is true (a scraper then needs
    none). Without an API key /metrics is open either way."""

    peak_flops: PositiveFloat | None = None
    """Matmul FLOP/s of the whole deployment; null: measured at start-up (about a second)."""
    memory_bandwidth: PositiveFloat | None = None
    """Memory bytes/s of the whole deployment; null: measured at start-up."""

    @field_validator("peak_flops", "memory_bandwidth", mode="before")
    @classmethod
    def _number(cls, v):
        # NOTE: YAML reads `1e12` as a string (it wants `1.0e+12`); accept both spellings.
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                raise ValueError(f"{v!r} is not a number (e.g. 1e12)") from None
        return v


class HttpLimits(Section):
    """What one HTTP client may hold of the server."""

    max_connections: PositiveInt = 1024
    """Open connections at most; one more is answered 503 and closed."""
    read_timeout: PositiveFloat = 30.0
    """Seconds a client has to send a request's headers, and then its body (else 408)."""
    keep_alive: PositiveFloat = 5.0
    """Seconds an idle keep-alive connection stays open."""


class ServerConfig(Section):
    zmq: str = "tcp://127.0.0.1:5555"
    http: str | None = "127.0.0.1:8000"
    """HOST:PORT of the OpenAI-compatible API (port 0: any free port); null: no HTTP server."""
    http_limits: HttpLimits = Field(default_factory=HttpLimits)
    model_name: str | None = None
    """The `model` name HTTP clients use; default: the model's own name (a builtin's name, or the
    checkpoint directory's or GGUF file's name), never its local path."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    """How chat replies' reasoning (up to `</think>`) is split off as `reasoning_content`
    (vLLM's --reasoning-parser): `qwen3` (a reply reasons if it opens with `<think>`) or
    `deepseek_r1` (a reply starts inside its reasoning); null: replies are not split."""
    secret: Annotated[str, Field(min_length=1)] | None = Field(None, repr=False)
    """Shared secret: an HMAC tag on every ZMQ frame, between clients and the server and between
    the ranks (control plane, heartbeats); across nodes the control plane and heartbeats are
    also CURVE-encrypted with keys derived from it (meshserve.comm.curve). The same on every
    node; use a long random one. Null: none (env MESHSERVE_SECRET fills it); several nodes
    then need cluster.insecure_control_plane."""
    curve: bool = False
    """Client connections to server.zmq CURVE-encrypted too (ZeroMQ's CurveZMQ), with keys derived
    from server.secret (needed): `Client(address, secret=..., curve=True)`. Without it client
    frames carry the secret's HMAC tag only (authenticated, readable on the network)."""
    api_key: Annotated[str, Field(min_length=1)] | None = Field(None, repr=False)
    """HTTP: /v1/* needs `Authorization: Bearer <api_key>`. Null: open (env MESHSERVE_API_KEY
    fills it)."""
    admin_key: Annotated[str, Field(min_length=1)] | None = Field(None, repr=False)
    """The front door of several replicas: its admin API (/admin/*: list, drain, restart, add
    and remove replicas) needs `Authorization: Bearer <admin_key>`. Null: the admin API is
    off (env MESHSERVE_ADMIN_KEY fills it)."""
    cors_allowed_origins: list[StrictStr] = ["*"]
    """HTTP: the origins whose web pages may call the API (CORS), e.g. ["https://app.example.com"];
    ["*"]: any; []: none. A browser's preflight (OPTIONS) needs no API key."""

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} must be \"*\" or SCHEME://HOST[:PORT] with no "
                                 f"path, e.g. https://app.example.com")
        return v

    @field_validator("http")
    @classmethod
    def _http_address(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"http address {v!r} must be HOST:PORT, e.g. 127.0.0.1:8000")
        return v

    @field_validator("zmq")
    @classmethod
    def _zmq_address(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"zmq address {v!r} must start with tcp:// or ipc://")
        return v


SECRET_KEYS = ("secret", "api_key", "admin_key")
"""Keys of `server` never printed: `meshserve check` and config errors show "***"."""


def redacted(config: "Config") -> dict[str, Any]:
    """The config as plain data (JSON types), with the secrets masked as "***"."""
    data = config.model_dump(mode="json")
    for key in SECRET_KEYS:
        if data["server"].get(key) is not None:
            data["server"][key] = "***"
    return data


class RouterConfig(Section):
    """How the front door of several replicas (parallel.data > 1) picks one for a request.
    Either way, a request that continues a conversation (its prompt holds an earlier
    request's prompt and output) goes where that history is cached."""

    policy: Literal["least_loaded", "cache_aware"] = "least_loaded"
    """`least_loaded`: the replica holding the fewest tokens of queued and running requests;
    `cache_aware`: the replica whose prefix cache holds the longest prefix of the prompt (as
    the front door tracks it: the prompts and outputs it sent there, least recently used
    forgotten at the replica's cache size), unless it is overloaded (balance_*), as SGLang's
    router does."""
    balance_abs_tokens: int = Field(4096, ge=0)
    """`cache_aware`: the cached replica is overloaded when it holds more than this many tokens
    above the least-loaded replica ..."""
    balance_rel: float = Field(2.0, ge=1.0)
    """... and more than this many times its tokens; the request then goes to the least
    loaded."""
    retry: bool = True
    """A request whose replica fails (or refuses it) moves to another replica: one with no
    output yet starts over, one with output continues from it (migration_limit); else it
    gets an `unavailable` error."""
    migration_limit: int = Field(3, ge=0)
    """How often one request may move, with its output so far, to another replica (the new
    replica computes the prompt and that output, then streams on; its client sees each token
    once). 0: a request whose replica fails after it had output gets `unavailable`."""
    restart_limit: int = Field(3, ge=0)
    """How often in a row a failed replica is started again by the front door (`meshserve
    serve`'s own replicas); one that then serves restart_reset_s counts from 0 again. 0:
    a failed replica stays out of service."""
    restart_backoff: float = Field(1.0, ge=0.0)
    """Seconds before the first restart of a failed replica; each further one in a row waits
    twice as long as the last (up to launcher/replica_keeper.py MAX_BACKOFF_S)."""
    restart_reset_s: float = Field(300.0, gt=0.0)
    """A restarted replica that serves this long has its restarts in a row forgotten."""
    join: str | None = None
    """`tcp://HOST:PORT` of a `meshserve router`'s router.listen: this replica (one, started by
    any launcher: torchrun, mpirun/srun, the deepspeed launcher, `meshserve serve`) joins it,
    with server.secret, and beats every heartbeat_interval; the router routes to it while the
    beats come. Null: it serves on its own."""
    listen: str = "tcp://0.0.0.0:5560"
    """`meshserve router`: where replicas join (CURVE-encrypted with keys from server.secret)."""
    name: str | None = None
    """A joining replica's name, stable across its restarts (null: the address it advertises)."""
    advertise: str | None = None
    """A joining replica: the ZMQ address the router reaches it at (null: server.zmq, a wildcard
    host replaced by this node's address on cluster.interface, or its host name's)."""
    heartbeat_interval: float = Field(1.0, gt=0.0)
    """Seconds between a joined replica's beats."""
    heartbeat_timeout: float = Field(5.0, gt=0.0)
    """`meshserve router`: a replica whose beats stop this long is dropped (its requests move)."""


class DisaggregationConfig(Section):
    """Disaggregated prefill/decode (parallel.data > 1): the first `prefill_replicas`
    replicas only compute prompts, the others only decode. A request's prompt is computed on
    a prefill replica, whose ranks send its KV blocks, layer by layer as they are written,
    to the decode replica's ranks over torch.distributed (comm/kv_transfer.py); the decode
    replica never runs a prefill chunk, so its streams' token times do not jump when long
    prompts arrive."""

    prefill_replicas: int = Field(0, ge=0)
    """0: off (every replica serves whole requests)."""
    transfer_timeout: PositiveFloat = 30.0
    """Seconds a decode replica waits, once the prefill replica reports its KV sent, for all
    of it to arrive; past it, that request fails (alone) with an `unavailable` error."""
    replica: int | None = Field(None, ge=0)
    """Set by the front door for each replica it starts: which one it is ..."""
    replicas: int | None = Field(None, ge=1)
    """... of how many (parallel.data of the deployment; a replica's own config says 1)."""
    store: str | None = None
    """Set by the front door: host:port of the key-value store where replicas' ranks meet."""

    @property
    def enabled(self) -> bool:
        return self.prefill_replicas > 0


class ClusterConfig(Section):
    """Where the ranks run: how many nodes, how many ranks on each, and how they find each
    other. One node by default; the launcher (`meshserve serve`, torchrun, mpirun, deepspeed)
    starts the ranks, and start-up checks that it started the world described here."""

    nodes: PositiveInt = 1
    ranks_per_node: PositiveInt | None = None
    """Ranks on each node (default: world size / nodes). A multiple of parallel.tensor, so
    tensor-parallel groups stay inside a node; pipeline stages may cross nodes."""
    master_addr: str | None = None
    """Node 0's address, reachable from every node: `meshserve serve --node-rank K` meets there
    (default 127.0.0.1 on one node; torchrun, mpirun and deepspeed bring their own)."""
    master_port: int = Field(29500, ge=1, le=65535)
    """The rendezvous port on node 0 (`meshserve serve --node-rank K`)."""
    interface: str | None = None
    """Network interface for gloo/NCCL sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) and the
    driver's control-plane sockets, e.g. `eth0` or `ib0`. Default: the host name's address.
    Not part of the config hash, so nodes whose interfaces are named differently may each
    `--set cluster.interface=...`."""
    rendezvous_timeout: PositiveInt = 300
    """Seconds to wait for every node and rank to join (rendezvous, process-group start-up)."""
    handshake_timeout: PositiveInt = 120
    """Seconds the driver waits for every rank's control-plane Ready (after loading weights)."""
    heartbeat_interval: PositiveFloat = 1.0
    """Seconds between the heartbeats every rank sends on the control plane."""
    failure_timeout: PositiveFloat = 10.0
    """Seconds without a heartbeat before a rank counts as dead: the driver fails every
    in-flight request and every rank exits (non-zero)."""
    insecure_control_plane: bool = False
    """With cluster.nodes > 1 and no server.secret, run the control plane and heartbeats as
    plain TCP anyway: whoever reaches the driver's ports on cluster.interface reads every
    step plan (clients' prompts included) and can send the driver results. Only for a private
    network you trust; otherwise set server.secret (or MESHSERVE_SECRET) on every node, which
    encrypts and authenticates them (CURVE). On one node they use unix sockets in a private
    directory whatever this says."""

    @model_validator(mode="after")
    def _heartbeats_fit(self):
        if self.failure_timeout < 3 * self.heartbeat_interval:
            raise ValueError(f"cluster.failure_timeout={self.failure_timeout:g} must be at least 3 x "
                             f"cluster.heartbeat_interval={self.heartbeat_interval:g} (a late beat is not a death)")
        return self


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def world_size(self) -> int:
        """The ranks of one replica (tensor x expert x context x pipeline): one torch.distributed world."""
        return self.parallel.tensor * self.parallel.expert * self.parallel.pipeline * self.parallel.context

    @property
    def total_ranks(self) -> int:
        """The ranks of every replica (parallel.data x world_size)."""
        return self.parallel.data * self.world_size

    @property
    def ranks_per_node(self) -> int:
        """cluster.ranks_per_node, or all replicas' ranks split evenly over cluster.nodes."""
        return self.cluster.ranks_per_node or max(1, self.total_ranks // self.cluster.nodes)

    @property
    def torch_dtype_name(self) -> str:
        """The resolved dtype name (see `dtype_choice`)."""
        return self.dtype_choice[0]

    @property
    def dtype_choice(self) -> tuple[str, str]:
        """The resolved dtype name and why it was taken, on this machine's CPU (`dtype_on`)."""
        return self.dtype_on(cpu_features())

    def dtype_on(self, cpu: CpuFeatures) -> tuple[str, str]:
        """The resolved dtype name on `cpu`, and why. `auto` takes bfloat16 on CUDA, with
        model.quantization (the CPU int4/int8 kernels are far slower with float32 inputs) and on
        CPUs with bf16 dot products (AMX or AVX512-BF16, where bf16 is the fastest correct path);
        float32 on other CPUs, where oneDNN widens bf16 to float32 around every multiply."""
        if self.model.dtype != "auto":
            return self.model.dtype, "as model.dtype says"
        if self.device.type == "cuda":
            return "bfloat16", "model.dtype=auto on CUDA"
        if self.model.quantization != Quantization.NONE:
            return "bfloat16", f"model.dtype=auto with model.quantization={self.model.quantization}"
        if cpu.known and cpu.bf16_compute:
            unit = "AMX" if cpu.amx_bf16 else "AVX512-BF16"
            return "bfloat16", (f"model.dtype=auto on a CPU with bf16 dot products ({unit}); "
                                f"model.dtype=float32 computes in float32")
        return "float32", f"model.dtype=auto on a CPU without bf16 dot products ({cpu.describe()})"
