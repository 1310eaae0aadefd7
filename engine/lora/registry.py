"""The adapters a server serves, by name, and which of them sit in the ranks' slots (the
driver's side; engine/lora/slots.py places them).

An adapter is checked against the model when it is registered (at start from lora.adapters,
or at run time), so a bad one is refused there with the reason and the ranks only ever load
adapters that fit. Each registration gets a key of its own: an adapter unloaded and loaded
again under its name, perhaps from another directory, never reuses the weights or the
cached prefixes of the first."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from meshserve.comm.messages import LoraLoad
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.adapters import AdapterError, check_adapter
from meshserve.engine.lora.slots import AdapterSlots


@dataclass(frozen=True)
class Registered:
    name: str
    path: str
    key: str
    """Unique per registration: its slots' and its prefix cache's name."""


class LoraRegistry:
    def __init__(self, info: ModelInfo, max_loras: int, max_rank: int):
        self.info, self.max_rank = info, max_rank
        self.adapters: dict[str, Registered] = {}
        self.slots = AdapterSlots(max_loras)
        self._keys = itertools.count()
        self._retired: dict[str, Registered] = {}
        """Unloaded adapters that running requests still use, by key."""

    def register(self, name: str, path: str) -> Registered:
        """Serve the adapter at `path` as `name`; AdapterError says why it cannot be."""
        if name in self.adapters:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded (from {self.adapters[name].path})")
        check_adapter(name, path, self.info, self.max_rank)
        entry = Registered(name, str(path), f"{name}#{next(self._keys)}")
        self.adapters[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Stop serving `name`: new requests are refused; running ones finish with it."""
        entry = self.adapters.pop(name, None)
        if entry is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
        if self.slots.users[entry.key]:
            self._retired[entry.key] = entry
        else:
            self.slots.drop(entry.key)

    def acquire(self, entry: Registered) -> tuple[int, LoraLoad | None] | None:
        """A slot for one more request of `entry`, and the load the ranks must make first
        (None: it is resident); None while every slot holds an adapter in use."""
        placement = self.slots.acquire(entry.key)
        if placement is None:
            return None
        return placement.slot, (LoraLoad(placement.slot, entry.name, entry.path) if placement.load else None)

    def release(self, key: str) -> None:
        self.slots.release(key)
        if key in self._retired and not self.slots.users[key]:
            del self._retired[key]
            self.slots.drop(key)
