"""One HTTP request's engine requests and the bodies made of their replies: the samples
submitted through the EngineLink (Samples), gathered whole or streamed (Generation), and
shaped into a JSON body (`whole`) or chunks (`chunks`) sent as server-sent events (`sse`,
EventStream). openai_shapes.py shapes each choice; this module puts them together."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from meshserve.comm.messages import Completion, Delta, ErrorReply, SamplingParams, Usage
from meshserve.engine.serving.commands import AddCommand, RequestKey
from meshserve.engine.serving.engine_link import EngineLink
from meshserve.engine.serving.openai_protocol import OpenAIError, engine_error
from meshserve.engine.serving.openai_shapes import best_of, cached_tokens, draft_tokens, usage_dict
from meshserve.engine.structured import Grammar


class ClientDisconnected(Exception):
    """The client went away before the response started."""


class StreamError(Exception):
    """An error reply after a stream's headers went out."""

    def __init__(self, error: OpenAIError):
        super().__init__(error.message)
        self.error = error


class EventStream(StreamingResponse):
    """Server-sent events that release their engine requests however the response ends (also
    when the client leaves before the first chunk, so the generator never starts)."""

    def __init__(self, events, on_close, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"} | headers)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Disconnected:
    """Put in a request's queue when its client goes away."""


DISCONNECTED = _Disconnected()


class Samples:
    """The engine requests of one HTTP request (prompts x n), and the queue their replies
    arrive in as (sample index, message)."""

    def __init__(self, link: EngineLink, request_id: str):
        self.link, self.request_id = link, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.keys: list[RequestKey] = []
        self.finished: set[int] = set()
        self._closed = False

    def submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool, cache_salt: str | None,
               grammar: Grammar | None = None, lora: str | None = None, priority: int = 0,
               background: bool = False) -> None:
        index = len(self.keys)
        key = RequestKey(self.link.tag, self.request_id, f"{self.request_id}-{index}")
        self.keys.append(key)
        self.link.submit(AddCommand(key, key.request_id, prompt_ids, params, stream, cache_salt, grammar, lora=lora,
                                    priority=priority, background=background),
                         self.queue, index)

    def done(self, index: int, msg: Any) -> bool:
        """Whether `msg` ends sample `index`."""
        if isinstance(msg, ErrorReply) or msg.finish_reason is not None:
            self.finished.add(index)
            return True
        return False

    @property
    def all_done(self) -> bool:
        return len(self.finished) == len(self.keys)

    def close(self) -> None:
        """Release the samples, aborting those still running (the client left, another sample
        failed, or the handler was cancelled). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for index, key in enumerate(self.keys):
            self.link.release(key, abort=index not in self.finished)


@dataclass
class Generation:
    """The engine requests of one HTTP request, submitted: whole results, or (streamed) each
    sample's first delta."""

    run: Samples
    shapes: Any
    model: str
    prompt_ids: list[list[int]]
    per_prompt: int
    """Samples per prompt (best_of)."""
    n: int
    """Choices per prompt."""
    results: list[Completion] | None = None
    first: list[tuple[int, Delta]] | None = None


async def watch_disconnect(raw: Request, queue: asyncio.Queue) -> None:
    """Until cancelled: tell the handler if its client goes away. Only while no response is
    being sent (once streaming, Starlette itself watches and cancels the stream)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait((None, DISCONNECTED))
            return


def _check_reply(msg: Any) -> None:
    if msg is DISCONNECTED:
        raise ClientDisconnected()
    if isinstance(msg, ErrorReply):
        raise engine_error(msg.code, msg.message)


async def collect(run: Samples) -> list[Completion]:
    """Every sample's whole result."""
    results = [Completion(f"{run.request_id}-{i}") for i in range(len(run.keys))]
    while not run.all_done:
        index, msg = await run.queue.get()
        _check_reply(msg)
        results[index].add(msg)
        run.done(index, msg)
    if any(c.finish_reason == "abort" for c in results):
        raise engine_error("unavailable", "the request was aborted: the server is shutting down")
    return results


async def first_replies(run: Samples) -> list[tuple[int, Delta]]:
    """Wait for every sample's first delta, so an error reply still gets its status code."""
    first, seen = [], set()
    while len(seen) < len(run.keys):
        index, msg = await run.queue.get()
        _check_reply(msg)
        first.append((index, msg))
        seen.add(index)
        run.done(index, msg)
    return first


