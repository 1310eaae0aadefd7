"""Build the model of one rank and fill it from the checkpoint, reading only its shard."""

from __future__ import annotations

import logging
from contextlib import ExitStack

import torch
from tqdm import tqdm

from meshserve.configs.model_info import ModelInfo
from meshserve.configs.quantization import Quantization
from meshserve.layers.backend import ContextParallelBackend, TorchBackend
from meshserve.layers.kernels.cpu_library import CpuLibrary
from meshserve.layers.llama import LlamaForCausalLM
from meshserve.layers.matmul_plan import plan_matmuls
from meshserve.layers.mixtral import MixtralForCausalLM
from meshserve.layers.qwen2_moe import Qwen2MoeForCausalLM
from meshserve.layers.qwen3 import Qwen3ForCausalLM
from meshserve.layers.smoothquant import smooth
from meshserve.layers.weights import iter_checkpoint

log = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM,
}
"""ModelInfo.architecture (Hugging Face model_type) -> the model's class."""


def load_weights(model: LlamaForCausalLM, info: ModelInfo, show_progress: bool = False) -> None:
    """Each parameter's weight_loader narrows the checkpoint tensor to this rank's slice."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with ExitStack() as stack:
        tensors = list(iter_checkpoint(info, stack))
        for ckpt_name, tensor in tqdm(tensors, desc="loading weights", unit="tensor", disable=not show_progress):
            target = model.checkpoint_to_param(ckpt_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise KeyError(f"checkpoint tensor {ckpt_name!r} has no parameter {name!r} in the model")
            param = params[name]
            param.weight_loader(param, tensor, shard)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise KeyError(f"{info.path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def build_model(info: ModelInfo, tp, dtype: torch.dtype, *, device: torch.device | str = "cpu",
                layer_range: tuple[int, int] | None = None, is_first_stage: bool = True, is_last_stage: bool = True,
                max_position: int | None = None, show_progress: bool = False, cp=None,
                backend=None, quantization: Quantization = Quantization.NONE, calibration: list[int] | None = None,
                ep=None, expert_exchange: str = "all_to_all", library: CpuLibrary | None = None,
                before_pack=None, sequence_parallel_min_tokens: int | None = None) -> LlamaForCausalLM:
    """`backend`: the kernel backend (meshserve.layers.backend); default torch. `library`: the
    loaded C++ CPU kernels the products may run on (default: the backend's). With a
    context-parallel group `cp` of several ranks, the model's attention runs over it
    (layers.backend.ContextParallelBackend around `backend`). `ep`: the expert-parallel
    group of a mixture-of-experts model and how it exchanges tokens (layers.moe).
    `sequence_parallel_min_tokens`: sequence parallelism over `tp` (parallel/sequence.py)
    for steps of at least this many tokens; None: none.

    The products are chosen once (layers.matmul_plan.plan_matmuls: `model.matmuls`, which
    the start-up line and the MFU/MBU cost read). `quantization` (meshserve.layers.quant):
    the weights are read in float32 (a Q4_1 GGUF's codes survive exactly), the linear layers
    quantized, then the rest cast to `dtype`, which stays the activations' dtype. With int4
    the LM head takes int8, as GGUF files keep their output matrix at 8 bits. w8a8 first
    smooths the weights (meshserve.layers.smoothquant) on one prefill of `calibration` token
    ids."""
    quantization = Quantization(quantization)
    backend = backend or TorchBackend()
    matmuls = plan_matmuls(device, dtype, quantization, library or backend.library)
    load_dtype = matmuls.load_dtype
    if cp is not None and cp.size > 1:
        backend = ContextParallelBackend(backend, cp)
    with torch.device(device):
        model = MODEL_CLASSES[info.architecture](info, tp, load_dtype, layer_range=layer_range,
                                                 is_first_stage=is_first_stage, is_last_stage=is_last_stage,
                                                 max_position=max_position, backend=backend, ep=ep,
                                                 expert_exchange=expert_exchange,
                                                 sequence_parallel_min_tokens=sequence_parallel_min_tokens)
    load_weights(model, info, show_progress)
    if quantization is Quantization.W8A8:
        if not calibration:
            raise ValueError("model.quantization=w8a8 calibrates on a prefill: pass calibration token ids")
        ids = calibration[:max_position or info.max_position_embeddings]
        log.info("calibrating w8a8 (SmoothQuant) on a prefill of %d tokens", len(ids))
        smooth(model, ids, tp)
    if before_pack is not None:
        before_pack(model)
    if quantization.quantized:
        log.info("quantizing the linear layers (%s)", quantization)
    for module in model.modules():
        if hasattr(module, "pack_weight"):  # each takes its kind's kernel of the plan
            module.pack_weight(matmuls)
    model.matmuls = matmuls
    kept, dense = matmuls.kept_in_bf16()
    if kept:
        log.info("%d of %d weights hold only bf16 numbers (a bf16 checkpoint): kept in bf16, half the bytes, and "
                 "widened exactly in the products", kept, dense)
    if load_dtype != dtype:
        for param in model.parameters():
            param.data = param.data.to(dtype)
        model.model.dtype = dtype
    return model.eval()
