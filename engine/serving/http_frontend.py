"""The OpenAI-compatible HTTP API (the "http" frontend): FastAPI served by uvicorn on an
event loop in a thread of its own.

A handler reads the body (MAX_BODY_BYTES, within read_timeout), validates it with every size
bounded before it is parsed (request_body.py), tokenizes on a worker pool (off the
event loop; each prompt's length is checked as soon as it is tokenized) and compiles its
structured-output or forced-tool-call constraint there too, then puts one AddCommand per
sample (prompts x n) into the step loop's inbox. The
step loop replies through `send()` from its own thread; `send()` hands each message to
the event loop with `call_soon_threadsafe`, into the asyncio queue of the HTTP request it
belongs to. A client that disconnects, streaming or not, gets its engine requests aborted.

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad
parameters and prompts that are too long (and for requests h11 cannot parse:
http_protocol.py), 404 for an unknown model or path, 408 for a body not sent within
read_timeout, 413 for a body over MAX_BODY_BYTES, 429 when the scheduler's queue is full, 503
while the server drains or once it stopped, and 500 with a request id for anything nobody
expected (its traceback goes to the log, never its text to the client). With an API key
(server.api_key) every path but /health (and /metrics if server.metrics.public) needs
`Authorization: Bearer <key>`, else 401. CORS (server.cors_allowed_origins) wraps it all: a
browser's preflight is answered before the key is asked for, and every answer, a 401 too,
carries the headers a web page needs to read it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import msgspec
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter

from meshserve.comm.messages import Completion, Delta, ErrorReply, SamplingParams, Usage
from meshserve.configs.schema import HttpLimits
from meshserve.engine.serving.commands import AbortCommand, AddCommand, Inbox, RequestKey, ResetPrefixCacheCommand
from meshserve.engine.serving.openai_protocol import (MAX_N, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                                      StreamOptions, check_model, engine_error, from_request_error,
                                                      ignored_fields)
from meshserve.engine.serving.openai_shapes import (ChatShapes, ChoiceContext, CompletionShapes, LogprobFormatter,
                                                    best_of, cached_tokens, draft_tokens, usage_dict)
from meshserve.engine.serving.http_app import (IGNORED_HEADER, ClientDisconnected, CountingApp, EventStream,
                                               StreamError, build_app, with_cors)
from meshserve.engine.serving.responses_api import ResponsesApi
from meshserve.engine.serving.http_protocol import limited_protocol
from meshserve.engine.serving.request_body import parse_body
from meshserve.engine.serving.tokenize_api import TokenizerApi, encode_chat, template_input
from meshserve.engine.serving.tokenize_pool import TokenizePool
from meshserve.engine.serving.structured_request import grammar_spec
from meshserve.engine.serving.tools import (ToolRequestError, chat_template_source, forced_call, render_messages,
                                            tool_format_for)
from meshserve.engine.structured import Grammar, GrammarCompiler, GrammarSpec
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.admission import RequestError, admit_prompt, check_chars, check_prompt

log = logging.getLogger(__name__)

TOKENIZER_THREADS = 1
"""One: a tokenizing thread takes a core from the model's steps (a burst of long prompts on two
threads takes both cores of a 2-core machine); shortest first keeps short prompts ahead of long ones."""
DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions (chat defaults to the rest of the context)."""
RESET_TIMEOUT = 30.0
"""Seconds POST /reset_prefix_cache waits for the step loop."""


class _Disconnected:
    """Put in a request's queue when its client goes away."""


DISCONNECTED = _Disconnected()


def bind_socket(address: str) -> socket.socket:
    """A listening TCP socket at HOST:PORT (port 0: any free port); OSError if taken."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"server.http={address}: cannot bind ({e.strerror or e})") from None
    sock.setblocking(False)
    return sock


@dataclass
class Generation:
    """The engine requests of one HTTP request, submitted: whole results, or (streamed) each
    sample's first delta."""

    run: "_Samples"
    shapes: Any
    prompt_ids: list[list[int]]
    per_prompt: int
    """Samples per prompt (best_of)."""
    n: int
    """Choices per prompt."""
    results: list[Completion] | None = None
    first: list[tuple[int, Delta]] | None = None


