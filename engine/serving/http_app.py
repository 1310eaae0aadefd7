"""The ASGI side of the HTTP frontend: the routes (build_app) from the OpenAI serving object
and the transport's own handlers, the wrapper that counts responses, checks the API key and
bounds bodies (CountingApp), CORS, and the error handlers that answer in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from meshserve.engine.serving.batch import BatchApi
from meshserve.engine.serving.openai_generation import ClientDisconnected
from meshserve.engine.serving.openai_protocol import IGNORED_HEADER, OpenAIError
from meshserve.engine.serving.openai_serving import OpenAIServing
from meshserve.engine.serving.request_body import MAX_BODY_BYTES
from meshserve.engine.serving.tokenize_api import meshserve_version

log = logging.getLogger("meshserve.engine.serving.http_frontend")

COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
                 "/metrics", "/reset_prefix_cache", "/tokenize", "/detokenize", "/tokenizer_info", "/version",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/files", "/v1/batches")
UPLOAD_PATH = "/v1/files"
"""The one path whose bodies may exceed MAX_BODY_BYTES: file uploads (server.batch.max_file_bytes)."""
FORM_OVERHEAD = 1 << 20
"""Room for a multipart form's own bytes around the file."""


ADMIN_PREFIX = "/admin/"
"""The front door's admin API, which checks its own key (engine/serving/replicas/admin.py)."""


class BodyTooLarge(Exception):
    """A body sent without Content-Length (chunked) grew past its limit (the argument) while read."""


class BodyTimeout(Exception):
    """The body did not arrive whole within the read timeout."""


