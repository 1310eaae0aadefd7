"""Which replica takes a request (the front door's choice). Plain Python.

- A conversation's next turn (its prompt holds an earlier request's prompt and output)
  goes to the replica that served that request, where its history is cached, whatever the
  policy, while that replica is up.
- `least_loaded`: the replica holding the fewest tokens of queued and running requests
  (their prompts and the output so far), then the fewest requests, then the fewest routed.
- `cache_aware`: the replica whose prefix cache (as PrefixIndex tracks it) holds the
  longest prefix of the prompt, unless it holds more than `balance_abs_tokens` tokens above
  the least-loaded replica and more than `balance_rel` times as many: then the least
  loaded (SGLang's router's rule); least loaded too when no replica holds a block of it.
  A request of a LoRA adapter that no replica holds a prefix of goes to the least loaded
  replica that served the adapter lately (whose slots likely hold it), by the same rule.
  Prefixes are matched per adapter: a replica's blocks of one adapter are not another's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

from meshserve.engine.serving.replicas.prefix_index import PrefixIndex, prefix_hashes

HISTORY_ENTRIES = 1 << 16
"""Conversations remembered for stickiness (least recently used forgotten)."""


def cache_key(salt: str | None, adapter: str | None) -> str | None:
    """What a prompt's blocks are hashed under: the request's salt and its LoRA adapter."""
    return salt if adapter is None else f"{salt or ''}\0lora\0{adapter}"


@dataclass(frozen=True)
class Route:
    replica: int
    hashes: list[bytes]
    """The chained hashes of the prompt's full blocks."""
    cached_blocks: int
    """Leading blocks of the prompt the replica is believed to hold."""
    reason: str
    """`history`, `cache`, `adapter` or `least_loaded`."""


@dataclass
class _InFlight:
    replica: int
    prompt_ids: list[int]
    salt: str | None
    output_ids: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Router:
    def __init__(self, num_replicas: int, policy: str, block_size: int, capacity_blocks: int,
                 balance_abs_tokens: int = 4096, balance_rel: float = 2.0, max_loras: int = 0):
        """`max_loras`: the LoRA adapters a replica's slots hold (lora.max_loras; 0: none served)."""
        self.policy, self.block_size = policy, block_size
        self.max_loras = max_loras
        self.adapters: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_replicas)]
        """Per replica, the adapters it served lately, most recent last (at most max_loras)."""
        self.balance_abs_tokens, self.balance_rel = balance_abs_tokens, balance_rel
        self.capacity_blocks = capacity_blocks
        self.up = [True] * num_replicas
        self.indexes = [PrefixIndex(capacity_blocks) for _ in range(num_replicas)]
        self.routed = [0] * num_replicas
        self._load = [0] * num_replicas
        self._requests = [0] * num_replicas
        self._in_flight: dict[Hashable, _InFlight] = {}
        self._history: OrderedDict[bytes, int] = OrderedDict()
        """The hash of the first block holding output of a finished request -> its replica."""

    @property
    def num_replicas(self) -> int:
        return len(self.up)

    def load(self, replica: int) -> int:
        """Tokens of the requests queued and running on `replica` (prompts and output so far)."""
        return self._load[replica]

    def requests(self, replica: int) -> int:
        return self._requests[replica]

    def route(self, prompt_ids: list[int], salt: str | None = None, exclude: set[int] | frozenset = frozenset(),
              adapter: str | None = None) -> Route | None:
        """The replica for a prompt, among those up and not in `exclude`; None if there is none.
        `adapter`: the LoRA adapter the request runs with."""
        candidates = [r for r in range(self.num_replicas) if self.up[r] and r not in exclude]
        if not candidates:
            return None
        hashes = prefix_hashes(prompt_ids, self.block_size, cache_key(salt, adapter))
        for h in reversed(hashes):  # the latest turn's history first
            replica = self._history.get(h)
            if replica is not None and replica in candidates:
                self._history.move_to_end(h)
                return Route(replica, hashes, self.indexes[replica].match(hashes), "history")
        least = min(candidates, key=self._least_key)
        if self.policy == "cache_aware":
            matches = {r: self.indexes[r].match(hashes) for r in candidates}
            best = max(matches.values())
            if best:
                cached = min((r for r in candidates if matches[r] == best), key=self._least_key)
                if not self._overloaded(cached, least):
                    return Route(cached, hashes, best, "cache")
            holders = [r for r in candidates if adapter in self.adapters[r]]
            if holders:
                holder = min(holders, key=self._least_key)
                if not self._overloaded(holder, least):
                    return Route(holder, hashes, 0, "adapter")
        return Route(least, hashes, self.indexes[least].match(hashes), "least_loaded")

    def _least_key(self, r: int) -> tuple[int, int, int, int]:
        return self._load[r], self._requests[r], self.routed[r], r

    def _overloaded(self, replica: int, least: int) -> bool:
        excess = self._load[replica] - self._load[least]
        return excess > self.balance_abs_tokens and self._load[replica] > self.balance_rel * self._load[least]

    def started(self, key: Hashable, route: Route, prompt_ids: list[int], salt: str | None = None,
                adapter: str | None = None) -> None:
        """`key` was sent to `route.replica`."""
        r = route.replica
        self._in_flight[key] = _InFlight(r, prompt_ids, cache_key(salt, adapter))
        if adapter is not None and self.max_loras:
            self.adapters[r][adapter] = None
            self.adapters[r].move_to_end(adapter)
            while len(self.adapters[r]) > self.max_loras:
                self.adapters[r].popitem(last=False)
        self._load[r] += len(prompt_ids)
        self._requests[r] += 1
        self.routed[r] += 1
        self.indexes[r].add(route.hashes)

    def produced(self, key: Hashable, token_ids: list[int]) -> None:
        flight = self._in_flight.get(key)
        if flight is not None:
            flight.output_ids.extend(token_ids)
            self._load[flight.replica] += len(token_ids)

    def finished(self, key: Hashable, completed: bool = True) -> None:
        """`key` ended (`completed`: with its output, which a next turn would continue)."""
        flight = self._in_flight.pop(key, None)
        if flight is None:
            return
        r = flight.replica
        self._load[r] -= flight.tokens
        self._requests[r] -= 1
        if not completed or not flight.output_ids:
            return
        hashes = prefix_hashes(flight.prompt_ids + flight.output_ids, self.block_size, flight.salt)
        self.indexes[r].add(hashes)
        first_output_block = len(flight.prompt_ids) // self.block_size
        if first_output_block < len(hashes):
            self._history[hashes[first_output_block]] = r
            self._history.move_to_end(hashes[first_output_block])
            while len(self._history) > HISTORY_ENTRIES:
                self._history.popitem(last=False)

    def add_replica(self) -> int:
        """A replica added at run time, not up until it serves; its index."""
        self.up.append(False)
        self.indexes.append(PrefixIndex(self.capacity_blocks))
        self.adapters.append(OrderedDict())
        for counts in (self.routed, self._load, self._requests):
            counts.append(0)
        return len(self.up) - 1

    def set_up(self, replica: int, up: bool) -> None:
        """A replica failed (its cache is gone with it) or came back (empty)."""
        self.up[replica] = up
        self.indexes[replica].clear()
        self.adapters[replica].clear()
        for h in [h for h, r in self._history.items() if r == replica]:
            del self._history[h]