class _Samples:
    """The engine requests of one HTTP request (prompts x n), and the queue their replies
    arrive in as (sample index, message)."""

    def __init__(self, frontend: "HttpFrontend", request_id: str):
        self.frontend, self.request_id = frontend, request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.keys: list[RequestKey] = []
        self.finished: set[int] = set()
        self._closed = False

    def submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool, cache_salt: str | None,
               grammar: Grammar | None = None) -> None:
        index = len(self.keys)
        key = RequestKey(HttpFrontend.tag, self.request_id, f"{self.request_id}-{index}")
        self.keys.append(key)
        self.frontend._routes[key] = (self.queue, index)
        self.frontend.inbox.put(AddCommand(key, key.request_id, prompt_ids, params, stream, cache_salt, grammar))

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
        """Forget the routes; abort the samples that are still running (the client left,
        another sample failed, or the handler was cancelled). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for index, key in enumerate(self.keys):
            self.frontend._routes.pop(key, None)
            if index not in self.finished:
                self.frontend.inbox.put(AbortCommand(key))


class HttpFrontend:
    tag = "http"

    def __init__(self, address: str, inbox: Inbox, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 model_name: str, registry: CollectorRegistry | None = None, api_key: str | None = None,
                 limits: HttpLimits | None = None, metrics_public: bool = False,
                 cors_allowed_origins: tuple[str, ...] | list[str] = ("*",), grammars: GrammarCompiler | None = None):
        """`api_key`: every path but /health (and /metrics if `metrics_public`) needs
        `Authorization: Bearer <api_key>`. `cors_allowed_origins`: the web origins that may
        call the API from a browser ("*": any). `grammars`: compiles structured-output
        constraints (one is made if not given)."""
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)
        limits = limits or HttpLimits()
        self.inbox, self.tokenizer = inbox, tokenizer
        self.vocab_size, self.max_model_len, self.model_name = vocab_size, max_model_len, model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.accepting = True
        self.error: BaseException | None = None
        self.stopped = False
        """Set by close(): /health answers 503 from then on."""
        self.failure: str | None = None
        """Why the engine died (fail()): /health answers 503 with it."""
        self.health_source: Callable[[], tuple[int, dict]] | None = None
        """What /health answers while serving, if not plain `ok` (a front door's replicas)."""
        self._sock = bind_socket(address)
        host, port = self._sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._loop = asyncio.new_event_loop()
        self._routes: dict[RequestKey, tuple[asyncio.Queue, int]] = {}
        self._tokenize_pool = TokenizePool(TOKENIZER_THREADS, "meshserve-http-tokenize")
        self._ignored_logged: set[str] = set()
        """Names of ignored request fields already logged (each once)."""
        self._token_text = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self._responses = Counter("meshserve_http_responses", "HTTP responses by path and status", ["path", "status"],
                                  registry=self.registry)
        self.tokenizer_api = TokenizerApi(tokenizer, vocab_size, max_model_len, model_name, self._in_thread)
        self.chat_template = chat_template_source(tokenizer.hf.chat_template)
        self.tool_format = tool_format_for(self.chat_template)
        """How the model writes tool calls (engine/serving/tools), from its chat template."""
        self.responses = ResponsesApi(self)
        self.app = build_app(self)
        open_paths = ("/health", "/metrics") if metrics_public else ("/health",)
        app = with_cors(CountingApp(self.app, self._responses, api_key, open_paths, limits.read_timeout),
                        list(cors_allowed_origins))
        self._server = uvicorn.Server(uvicorn.Config(
            app, http=limited_protocol(limits.max_connections, limits.read_timeout), log_level="warning",
            access_log=False, lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=limits.keep_alive))
        self._thread = threading.Thread(target=self._serve, name="meshserve-http", daemon=True)

    # ------------------------------------------------------------------ Frontend protocol

    def start(self) -> None:
        self._thread.start()

    def send(self, key: RequestKey, message: msgspec.Struct) -> None:
        """Hand a reply to the event loop (called from the step loop's thread)."""
        self.send_all([(key, message)])

    def send_all(self, replies: list[tuple[RequestKey, msgspec.Struct]]) -> None:
        """Hand a step's replies to the event loop in one wake-up: each call_soon_threadsafe
        writes to the loop's self-pipe, which per reply took ~3% of the step loop's time at 32
        streams (py-spy on `meshserve serve` under `meshserve bench`)."""
        try:
            self._loop.call_soon_threadsafe(self._deliver_all, replies)
        except RuntimeError:  # the loop is closed: the server is stopping, nobody is listening
            pass

    def fail(self, keys: list[RequestKey], message: str) -> None:
        """The engine is dead: /health answers 503, new requests are refused, and every
        waiting handler gets an `unavailable` error (any thread)."""
        self.failure = message
        self.accepting = False
        for key in keys:
            self.send(key, ErrorReply(None, "unavailable", message))

    def close(self) -> None:
        self.stopped = True
        self.accepting = False
        if self._thread.is_alive():
            self.send(None, None)  # wakes the loop; see _deliver
            self._server.should_exit = True
            self._thread.join(timeout=15)
        else:
            self._sock.close()
            self._loop.close()
        self._tokenize_pool.close()

    # ------------------------------------------------------------------ event-loop thread

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))
            if not self.stopped:
                raise RuntimeError("the HTTP server stopped by itself")
        except BaseException as e:  # noqa: BLE001 - the step loop reports it
            log.exception("the HTTP frontend died")
            self.error = e
        finally:
            self._loop.close()

    def _deliver_all(self, replies: list[tuple[RequestKey, Any]]) -> None:
        for key, message in replies:
            self._deliver(key, message)

    def _deliver(self, key: RequestKey | None, message: Any) -> None:
        if key is None:  # close(): whoever still waits gets an error instead of hanging
            for queue, index in list(self._routes.values()):
                queue.put_nowait((index, ErrorReply(None, "unavailable", "the server stopped")))
            return
        route = self._routes.get(key)
        if route is not None:  # else the HTTP request is gone (aborted, disconnected)
            queue, index = route
            queue.put_nowait((index, message))

    async def _in_thread(self, size: int, fn, *args):
        """fn(*args) in the tokenize pool (shortest job first, by `size`)."""
        return await asyncio.wrap_future(self._tokenize_pool.submit(size, fn, *args))

    # ------------------------------------------------------------------ handlers

    def _check_common(self, req) -> None:
        if not self.accepting:
            raise engine_error("unavailable", "the server is shutting down and accepts no new requests")
        check_model(req.model, self.model_name)
        req.check_supported()

    async def _encode_prompt(self, prompt: str | list[int], params: SamplingParams,
                             keep: int | None) -> tuple[list[int], bool]:
        """The prompt's token ids, its length checked at once (the next prompt is not tokenized
        if this one is too long), and whether they were cut: with `keep` (truncate_prompt_tokens)
        only the last `keep` tokens stay, and the length is checked after the cut."""
        try:
            if keep is None:
                args = (self.tokenizer, prompt, params, self.vocab_size, self.max_model_len)
                ids = admit_prompt(*args) if isinstance(prompt, list) else await self._in_thread(
                    len(prompt), admit_prompt, *args)
                return ids, False
            if isinstance(prompt, str):
                check_chars(len(prompt), self.max_model_len)
                prompt = await self._in_thread(len(prompt), self.tokenizer.encode, prompt)
            ids = prompt[-keep:]
            check_prompt(ids, params, self.vocab_size, self.max_model_len)
        except RequestError as e:
            raise from_request_error(e, "prompt") from None
        return ids, len(ids) < len(prompt)

    async def completions(self, raw: Request) -> Response:
        req = parse_body(await raw.body(), CompletionRequest, self.max_model_len)
        self._check_common(req)
        prompts = req.prompts()
        if len(prompts) * req.num_samples > MAX_N:
            param = "n" if req.best_of is None else "best_of"
            raise OpenAIError(400, f"{len(prompts)} prompts x {param}={req.num_samples} exceeds {MAX_N} samples",
                              param=param)
        keep = req.prompt_keep(self.max_model_len)
        max_tokens = req.max_tokens or DEFAULT_COMPLETION_TOKENS
        params = req.sampling_params(max_tokens, req.engine_logprobs, req.seed)
        req.check_params(params, self.vocab_size)
        ids, echo = [], []
        for prompt in prompts:
            prompt_ids, cut = await self._encode_prompt(prompt, params, keep)
            ids.append(prompt_ids)
            if req.echo:  # the prompt as sent, or the text of the token ids that stay
                echo.append(prompt if isinstance(prompt, str) and not cut else
                            await self._in_thread(len(prompt_ids), self.tokenizer.decode, prompt_ids, False))
        context = ChoiceContext(ids, req.n, echo or None, req.return_token_ids, req.prompt_logprobs is not None,
                                req.echo and req.logprobs is not None)
        formatter = LogprobFormatter(self._token_text)
        shapes = CompletionShapes(formatter if req.logprobs is not None else None, context, formatter)
        grammar = await self._grammar(grammar_spec(req))
        return await self._generate(req, raw, ids, max_tokens, req.engine_logprobs, shapes, "prompt", grammar)

    async def chat(self, raw: Request) -> Response:
        req = parse_body(await raw.body(), ChatCompletionRequest, self.max_model_len)
        self._check_common(req)
        return await self._generate(req, raw, *await self.prepare_chat(req))

    async def start_chat(self, req: ChatCompletionRequest, raw: Request) -> Generation:
        """A chat request another API translated (responses_api.py), submitted."""
        self._check_common(req)
        return await self._start(req, raw, *await self.prepare_chat(req))

    async def prepare_chat(self, req: ChatCompletionRequest) -> tuple:
        """What a chat request's generation needs: (prompt ids, max_tokens, logprobs, shapes,
        the prompt's parameter name, the compiled constraint)."""
        keep = req.prompt_keep(self.max_model_len)
        messages, chars = template_input(req.messages, self.max_model_len)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages):
            messages, tool_kwargs = self._tool_messages(req)
            kwargs |= tool_kwargs
        ids = await self._in_thread(chars + len(messages), encode_chat, self.tokenizer, messages,
                                    req.add_generation_prompt, req.continue_final_message, kwargs)
        if keep is not None:
            ids = ids[-keep:]
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, self.max_model_len - len(ids))
        context = ChoiceContext([ids], req.n, [req.echo_text()], req.return_token_ids, req.prompt_logprobs is not None)
        formatter = LogprobFormatter(self._token_text)
        shapes = ChatShapes(formatter if req.logprobs else None, context,
                            self.tool_format if req.uses_tools else None, formatter)
        grammar = await self._grammar(self._chat_constraint(req))
        return [ids], max_tokens, req.engine_logprobs, shapes, "messages", grammar

    def _tool_messages(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation with its tools, calls and results as the model's template takes
        them (engine/serving/tools). NOTE: with tool_choice "none" the tools stay out of the
        prompt: the model is not to call them."""
        tools = req.tools if req.tool_choice != "none" else None
        try:
            return render_messages([m.as_tool_input() for m in req.messages], tools, self.chat_template,
                                   self.tool_format)
        except ToolRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None

    def _chat_constraint(self, req: ChatCompletionRequest) -> GrammarSpec | None:
        """The output's constraint: the request's structured output, or a forced tool call's
        (tool_choice required or named: the call's arguments follow the function's schema)."""
        spec = grammar_spec(req)
        forced = forced_call(req.tools, req.tool_choice, self.tool_format) if req.tools else None
        if forced is None:
            return spec
        if spec is not None:
            raise OpenAIError(400, f"{spec.param} and tool_choice={json.dumps(req.tool_choice)[:80]} both constrain "
                                   f"the output: give one", param="tool_choice", code="invalid_value")
        return GrammarSpec("json", json.dumps(forced.schema), forced.prefix, forced.suffix, "tool_choice")

    async def _grammar(self, spec: GrammarSpec | None) -> Grammar | None:
        """`spec` compiled on the tokenize pool (cached by spec), or a 400 naming its parameter."""
        if spec is None:
            return None
        try:
            return await self._in_thread(len(spec.value), self.grammars.compile, spec)
        except RequestError as e:
            raise engine_error(e.code, e.message, e.param) from None

    async def _start(self, req, raw: Request, prompt_ids: list[list[int]], max_tokens: int, logprobs: int | None,
                     shapes, prompt_param: str, grammar: Grammar | None = None) -> Generation:
        """Submit req.num_samples engine requests per prompt (seed + j for sample j); wait for
        all their results (whole) or their first deltas (streamed, so an error still gets its
        status code)."""
        samples = []  # (prompt ids, params), sample index = prompt index * num_samples + j
        for ids in prompt_ids:
            for j in range(req.num_samples):
                # NOTE: sample j gets seed + j: the same seed for all would make n identical samples.
                seed = None if req.seed is None else (req.seed + j) % (1 << 63)
                params = req.sampling_params(max_tokens, logprobs, seed)
                req.check_params(params, self.vocab_size)
                try:
                    check_prompt(ids, params, self.vocab_size, self.max_model_len)
                except RequestError as e:
                    raise from_request_error(e, prompt_param) from None
                samples.append((ids, params))
        run = _Samples(self, f"{shapes.id_prefix}{uuid.uuid4().hex}")
        gen = Generation(run, shapes, prompt_ids, req.num_samples, req.n)
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(raw, run.queue))
        try:
            for ids, params in samples:
                run.submit(ids, params, req.stream, req.cache_salt, grammar)
            if req.stream:
                gen.first = await self._first_replies(run)
            else:
                gen.results = await self._collect(run)
                run.close()
        except BaseException:
            run.close()
            raise
        finally:
            watcher.cancel()
        return gen

    async def _generate(self, req, raw: Request, prompt_ids: list[list[int]], max_tokens: int,
                        logprobs: int | None, shapes, prompt_param: str, grammar: Grammar | None = None) -> Response:
        """Answer with `shapes`' choices, whole or streamed."""
        gen = await self._start(req, raw, prompt_ids, max_tokens, logprobs, shapes, prompt_param, grammar)
        headers = self._ignored_header(req)
        if not req.stream:
            return JSONResponse(self.whole(gen), headers=headers)
        options = req.stream_options or StreamOptions()
        usage = "continuous" if options.continuous_usage_stats else "final" if options.include_usage else None
        return EventStream(self._sse(self.chunks(gen, usage)), gen.run.close, headers)

    def _ignored_header(self, req) -> dict[str, str]:
        """The request's fields this server ignores, for the response header (and, the first
        time each is seen, the log)."""
        ignored = ignored_fields(req)
        fresh = [name for name in ignored if name not in self._ignored_logged]
        if fresh:
            self._ignored_logged.update(fresh)
            log.warning("ignoring request fields this server does not know: %s (each logged once; the responses "
                        "name them in %s)", ", ".join(fresh), IGNORED_HEADER)
        return {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}

    @staticmethod
    def _check_reply(msg: Any) -> None:
        if msg is DISCONNECTED:
            raise ClientDisconnected()
        if isinstance(msg, ErrorReply):
            raise engine_error(msg.code, msg.message)

    async def _collect(self, run: _Samples) -> list[Completion]:
        results = [Completion(f"{run.request_id}-{i}") for i in range(len(run.keys))]
        while not run.all_done:
            index, msg = await run.queue.get()
            self._check_reply(msg)
            results[index].add(msg)
            run.done(index, msg)
        if any(c.finish_reason == "abort" for c in results):
            raise engine_error("unavailable", "the request was aborted: the server is shutting down")
        return results

    async def _first_replies(self, run: _Samples) -> list[tuple[int, Delta]]:
        """Wait for every sample's first delta, so an error reply still gets its status code."""
        first, seen = [], set()
        while len(seen) < len(run.keys):
            index, msg = await run.queue.get()
            self._check_reply(msg)
            first.append((index, msg))
            seen.add(index)
            run.done(index, msg)
        return first

    def _header(self, run: _Samples) -> dict[str, Any]:
        # NOTE: system_fingerprint null in every response and chunk: OpenAI's clients read the
        # key; meshserve has no backend configuration fingerprint to put there.
        return {"id": run.request_id, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": None}

    def whole(self, gen: Generation) -> dict[str, Any]:
        """The whole response's body: of each prompt's samples, the n best (best_of).
        NOTE: the usage counts every sample generated, as OpenAI bills best_of (vLLM counts
        only the n returned)."""
        results, shapes = gen.results, gen.shapes
        usage = usage_dict(sum(len(p) for p in gen.prompt_ids), sum(c.usage.completion_tokens for c in results),
                           cached_tokens({i: c.usage for i, c in enumerate(results)}, gen.per_prompt),
                           draft_tokens(c.usage for c in results))
        choices = [shapes.choice(i, c) for i, c in enumerate(best_of(results, gen.per_prompt, gen.n))]
        return self._header(gen.run) | {"object": shapes.object, "choices": choices, "usage": usage} | (
            shapes.top_level(results))

    async def chunks(self, gen: Generation, usage: str | None):
        """The stream's chunks, in batches (what arrived at one wake-up): one chunk per delta,
        then the usage chunk if asked (`usage` "final"; "continuous": every chunk also carries
        the usage so far, vLLM's continuous_usage_stats). Raises StreamError for an error
        reply. Closes the engine requests however it ends."""
        run, shapes = gen.run, gen.shapes
        header = self._header(run) | {"object": shapes.chunk_object}
        prompt_tokens = sum(len(p) for p in gen.prompt_ids)
        completion_tokens = streamed = 0
        usages: dict[int, Usage] = {}

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
                                   draft_tokens(usages.values()))
                yield [header | {"choices": [], "usage": final}]
        finally:  # also when the client disconnects: Starlette cancels the stream
            run.close()

    @staticmethod
    async def _sse(batches):
        """Server-sent events of chunk batches, one write per batch, then [DONE]; an error
        after the headers is an error event that ends the stream."""
        try:
            async for batch in batches:
                yield b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in batch)
        except StreamError as e:
            yield b"data: " + msgspec.json.encode(e.error.body()) + b"\n\n"
            return
        yield b"data: [DONE]\n\n"

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "meshserve", "max_model_len": self.max_model_len}]}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """vLLM's POST /reset_prefix_cache. Safe while requests run: the step loop forgets the
        cached blocks between steps, and the blocks of running requests stay theirs."""
        if self.failure is not None or self.stopped:
            raise engine_error("unavailable", "the server is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(ResetPrefixCacheCommand(done))
        try:
            dropped = await asyncio.wait_for(asyncio.wrap_future(done), RESET_TIMEOUT)
        except asyncio.TimeoutError:
            raise engine_error("unavailable", f"the step loop did not answer within {RESET_TIMEOUT:.0f} s") from None
        log.info("prefix cache reset: %d cached blocks forgotten", dropped)
        return {"status": "ok", "dropped_blocks": dropped}

    def health(self) -> tuple[int, dict]:
        if self.failure is not None:
            return 503, {"status": "failed", "reason": self.failure}
        if self.stopped:
            return 503, {"status": "stopped"}
        if not self.accepting:
            return 503, {"status": "draining"}
        if self.health_source is not None:
            return self.health_source()
        return 200, {"status": "ok"}


async def _watch_disconnect(raw: Request, queue: asyncio.Queue) -> None:
    """Until cancelled: tell the handler if its client goes away. Only while no response is
    being sent (once streaming, Starlette itself watches and cancels the stream)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait((None, DISCONNECTED))
            return
