"""The LoRA adapters as the OpenAI API shows them: a request names one as its `model`,
/v1/models lists each with its base as `parent` (vLLM's shape), and vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time.

The step loop holds the adapters (engine/lora/registry.py) and decides; this is the HTTP
thread's copy of their names, updated once the step loop has accepted a change, so a
request can be answered 404 before it is tokenized. A request that races an unload is
refused by the engine instead."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshserve.engine.serving.commands import LoraCommand
from meshserve.engine.serving.openai_protocol import OpenAIError, engine_error

log = logging.getLogger(__name__)

CHANGE_TIMEOUT_S = 120.0
"""Seconds a load or unload waits for the step loop (and, behind a front door, its replicas)."""


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False
    """vLLM's: replace an adapter of that name (here: unload it first)."""


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None
    """vLLM's; ignored (names identify adapters here)."""


def _body(raw: bytes, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(json.loads(raw or b"{}"))
    except (ValueError, ValidationError) as e:
        raise OpenAIError(400, f"invalid body: {str(e).splitlines()[0] if str(e) else e}",
                          code="invalid_value") from None


class ServedAdapters:
    """The adapters' names and directories, as the HTTP thread knows them."""

    def __init__(self, base: str, max_model_len: int, adapters: dict[str, str], inbox):
        """`inbox`: where LoraCommands go (the step loop's, or a front door's)."""
        self.base, self.max_model_len, self.inbox = base, max_model_len, inbox
        self.paths = dict(adapters)

    def resolve(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 if neither."""
        if model is None or model == self.base:
            return None
        if model in self.paths:
            return model
        served = ", ".join([self.base, *sorted(self.paths)])
        raise OpenAIError(404, f"The model `{model}` does not exist (this server serves {served})",
                          param="model", code="model_not_found")

    def model_cards(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "meshserve", "root": path,
                 "parent": self.base, "max_model_len": self.max_model_len} for name, path in sorted(self.paths.items())]

    async def _change(self, name: str, path: str | None) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(LoraCommand(name, path, done))
        try:
            await asyncio.wait_for(asyncio.wrap_future(done), CHANGE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise engine_error("unavailable", f"the adapter change did not finish within {CHANGE_TIMEOUT_S:.0f} s") \
                from None
        except ValueError as e:  # AdapterError: what the adapter or the request gets wrong
            raise OpenAIError(400, str(e), param="lora_name", code="invalid_value") from None

    async def load(self, raw: bytes) -> str:
        req = _body(raw, LoadLoraAdapter)
        if req.lora_name == self.base:
            raise OpenAIError(400, f"`{req.lora_name}` is the base model's name", param="lora_name",
                              code="invalid_value")
        if req.load_inplace and req.lora_name in self.paths:
            await self._change(req.lora_name, None)
            self.paths.pop(req.lora_name, None)
        await self._change(req.lora_name, req.lora_path)
        self.paths[req.lora_name] = req.lora_path
        log.info("LoRA adapter %r loaded from %s", req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload(self, raw: bytes) -> str:
        req = _body(raw, UnloadLoraAdapter)
        await self._change(req.lora_name, None)
        self.paths.pop(req.lora_name, None)
        log.info("LoRA adapter %r unloaded", req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
