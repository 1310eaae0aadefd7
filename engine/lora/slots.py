"""Which adapters sit in the ranks' lora.max_loras weight slots. A request's adapter gets a
slot when the request is admitted: the slot it has if it is resident, else a free one, else
the slot of the least recently used adapter that no admitted request uses, whose weights
then give way (the caller loads the new ones into it). An adapter in use is never evicted:
with every slot in use, the request waits. Plain Python, on the driver."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    slot: int
    load: bool
    """The adapter's weights must go into the slot (it was not resident)."""
    evicted: str | None = None
    """The adapter whose weights the slot held."""


class AdapterSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: OrderedDict[str, int] = OrderedDict()
        """Adapter -> its slot, least recently used first."""
        self.users: Counter[str] = Counter()
        self.loads = self.evictions = 0

    def acquire(self, name: str) -> Placement | None:
        """A slot for one more request of adapter `name`; None while every slot holds an
        adapter some admitted request uses."""
        if name in self.resident:
            self.resident.move_to_end(name)
            self.users[name] += 1
            return Placement(self.resident[name], load=False)
        taken = set(self.resident.values())
        free = [s for s in range(self.num_slots) if s not in taken]
        evicted = None
        if free:
            slot = free[0]
        else:
            evicted = next((n for n in self.resident if not self.users[n]), None)
            if evicted is None:
                return None
            slot = self.resident.pop(evicted)
            self.evictions += 1
        self.resident[name] = slot
        self.users[name] += 1
        self.loads += 1
        return Placement(slot, load=True, evicted=evicted)

    def release(self, name: str) -> None:
        """One request of `name` ended (its adapter stays resident until its slot is needed)."""
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]

    def drop(self, name: str) -> int | None:
        """Unload `name` (not in use): its slot, now free, or None if it was not resident."""
        if self.users[name]:
            raise ValueError(f"adapter {name!r} is in use by {self.users[name]} requests")
        return self.resident.pop(name, None)
