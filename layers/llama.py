"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2): GQA, RMSNorm, SwiGLU,
RoPE, optional QKV bias, tied or untied embeddings.

The model works on a flat batch of new tokens from many sequences, (num_tokens, ...),
with no padding. It holds the layers of one pipeline stage: the embedding only on the
first stage, the final norm and LM head only on the last.

The other families (layers/qwen3.py, layers/mixtral.py, layers/qwen2_moe.py) are this
model with another attention or MLP: a subclass of LlamaForCausalLM overrides
`make_attention` / `make_mlp` and, for experts, names their checkpoint tensors
(`EXPERT_PARTS`, `MOE_BLOCK`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from meshserve.comm.groups import AxisGroup
from meshserve.configs.model_info import ModelInfo
from meshserve.layers.attention import PagedAttention
from meshserve.layers.backend import Backend, StepMetadata, TorchBackend
from meshserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from meshserve.layers.moe import DOWN, FusedMoE
from meshserve.layers.norm import RMSNorm
from meshserve.layers.rotary import RotaryEmbedding
from meshserve.parallel.sequence import SequenceParallel

KVCache = tuple[torch.Tensor, torch.Tensor]

EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")
"""One expert's matrix, its layer already local: (layer, block, expert, part)."""

# Checkpoint tensors that land in one of our fused parameters: (ours, theirs, shard id).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaAttention(nn.Module):
    """One all-reduce: in o_proj (row-parallel). With context parallelism, K/V blocks and
    partial outputs also move over the backend's group (layers.backend.ContextParallelBackend)."""

    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, backend: Backend | None = None):
        super().__init__()
        self.backend = backend or TorchBackend()
        self.qkv_proj = QKVParallelLinear(info.hidden_size, info.head_dim, info.num_attention_heads,
                                          info.num_key_value_heads, tp, bias=info.attention_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(info.num_attention_heads * info.head_dim, info.hidden_size, tp, dtype=dtype,
                                        lora_module="o_proj")
        self.local_num_heads = self.qkv_proj.local_num_heads
        self.local_num_kv_heads = self.qkv_proj.local_num_kv_heads
        self.head_dim = info.head_dim
        self.attn = PagedAttention(self.local_num_heads, self.local_num_kv_heads, info.head_dim, backend=self.backend)

    def use_sequence_parallel(self, sp: SequenceParallel) -> None:
        """Its input and output are the residual stream's rows of this rank on split steps."""
        self.qkv_proj.sp = self.o_proj.sp = sp

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Before rotary: nothing here (Qwen3 normalizes each head)."""
        return q, k

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: KVCache,
                meta: StepMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.local_sizes, dim=-1)
        q = q.view(-1, self.local_num_heads, self.head_dim)  # (num_tokens, local_num_heads, head_dim)
        k = k.view(-1, self.local_num_kv_heads, self.head_dim)  # (num_tokens, local_num_kv_heads, head_dim)
        v = v.view(-1, self.local_num_kv_heads, self.head_dim)
        q, k = self.norm_heads(q, k)
        out = self.attn(q, k, v, kv_cache, meta, rope)
        return self.o_proj(out.flatten(1))  # (num_tokens, hidden_size)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); one all-reduce, in down_proj (row-parallel)."""

    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, backend: Backend | None = None,
                 intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or info.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(info.hidden_size, [intermediate_size] * 2, tp, dtype=dtype,
                                                       may_fuse_silu_mul=True)
        self.down_proj = RowParallelLinear(intermediate_size, info.hidden_size, tp, dtype=dtype,
                                           lora_module="down_proj")
        self.act = (backend or TorchBackend()).silu_and_mul

    def use_sequence_parallel(self, sp: SequenceParallel) -> None:
        """Its input and output are the residual stream's rows of this rank on split steps."""
        self.gate_up_proj.sp = self.down_proj.sp = sp

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): gate_up is (num_tokens, 2 * local_intermediate_size), gate then
        up, unless its product applies the activation itself."""
        h = self.gate_up_proj(x)
        return h if self.gate_up_proj.applies_silu_mul else self.act(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activated(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This tp rank's partial sum of the output: `forward` without its all-reduce."""
        return self.down_proj.partial(self.activated(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, backend: Backend | None = None,
                 attention: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, backend)
        self.self_attn = attention or LlamaAttention(info, tp, dtype, backend)
        self.post_attention_layernorm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, backend)
        self.mlp = mlp or LlamaMLP(info, tp, dtype, backend)

    def forward(self, rope, hidden, residual, kv_cache: KVCache, meta: StepMetadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, layer_range: tuple[int, int],
                 has_embedding: bool, has_head: bool, max_position: int, make_layer, backend: Backend | None = None):
        """`make_layer(i)`: the decoder layer of global index i."""
        super().__init__()
        self.layer_start, self.layer_end = layer_range
        self.embed_tokens = VocabParallelEmbedding(info.vocab_size, info.hidden_size, tp, dtype) if has_embedding else None
        self.rotary = RotaryEmbedding(info.head_dim, max_position, info.rope_theta, info.rope_scaling)
        self.layers = nn.ModuleList(make_layer(i) for i in range(*layer_range))
        self.dtype = dtype
        self.norm = RMSNorm(info.hidden_size, info.rms_norm_eps, dtype, backend) if has_head else None
        self.sp: SequenceParallel | None = None
        """Sequence parallelism over the TP group (parallel/sequence.py), where configured."""

    def use_sequence_parallel(self, sp: SequenceParallel) -> None:
        self.sp = sp
        if self.embed_tokens is not None:
            self.embed_tokens.sp = sp
        for layer in self.layers:
            layer.self_attn.use_sequence_parallel(sp)
            layer.mlp.use_sequence_parallel(sp)

    def forward(self, input_ids, positions, hidden, residual, kv_caches: list[KVCache], meta: StepMetadata,
                after_layer=None, layers=None):
        """First stage: from input_ids. Later stages: from the previous stage's (hidden,
        residual). Last stage returns the final-normed hidden states and residual None.
        `after_layer(i)`: called once layer i (of this stage) has run and written its KV
        (disaggregated prefill sends the layer's blocks then: engine/kv_agent.py). `layers`:
        runs the decoder layers in place of the Python loop, layers(rope, hidden, residual,
        kv_caches, meta) -> (hidden, residual) (the fused C++ call, layers/fused_decode.py).
        A step that sequence parallelism splits runs on this rank's rows between the linears
        and returns all of them, gathered (residual None: added in)."""
        split = self.sp is not None and self.sp.plan(positions.shape[-1])
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        elif split:  # the previous stage's whole hidden state (its residual added in)
            hidden = self.sp.rows(hidden) if residual is None else self.sp.rows(hidden + residual)
            residual = None
        rope = self.rotary.lookup(positions, self.dtype)
        if layers is not None and not split:
            hidden, residual = layers(rope, hidden, residual, kv_caches, meta)
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
                if after_layer is not None:
                    after_layer(i)
        if self.norm is not None:
            hidden, _ = self.norm(hidden, residual)
            residual = None
        if split:
            hidden = self.sp.gather(hidden if residual is None else hidden + residual)
            residual = None
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    EXPERT_PARTS: dict[str, int] = {}
    """Checkpoint names of an expert's matrices -> layers.moe GATE | UP | DOWN."""
    MOE_BLOCK = "mlp"
    """The checkpoint's name of a layer's MoE block (Mixtral: block_sparse_moe); ours is `mlp`."""

    def __init__(self, info: ModelInfo, tp: AxisGroup, dtype: torch.dtype, *, layer_range: tuple[int, int] | None = None,
                 is_first_stage: bool = True, is_last_stage: bool = True, max_position: int | None = None,
                 backend: Backend | None = None, ep: AxisGroup | None = None, expert_exchange: str = "all_to_all",
                 sequence_parallel_min_tokens: int | None = None):
        """`ep`: the expert-parallel group of the MoE layers (layers.moe), and how it
        exchanges tokens (parallel.expert_exchange); none for a dense model.
        `sequence_parallel_min_tokens`: with tp > 1, split the steps of at least this many
        tokens along the sequence between the linears (parallel/sequence.py); None: never."""
        super().__init__()
        self.info = info
        self.backend = backend or TorchBackend()
        """Computes attention, norms and rotary; builds the attention metadata of a step."""
        self.tp, self.ep, self.expert_exchange = tp, ep or AxisGroup.single("ep"), expert_exchange
        layer_range = layer_range or (0, info.num_hidden_layers)

        def make_layer(i: int) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(info, tp, dtype, self.backend, self.make_attention(dtype),
                                     self.make_mlp(i, dtype))

        self.model = LlamaModel(info, tp, dtype, layer_range, is_first_stage, is_last_stage,
                                max_position or info.max_position_embeddings, make_layer, self.backend)
        if sequence_parallel_min_tokens is not None and tp.size > 1:
            self.model.use_sequence_parallel(SequenceParallel(tp, sequence_parallel_min_tokens))
        self.lm_head = None
        if is_last_stage:
            tied = self.model.embed_tokens if info.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(info.vocab_size, info.hidden_size, tp, dtype, tied_to=tied)
        self.matmuls = None
        """The products chosen at load (layers.matmul_plan.MatmulPlan), which prepared the
        weights: the start-up line and the MFU/MBU cost read it."""

    def make_attention(self, dtype: torch.dtype) -> nn.Module:
        return LlamaAttention(self.info, self.tp, dtype, self.backend)

    def make_mlp(self, layer: int, dtype: torch.dtype) -> nn.Module:
        """The MLP of global layer `layer`: a block of experts where the model has one there."""
        moe = self.info.moe
        if moe is not None and layer in moe.sparse_layers:
            return FusedMoE(self.info.hidden_size, moe, self.tp, self.ep, dtype, self.backend, self.expert_exchange)
        return LlamaMLP(self.info, self.tp, dtype, self.backend)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: StepMetadata,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None, after_layer=None,
                layers=None):
        """`after_layer`, `layers`: as LlamaModel.forward's."""
        return self.model(input_ids, positions, hidden, residual, kv_caches, meta, after_layer, layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(num_samples, hidden_size) -> (num_samples, vocab_size) float32 on tp rank 0, else None."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id), or None if this
        stage does not hold it."""
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m:
            layer = int(m.group(1))
            if not self.model.layer_start <= layer < self.model.layer_end:
                return None
            name = f"model.layers.{layer - self.model.layer_start}.{m.group(2)}"
        elif name == "lm_head.weight" and self.info.tie_word_embeddings:
            return None  # tied: the embedding's rows serve as the head
        elif name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            if not (self.info.tie_word_embeddings and self.lm_head is not None):
                return None
            name = "lm_head.weight"  # a tied head on a stage without the embedding loads it itself
        elif name == "lm_head.weight" and self.lm_head is None:
            return None
        elif name == "model.norm.weight" and self.model.norm is None:
            return None
        expert = EXPERT.fullmatch(name)
        if expert and expert.group(2) == self.MOE_BLOCK and expert.group(4) in self.EXPERT_PARTS:
            layer, _, index, part = expert.groups()
            shard = (int(index), self.EXPERT_PARTS[part])
            return f"model.layers.{layer}.mlp.{'w2' if shard[1] == DOWN else 'w13'}", shard
        if f".{self.MOE_BLOCK}.gate." in name:  # the router
            return name.replace(f".{self.MOE_BLOCK}.gate.", ".mlp.gate."), None
        for ours, theirs, shard in STACKED_PARAMS:
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}."), shard
        return name, None
