"""The Responses API's stored responses (`store`, `previous_response_id`), in memory: each
response with the conversation that produced it, so a follow-up that names it continues
that conversation (and finds its prompt in the prefix cache, being the same tokens again).

Bounded (server.responses.max_stored, the least recently used dropped first) and kept per
API key: a response is found only with the key that created it (its SHA-256, not the key,
is kept). Lost when the server stops, like vLLM's."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    """The Response object as it was returned."""
    conversation: list[dict[str, Any]]
    """The chat messages up to and including its reply, its instructions left out (a
    follow-up's own instructions replace them, as OpenAI's do)."""


def owner_of(authorization: str | None) -> str:
    """Whose responses a request sees: a digest of its Authorization header."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


class ResponseStore:
    def __init__(self, max_stored: int):
        self.max_stored = max_stored
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        if self.max_stored == 0:
            return
        self._items[owner, response_id] = stored
        self._items.move_to_end((owner, response_id))
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        stored = self._items.get((owner, response_id))
        if stored is not None:
            self._items.move_to_end((owner, response_id))
        return stored

    def delete(self, owner: str, response_id: str) -> bool:
        return self._items.pop((owner, response_id), None) is not None
