"""The OpenAI-compatible HTTP API's transport (the "http" frontend): FastAPI served by uvicorn
on an event loop in a thread of its own, the thread bridge to the step loop, and the server's
own routes (/health, /v1/models, /reset_prefix_cache, /metrics).

The OpenAI pipelines (openai_serving.py) run on this event loop and reach the engine only
through the EngineLink this frontend is (engine_link.py): `submit` routes a request's replies
to its queue and puts its AddCommand into the step loop's inbox; `release` forgets the route
and aborts the request if it still runs. The step loop replies through `send()` from its own
thread; `send()` hands each message to the event loop with `call_soon_threadsafe`, into the
queue of the HTTP request it belongs to.

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
import logging
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec
import uvicorn
from prometheus_client import CollectorRegistry, Counter

from meshserve.comm.messages import ErrorReply
from meshserve.configs.schema import BatchConfig, HttpLimits
from meshserve.engine.serving.batch import BatchApi, BatchRunner, FileStore, JobStore
from meshserve.engine.serving.batch.metrics import batch_metrics
from meshserve.engine.serving.commands import AbortCommand, AddCommand, Inbox, RequestKey, ResetPrefixCacheCommand
from meshserve.engine.serving.lora_api import ServedAdapters
from meshserve.engine.serving.http_app import CountingApp, build_app, with_cors
from meshserve.engine.serving.http_protocol import limited_protocol
from meshserve.engine.serving.openai_protocol import engine_error
from meshserve.engine.serving.openai_serving import OpenAIServing
from meshserve.engine.structured import GrammarCompiler
from meshserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RESET_TIMEOUT = 30.0
"""Seconds POST /reset_prefix_cache waits for the step loop."""


def bind_socket(address: str) -> socket.socket:
    """A listening TCP socket at HOST:PORT (port 0: any free port); OSError if taken."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on accepted sockets whose proto says TCP. With it on, a stream's first
    # event waited in the kernel for the client's ACK of the response headers, which a client
    # in the middle of an exchange delays (Linux's delayed ACK): the first token reached the
    # client one delayed-ACK timeout after the server sent it.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"server.http={address}: cannot bind ({e.strerror or e})") from None
    sock.setblocking(False)
    return sock


class HttpFrontend:
    """The HTTP transport of one served model, and the EngineLink of its OpenAI pipelines."""

    tag = "http"

    def __init__(self, address: str, inbox: Inbox, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 model_name: str, registry: CollectorRegistry | None = None, api_key: str | None = None,
                 limits: HttpLimits | None = None, metrics_public: bool = False,
                 cors_allowed_origins: tuple[str, ...] | list[str] = ("*",), grammars: GrammarCompiler | None = None,
                 adapters: dict[str, str] | None = None, max_stored_responses: int = 1000,
                 reasoning_parser: str | None = None, batch: BatchConfig | None = None):
        """`api_key`: every path but /health (and /metrics if `metrics_public`) needs
        `Authorization: Bearer <api_key>`. `cors_allowed_origins`: the web origins that may
        call the API from a browser ("*": any). `grammars`: compiles structured-output
        constraints (one is made if not given). `adapters`: the LoRA adapters served at start
        (name -> directory), where the server serves adapters (None: it serves none).
        `max_stored_responses`: the Responses API's store (server.responses.max_stored).
        `reasoning_parser`: server.reasoning_parser. `batch`: server.batch (the Batch API,
        on where its data_dir is set)."""
        limits = limits or HttpLimits()
        self.inbox = inbox
        self.model_name, self.max_model_len = model_name, max_model_len
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
        self._responses = Counter("meshserve_http_responses", "HTTP responses by path and status", ["path", "status"],
                                  registry=self.registry)
        self.adapters = ServedAdapters(model_name, max_model_len, adapters, inbox) if adapters is not None else None
        self.serving = OpenAIServing(self, tokenizer, vocab_size, max_model_len, model_name, grammars, self.adapters,
                                     max_stored_responses, reasoning_parser)
        self.batch = self._batch_api(batch) if batch is not None and batch.data_dir is not None else None
        self.app = build_app(self.serving, self.health, self.models, self.reset_prefix_cache, self.registry,
                             self.batch)
        open_paths = ("/health", "/metrics") if metrics_public else ("/health",)
        app = with_cors(CountingApp(self.app, self._responses, api_key, open_paths, limits.read_timeout,
                                    batch.max_file_bytes if self.batch is not None else 0),
                        list(cors_allowed_origins))
        self._server = uvicorn.Server(uvicorn.Config(
            app, http=limited_protocol(limits.max_connections, limits.read_timeout), log_level="warning",
            access_log=False, lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=limits.keep_alive))
        self._thread = threading.Thread(target=self._serve, name="meshserve-http", daemon=True)

    def _batch_api(self, config: BatchConfig) -> BatchApi:
        """The Files and Batch APIs on `config.data_dir`, with their runner (started with the
        event loop) and metrics."""
        root = Path(config.data_dir).expanduser()
        files, jobs = FileStore(root / "files", config.max_file_bytes, config.max_files), JobStore(root / "batches")
        runner = BatchRunner(jobs, files, self.serving.run_background, config.max_in_flight, config.max_requests,
                             lambda: self.accepting)
        batch_metrics(runner, self.registry)
        return BatchApi(files, jobs, runner, self.max_model_len)

    # ------------------------------------------------------------------ EngineLink (event-loop thread)

    def submit(self, command: AddCommand, replies: asyncio.Queue, index: int) -> None:
        self._routes[command.key] = (replies, index)
        self.inbox.put(command)

    def release(self, key: RequestKey, abort: bool) -> None:
        self._routes.pop(key, None)
        if abort:
            self.inbox.put(AbortCommand(key))

    # ------------------------------------------------------------------ Frontend protocol

    def start(self) -> None:
        self._thread.start()

    def send(self, key: RequestKey, message: msgspec.Struct) -> None:
        """Hand a reply to the event loop (called from the step loop's thread)."""
        self.send_all([(key, message)])

    def send_all(self, replies: list[tuple[RequestKey, msgspec.Struct]]) -> None:
        """Hand a step's replies to the event loop in one wake-up: each call_soon_threadsafe
        writes to the loop's self-pipe, which, once per reply, costs the step loop time that
        grows with the number of streams."""
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
        self.serving.close()

    # ------------------------------------------------------------------ event-loop thread

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        if self.batch is not None:  # the jobs a previous run left resume first
            self._loop.call_soon(self.batch.runner.start)
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

    # ------------------------------------------------------------------ the server's own routes

    def models(self) -> dict[str, Any]:
        cards = self.adapters.model_cards() if self.adapters is not None else []
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "meshserve", "max_model_len": self.max_model_len}, *cards]}

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