class CountingApp:
    """ASGI wrapper: counts responses by path and status, checks the API key (401; not on the
    admin API's paths, which need the admin key instead), refuses
    oversized bodies (413) before anything reads them and slow ones (408), and answers an
    exception nobody handled with a 500 in OpenAI's shape."""

    def __init__(self, app, counter: Counter, api_key: str | None, open_paths: tuple[str, ...],
                 read_timeout: float, max_upload_bytes: int = 0):
        """`max_upload_bytes`: the largest file POSTed to /v1/files (0: none; the Batch API is off)."""
        self.app, self.counter, self.open_paths, self.read_timeout = app, counter, open_paths, read_timeout
        self.max_upload = max_upload_bytes + FORM_OVERHEAD if max_upload_bytes else MAX_BODY_BYTES
        self._api_key = None if api_key is None else api_key.encode()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients), or `x-api-key: KEY` (Anthropic's)."""
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        if b"x-api-key" in headers:
            return hmac.compare_digest(headers[b"x-api-key"].strip(), self._api_key)
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in COUNTED_PATHS else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        headers = dict(scope.get("headers") or [])
        checked = scope["path"] not in self.open_paths and not scope["path"].startswith(ADMIN_PREFIX)
        if self._api_key is not None and checked and not self._authorized(headers):
            err = OpenAIError(401, "missing or wrong API key: send `Authorization: Bearer <key>` with the key of "
                                   "server.api_key", code="invalid_api_key")
            return await JSONResponse(err.body(), err.status, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, counting_send)
        length = headers.get(b"content-length")
        limit = self.max_upload if scope["path"] == UPLOAD_PATH else MAX_BODY_BYTES
        if length is not None and length.isdigit() and int(length) > limit:
            err = OpenAIError(413, f"the request body has {int(length)} bytes; the limit is {limit}",
                              code="request_too_large")
            return await JSONResponse(err.body(), err.status)(scope, receive, counting_send)
        received, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + self.read_timeout

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # after the body: only a disconnect can come, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except Exception:  # noqa: BLE001 - the app's handler answered and logged it, unless nothing started
            if not started:
                request_id = uuid.uuid4().hex
                log.exception("request %s: internal error", request_id)
                err = internal_error(request_id)
                await JSONResponse(err.body(), err.status)(scope, receive, counting_send)


def internal_error(request_id: str) -> OpenAIError:
    return OpenAIError(500, f"internal server error (request id {request_id}; the server log has the details)",
                       type="server_error", code="internal_error")


def build_app(serving: OpenAIServing, health: Callable[[], tuple[int, dict]], models: Callable[[], dict[str, Any]],
              reset_prefix_cache: Callable[[], Awaitable[dict[str, Any]]], registry: CollectorRegistry,
              batch: BatchApi | None = None) -> FastAPI:
    """The routes: OpenAI's and the tokenizer's from `serving`; /health, /v1/models,
    /reset_prefix_cache and /metrics from the transport's handlers, given here; the Files
    and Batch APIs from `batch` (None: they answer 404, saying how to turn them on)."""
    app = FastAPI(title="meshserve", description="OpenAI-compatible API of a meshserve server")
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serving.responses.create(request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await serving.messages.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str):
        return serving.responses.retrieve(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        return serving.responses.delete(request, response_id)

    def batches() -> BatchApi:
        if batch is None:
            raise OpenAIError(404, "the Batch API is off on this server: start it with server.batch.data_dir set",
                              code="not_found")
        return batch

    @app.post("/v1/files")
    async def upload_file(request: Request):
        return await batches().upload(request)

    @app.get("/v1/files")
    async def list_files(request: Request):
        return batches().list_files(request)

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str):
        return batches().retrieve_file(request, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str):
        return batches().file_content(request, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str):
        return batches().delete_file(request, file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return await batches().create(request)

    @app.get("/v1/batches")
    async def list_batches(request: Request):
        return batches().list(request)

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str):
        return batches().retrieve(request, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str):
        return batches().cancel(request, batch_id)

    @app.get("/v1/models")
    async def list_models():
        return models()

    @app.get("/health")
    async def get_health():
        status, body = health()
        return JSONResponse(body, status)

    @app.post("/reset_prefix_cache")
    async def post_reset_prefix_cache():
        return await reset_prefix_cache()

    def adapters():
        if serving.adapters is None:
            raise OpenAIError(400, "this server serves no LoRA adapters (start it with lora.enabled=true or "
                                   "--enable-lora)", code="invalid_value")
        return serving.adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return PlainTextResponse(await adapters().load(await request.body()))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return PlainTextResponse(await adapters().unload(await request.body()))

    @app.get("/metrics")
    async def metrics():
        # NOTE: on a thread: a front door's registry reads its replicas' /metrics over HTTP
        text = await asyncio.to_thread(generate_latest, registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenizer_api.tokenize(await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.tokenizer_api.detokenize(await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving.tokenizer_api.info()

    @app.get("/version")
    async def version():
        return {"version": meshserve_version()}

    return app


def with_cors(app, allowed_origins: list[str]) -> CORSMiddleware:
    """`app` behind CORS for `allowed_origins` (vLLM's defaults otherwise: any method and
    header, no credentials). NOTE: outside the API key check, so a preflight (which a browser
    sends without credentials) is answered without one; and every answer, 401s included,
    carries the headers that let a web page read it."""
    return CORSMiddleware(app, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                          allow_credentials=False, expose_headers=[IGNORED_HEADER])


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; an unexpected one as a 500 with a request id."""

    def error(err: OpenAIError, headers=None) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error(exc)

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(request: Request, exc: BodyTooLarge):
        limit = exc.args[0] if exc.args else MAX_BODY_BYTES
        return error(OpenAIError(413, f"the request body exceeds {limit} bytes", code="request_too_large"))

    @app.exception_handler(BodyTimeout)
    async def _body_timeout(request: Request, exc: BodyTimeout):
        return error(OpenAIError(408, "the request body did not arrive whole within the read timeout "
                                      "(server.http_limits.read_timeout)", code="request_timeout"),
                     headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
        return error(err, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        request_id = uuid.uuid4().hex
        log.error("request %s: internal error", request_id, exc_info=exc)
        return error(internal_error(request_id))
