"""The adapters' slots (engine/lora/slots.py): a resident adapter keeps its slot, a new one
takes a free slot, then the least recently used one no request uses; an adapter in use is
never evicted (the request waits); four adapters in rotation over two slots."""

from __future__ import annotations

import pytest

from meshserve.engine.lora.slots import AdapterSlots, Placement


def test_least_recently_used_and_unused_gives_way():
    slots = AdapterSlots(2)
    assert slots.acquire("a") == Placement(0, load=True)
    assert slots.acquire("b") == Placement(1, load=True)
    assert slots.acquire("a") == Placement(0, load=False)  # resident; now most recently used
    assert slots.acquire("c") is None  # a and b both in use
    slots.release("b")
    assert slots.acquire("c") == Placement(1, load=True, evicted="b")
    slots.release("a")
    slots.release("a")
    assert slots.acquire("b") == Placement(0, load=True, evicted="a")
    assert (slots.loads, slots.evictions) == (4, 2)


def test_four_adapters_in_rotation_over_two_slots_and_unloading():
    slots = AdapterSlots(2)
    held = {}
    for step, name in enumerate("abcdabcdab"):
        placement = slots.acquire(name)
        assert placement is not None
        held[name] = placement.slot
        assert sorted(slots.resident.values()) == sorted(set(slots.resident.values()))  # no slot twice
        slots.release(name)
    assert set(slots.resident) == {"a", "b"} and slots.evictions == 8
    slots.acquire("a")
    with pytest.raises(ValueError, match="in use by 1 requests"):
        slots.drop("a")
    assert slots.drop("b") in (0, 1) and "b" not in slots.resident and slots.drop("zzz") is None
