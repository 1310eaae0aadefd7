"""Write a tiny Hugging Face checkpoint as a GGUF file, as llama.cpp's converter lays it out:
llama.cpp's tensor names, Q/K rows permuted for the `llama` architecture (Mixtral too),
each layer's experts stacked into one 3-D tensor per matrix (ffn_*_exps). Float32, or the
expert tensors in Q8_0 to read quantized 3-D data."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
        "qwen2_moe": "qwen2moe"}


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's half-split rotary rows -> llama.cpp's interleaved pairs, per head."""
    out, cols = rows.shape
    return rows.reshape(heads, 2, out // heads // 2, cols).swapaxes(1, 2).reshape(out, cols)


def export_gguf(hf_dir: Path, out: Path, expert_qtype=gguf.GGMLQuantizationType.F32) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        t = t.astype(np.float32)
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", t)
        elif "experts" in parts:
            i = parts.index("experts")
            stacked.setdefault((int(parts[2]), EXPERT[parts[i + 2]]), {})[int(parts[i + 1])] = t
        else:
            layer, stem, kind = int(parts[2]), ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and stem in ("self_attn.q_proj", "self_attn.k_proj"):
                t = permute(t, heads if stem.endswith("q_proj") else kv)
            w.add_tensor(f"blk.{layer}.{LAYER[stem]}.{kind}", t)
    for (layer, part), by_expert in sorted(stacked.items()):
        t = np.stack([by_expert[e] for e in range(experts)])
        if expert_qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"blk.{layer}.{part}.weight", t)
        else:
            w.add_tensor(f"blk.{layer}.{part}.weight", gguf.quants.quantize(t, expert_qtype), raw_dtype=expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
