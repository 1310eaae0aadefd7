"""The text w8a8 calibrates on (meshserve.layers.smoothquant): a fixed mix of prose, code,
a chat-style answer, numbers and a few languages (engine/data/calibration.txt), tokenized with the served model's tokenizer on every rank that loads weights."""

from __future__ import annotations

from importlib.resources import files

from meshserve.configs.model_info import ModelInfo
from meshserve.configs.quantization import Quantization
from meshserve.configs.schema import Config
from meshserve.engine.tokenizer import Tokenizer


def calibration_ids(config: Config, info: ModelInfo, tokenizer: Tokenizer | None = None) -> list[int] | None:
    """Token ids of the calibration text for model.quantization=w8a8; None otherwise.
    `tokenizer`: the served model's, where the caller has one (else it is loaded here)."""
    if config.model.quantization is not Quantization.W8A8:
        return None
    text = files("meshserve.engine").joinpath("data", "calibration.txt").read_text(encoding="utf-8")
    return (tokenizer or Tokenizer(info, config.model.tokenizer)).encode(text)
