"""The typed configuration tree. One YAML file (or none) -> one frozen `Config`.

Every section forbids unknown keys, so a typo fails before any rank starts. Values
that follow from others (world size, per-rank head counts, number of KV blocks) are
derived elsewhere and are never fields here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveInt, field_validator

BUILTIN_DEFAULT_MODEL = "builtin:smollm2-135m-instruct"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(Section):
    path: str = BUILTIN_DEFAULT_MODEL
    """HF directory (config.json + *.safetensors), a .gguf file, or `builtin:<name>`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`auto`: float32 on CPU, bfloat16 on CUDA."""
    tokenizer: str | None = None
    """Tokenizer directory; by default the model's own (HF directory or GGUF file)."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + output in tokens; by default the model's context, capped at 8192."""


class ParallelConfig(Section):
    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    context: PositiveInt = 1
    pipeline_layers: list[PositiveInt] | None = None
    """Layers per pipeline stage, first to last (default: even decode cost per stage; the last
    stage, which also runs the LM head, takes fewer layers)."""
    micro_batches: PositiveInt | None = None
    """Micro-batches in flight through the pipeline (default: one per stage)."""

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches or self.pipeline


class DeviceConfig(Section):
    type: Literal["cpu", "cuda"] = "cpu"
    threads: PositiveInt | None = None
    """Intra-op threads per rank on CPU; by default cores / local ranks."""


class CacheConfig(Section):
    block_size: PositiveInt = 16
    memory: ByteSize = ByteSize(1 << 30)
    """KV-cache budget per rank (e.g. `512MiB`, `4GiB`)."""
    num_blocks: PositiveInt | None = None
    """Fix the number of KV blocks per rank instead of deriving it from `memory`."""

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size={v} must be a power of two (e.g. 16 or 32)")
        return v


class SchedulerConfig(Section):
    max_num_seqs: PositiveInt = 64
    """Most sequences in one step."""
    max_batched_tokens: PositiveInt = 2048
    """Token budget of one step: prefill chunks plus one token per decoding sequence."""
    max_waiting: PositiveInt = 4096
    """Most requests queued before admission refuses new ones."""


class ServerConfig(Section):
    zmq: str = "tcp://127.0.0.1:5555"
    http: str | None = "127.0.0.1:8000"

    @field_validator("zmq")
    @classmethod
    def _zmq_address(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"zmq address {v!r} must start with tcp:// or ipc://")
        return v


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.tensor * self.parallel.pipeline * self.parallel.context

    @property
    def torch_dtype_name(self) -> str:
        """The resolved dtype name (`auto` becomes float32 on CPU, bfloat16 on CUDA)."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return "bfloat16" if self.device.type == "cuda" else "float32"
