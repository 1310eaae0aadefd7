"""What frontends hand the step loop, and what the step loop expects of a frontend.

A request's key (RequestKey) names the frontend that owns it ("zmq", "http", ...), the
client within that frontend, and the request's id; the step loop sends every reply for the
key back through that frontend. The engine core sees keys as opaque hashables.
"""

from __future__ import annotations

import concurrent.futures
import queue
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import msgspec

from meshserve.comm.messages import KvHandoff, Resume, SamplingParams, TokenLogprob
from meshserve.engine.structured import Grammar


class RequestKey(NamedTuple):
    frontend: str
    """The tag of the frontend that owns the request."""
    client: bytes | str
    """Who asked, within that frontend: a ZMQ DEALER's identity, or the HTTP request's id."""
    request_id: str
    """The request's id as its client knows it (HTTP: one per sample, "<id>-<index>")."""


@dataclass(frozen=True)
class AddCommand:
    key: RequestKey
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    cache_salt: str | None = None
    grammar: Grammar | None = None
    """The compiled structured-output constraint, if the request has one."""
    handoff: KvHandoff | None = None
    """Disaggregated prefill/decode: this replica's part of the request (engine/handoff.py)."""
    resume: Resume | None = None
    """Migration: the output so far of a stream another replica started."""
    lora: str | None = None
    """The LoRA adapter it runs with (its name); None: the base model."""
    priority: int = 0
    """Its rank under scheduler.policy priority (lower first)."""
    background: bool = False
    """A Batch API request: scheduled below every online request (engine/scheduler.py)."""


@dataclass(frozen=True)
class AbortCommand:
    key: RequestKey


@dataclass(frozen=True)
class KvReadyCommand:
    """Disaggregated decode: the request's KV was sent; `token_id` is its first token."""

    key: RequestKey
    token_id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class ResetPrefixCacheCommand:
    """Forget the prefix cache; `done` gets the number of blocks forgotten."""

    done: concurrent.futures.Future


@dataclass(frozen=True)
class LoraCommand:
    """Serve the adapter at `path` as `name`, or with `path` None stop serving it; `done`
    gets None, or the AdapterError that says why not."""

    name: str
    path: str | None
    done: concurrent.futures.Future


Command = AddCommand | AbortCommand | KvReadyCommand | ResetPrefixCacheCommand | LoraCommand


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

    def send(self, key: RequestKey, message: msgspec.Struct) -> None:
        """Deliver a Delta or ErrorReply to the client behind `key` (called by the step loop)."""

    def send_all(self, replies: list[tuple[RequestKey, msgspec.Struct]]) -> None:
        """send() each (key, message) of one step, in order (called by the step loop)."""

    def fail(self, keys: list[RequestKey], message: str) -> None:
        """From any thread, once the engine is dead: send each of `keys` an `unavailable`
        error, stop accepting, and report the failure (an HTTP /health of 503)."""

    def close(self) -> None: ...
