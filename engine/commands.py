"""What frontends hand the step loop, and what the step loop expects of a frontend.

A request key is a tuple whose first item names the frontend that owns the request
("zmq", "http", ...); the step loop sends every reply for that key back through it.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Hashable, Protocol

import msgspec

from meshserve.comm.messages import SamplingParams


@dataclass(frozen=True)
class AddCommand:
    key: Hashable
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool


@dataclass(frozen=True)
class AbortCommand:
    key: Hashable


Command = AddCommand | AbortCommand


class Inbox(queue.Queue):
    """Commands from every frontend's thread to the step loop."""


class Frontend(Protocol):
    tag: str
    """The first item of the keys this frontend makes."""
    accepting: bool
    """False while the server drains: new requests are refused with `unavailable`."""
    error: BaseException | None
    """Set if the frontend's thread died; the step loop then stops the server."""

    def start(self) -> None: ...

    def send(self, key: Hashable, message: msgspec.Struct) -> None:
        """Deliver a Delta or ErrorReply to the client behind `key` (called by the step loop)."""

    def send_all(self, replies: list[tuple[Hashable, msgspec.Struct]]) -> None:
        """send() each (key, message) of one step, in order (called by the step loop)."""

    def fail(self, keys: list[Hashable], message: str) -> None:
        """From any thread, once the engine is dead: send each of `keys` an `unavailable`
        error, stop accepting, and report the failure (an HTTP /health of 503)."""

    def close(self) -> None: ...