def _header(gen: Generation) -> dict[str, Any]:
    # NOTE: system_fingerprint null in every response and chunk: OpenAI's clients read the
    # key; meshserve has no backend configuration fingerprint to put there.
    return {"id": gen.run.request_id, "created": int(time.time()), "model": gen.model, "system_fingerprint": None}


def whole(gen: Generation) -> dict[str, Any]:
    """The whole response's body: of each prompt's samples, the n best (best_of).
    NOTE: the usage counts every sample generated, as OpenAI bills best_of (vLLM counts
    only the n returned)."""
    results, shapes = gen.results, gen.shapes
    usage = usage_dict(sum(len(p) for p in gen.prompt_ids), sum(c.usage.completion_tokens for c in results),
                       cached_tokens({i: c.usage for i, c in enumerate(results)}, gen.per_prompt),
                       draft_tokens(c.usage for c in results),
                       _summed([shapes.reasoning_tokens(c.text, c.token_ids) for c in results]))
    choices = [shapes.choice(i, c) for i, c in enumerate(best_of(results, gen.per_prompt, gen.n))]
    return _header(gen) | {"object": shapes.object, "choices": choices, "usage": usage} | shapes.top_level(results)


def _summed(counts: list[int | None]) -> int | None:
    """The replies' reasoning tokens, summed; None where replies are not split."""
    return None if not counts or counts[0] is None else sum(counts)


async def chunks(gen: Generation, usage: str | None):
    """The stream's chunks, in batches (what arrived at one wake-up): one chunk per delta,
    then the usage chunk if asked (`usage` "final"; "continuous": every chunk also carries
    the usage so far, vLLM's continuous_usage_stats). Raises StreamError for an error
    reply. Closes the engine requests however it ends."""
    run, shapes = gen.run, gen.shapes
    header = _header(gen) | {"object": shapes.chunk_object}
    prompt_tokens = sum(len(p) for p in gen.prompt_ids)
    completion_tokens = streamed = 0
    usages: dict[int, Usage] = {}
    ids: dict[int, list[int]] = {}  # each sample's tokens, where usage counts its reasoning
    keep_ids = usage is not None and shapes.counts_reasoning

    def chunk(body: dict[str, Any]) -> dict[str, Any]:
        out = header | body
        if usage is not None:
            out["usage"] = usage_dict(prompt_tokens, streamed) if usage == "continuous" else None
        return out

    def event(index: int, delta: Delta) -> dict[str, Any]:
        nonlocal completion_tokens, streamed
        if delta.usage is not None:
            completion_tokens += delta.usage.completion_tokens
            usages[index] = delta.usage
        streamed += len(delta.token_ids)
        if keep_ids:
            ids.setdefault(index, []).extend(delta.token_ids)
        return chunk({"choices": [shapes.chunk_choice(index, delta)]})

    try:
        opening = [chunk(body) for body in shapes.opening()]
        if opening:
            yield opening
        pending = list(gen.first)
        while True:
            batch = [event(i, d) for i, d in pending]
            if batch:
                yield batch
            if run.all_done:
                break
            pending = [await run.queue.get()]
            while not run.queue.empty():  # whatever else arrived: one write
                pending.append(run.queue.get_nowait())
            for index, msg in pending:
                if isinstance(msg, ErrorReply):
                    raise StreamError(engine_error(msg.code, msg.message))
                run.done(index, msg)
        if usage is not None:
            final = usage_dict(prompt_tokens, completion_tokens, cached_tokens(usages, gen.n),
                               draft_tokens(usages.values()),
                               _summed([shapes.streamed_reasoning_tokens(i, ids[i]) for i in ids]))
            yield [header | {"choices": [], "usage": final}]
    finally:  # also when the client disconnects: Starlette cancels the stream
        run.close()


async def sse(batches):
    """Server-sent events of chunk batches, one write per batch, then [DONE]; an error
    after the headers is an error event that ends the stream."""
    try:
        async for batch in batches:
            yield b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in batch)
    except StreamError as e:
        yield b"data: " + msgspec.json.encode(e.error.body()) + b"\n\n"
        return
    yield b"data: [DONE]\n\n"
