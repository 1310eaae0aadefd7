"""The client-facing ZMQ ROUTER socket (the "zmq" frontend), owned by one I/O thread.

The I/O thread decodes each frame once, typed and bounded (comm/messages.py), checks its
parameters, and hands typed commands to the step loop through a queue. Prompt strings are
tokenized on a worker pool, shortest first, never on the I/O thread (a 0.5 M-character
prompt takes a second). Replies go the other way through an inproc PUSH/PULL pair, so only the I/O thread
ever touches the ROUTER socket. A bad frame gets an ErrorReply for that frame alone;
nothing else is affected.

With server.secret every frame carries an HMAC tag (comm/auth.py), both ways; with
server.curve the connection is also CURVE-encrypted (comm/curve.py: a client without the
secret cannot even connect). A frame that
does not open with the secret gets an "unauthorized" ErrorReply, unsealed (its sender could
not read a sealed one), and nothing else: it is never decoded as a request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from meshserve.comm.auth import TAG_BYTES, DropLog, FrameAuth
from meshserve.comm.curve import CurveAuthenticator, make_curve_server
from meshserve.comm.messages import (AbortRequest, Delta, ErrorCode, ErrorReply, GenerateRequest, KvReady, Usage,
                                     client_decoder, encoder)
from meshserve.engine.serving.commands import AbortCommand, AddCommand, Inbox, KvReadyCommand, RequestKey
from meshserve.engine.serving.tokenize_pool import TokenizePool
from meshserve.engine.structured import GrammarCompiler, GrammarSpec, spec_from_message
from meshserve.engine.tokenizer import Tokenizer
from meshserve.engine.admission import RequestError, admit_prompt, check_admissible, prompt_source

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 << 20
"""A larger frame gets a too_long error reply."""
MAX_FRAME_BYTES = 256 << 20
"""ZeroMQ drops a connection that sends a frame larger than this (no reply is possible)."""
CLOSE_QUIET_S = 0.5
"""On close, the router stays open until this long after its last reply: a socket closed
right after a send can lose what its I/O thread had not yet written (seen under load,
even with LINGER), and a client would wait for its final message in vain."""


class _RequestId(msgspec.Struct):
    """The one field read from a frame that failed validation, for its error reply (every
    other field is skipped, never built: a frame of 16 M empty arrays costs nothing)."""

    request_id: str | None = None


class ZmqFrontend:
    tag = "zmq"

    def __init__(self, address: str, inbox: Inbox, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 secret: str | None = None, curve: bool = False, grammars: GrammarCompiler | None = None):
        """`curve`: CURVE-encrypt client connections with keys derived from `secret`.
        `grammars`: compiles structured-output constraints (one is made if not given)."""
        self.address = address
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.inbox = inbox
        self.accepting = True
        self._ctx = zmq.Context()
        self._encoder = encoder()
        self._auth = FrameAuth(secret, "client")
        self._refused = DropLog(log)
        self._out_address = f"inproc://meshserve-replies-{id(self)}"
        self._push = self._ctx.socket(zmq.PUSH)  # used by the step-loop thread only
        self._push.bind(self._out_address)
        self._router = self._ctx.socket(zmq.ROUTER)  # used by the I/O thread only, after start()
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._router.setsockopt(zmq.LINGER, 1000)
        self._curve: CurveAuthenticator | None = None
        try:
            if curve:
                if secret is None:
                    raise ValueError("CURVE for clients needs the shared secret")
                self._curve = CurveAuthenticator(self._ctx, secret)
                make_curve_server(self._router, secret, "client", self._curve)
            self._router.bind(address)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"server.zmq={address}: cannot bind ({e})") from None
        if address.startswith("tcp://") and address.endswith(":0"):
            self.address = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._failed: queue.SimpleQueue = queue.SimpleQueue()
        """(identity, reply) to send from the I/O thread: fail() and the tokenizer pool run on
        other threads."""
        self._tokenize_pool = TokenizePool(name="meshserve-zmq-tokenize")
        self._tokenizing: dict[RequestKey, bool] = {}
        """Keys of requests in the tokenizer pool -> aborted meanwhile (I/O thread and pool)."""
        self._id_decoder = msgspec.msgpack.Decoder(_RequestId)
        self.error: BaseException | None = None
        """Set if the I/O thread died; the step loop then stops the server."""
        self._thread = threading.Thread(target=self._io_thread, name="meshserve-frontend", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, key: RequestKey, message: msgspec.Struct) -> None:
        """Queue a reply to the client behind `key` (called from the step loop)."""
        identity = key.client
        self._push.send_multipart([identity, self._auth.seal(self._encoder.encode(message))])

    def send_all(self, replies: list[tuple[RequestKey, msgspec.Struct]]) -> None:
        for key, message in replies:
            self.send(key, message)

    def fail(self, keys: list[RequestKey], message: str) -> None:
        """Answer each of `keys` with an `unavailable` error (any thread; the I/O thread sends)."""
        self.accepting = False
        for key in keys:
            self._failed.put((key.client, ErrorReply(key.request_id, "unavailable", message)))

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._tokenize_pool.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        if not self._router.closed:  # the I/O thread never ran, or died
            self._router.close(linger=0)
        self._push.close(linger=0)
        if self._curve is not None:
            self._curve.close()
        self._ctx.term()

    # ------------------------------------------------------------------ I/O thread

    def _io_thread(self) -> None:
        try:
            self._io_loop()
        except BaseException as e:
            log.exception("the frontend I/O thread died")
            self.error = e

    def _io_loop(self) -> None:
        pull = self._ctx.socket(zmq.PULL)
        pull.connect(self._out_address)
        decoder = client_decoder()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        last_sent = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                self._send_failed()
                if pull in events and self._forward(pull):
                    last_sent = time.monotonic()
                if self._router in events:
                    while True:
                        try:
                            frames = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames, decoder)
        finally:
            self._send_failed()
            if self._forward(pull):  # replies queued before the stop
                last_sent = time.monotonic()
            while time.monotonic() - last_sent < CLOSE_QUIET_S:
                time.sleep(0.05)
                self._send_failed()
                if self._forward(pull):
                    last_sent = time.monotonic()
            pull.close(linger=0)
            self._router.close(linger=1000)

    def _forward(self, pull: zmq.Socket) -> bool:
        """Send what the step loop queued; whether there was anything."""
        sent = False
        while True:
            try:
                self._router.send_multipart(pull.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return sent
            sent = True

    def _send_failed(self) -> None:
        while True:
            try:
                identity, reply = self._failed.get_nowait()
            except queue.Empty:
                return
            self._router.send_multipart([identity, self._auth.seal(self._encoder.encode(reply))])

    def _reply_error(self, identity: bytes, request_id: str | None, code: ErrorCode, message: str,
                     sealed: bool = True) -> None:
        """`sealed=False`: a reply to a frame that did not authenticate (clients accept an unsealed
        ErrorReply: it can refuse a request, never deliver output)."""
        reply = self._encoder.encode(ErrorReply(request_id, code, message))
        self._router.send_multipart([identity, self._auth.seal(reply) if sealed else reply])

    def _on_frames(self, frames: list[bytes], decoder: msgspec.msgpack.Decoder) -> None:
        identity = frames[0]
        if len(frames) != 2:
            if self._auth.enabled:
                self._refuse(identity, None, f"{len(frames) - 1} frames")
            else:
                self._reply_error(identity, None, "bad_request", f"expected one message frame, got {len(frames) - 1}")
            return
        # NOTE: the size before the tag: checking a tag hashes the whole frame (up to MAX_FRAME_BYTES).
        if len(frames[1]) > MAX_REQUEST_BYTES:
            self._reply_error(identity, None, "too_long",
                              f"the message has {len(frames[1])} bytes; the limit is {MAX_REQUEST_BYTES}",
                              sealed=False)
            return
        payload = self._auth.open(frames[1])
        if payload is None:
            self._refuse(identity, frames[1], f"{len(frames[1])} bytes")
            return
        try:
            msg = decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            detail = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            self._reply_error(identity, self._request_id(payload), "bad_request", f"malformed message: {detail}")
            return
        key = RequestKey(self.tag, identity, msg.request_id)
        if isinstance(msg, KvReady):
            self.inbox.put(KvReadyCommand(key, msg.token_id, msg.logprob))
            return
        if isinstance(msg, AbortRequest):
            if key in self._tokenizing:
                self._tokenizing[key] = True
            else:
                self.inbox.put(AbortCommand(key))
            return
        try:
            if not self.accepting:
                raise RequestError("unavailable", "the server is shutting down and accepts no new requests")
            if key in self._tokenizing:
                raise RequestError("duplicate_id", f"request_id {msg.request_id!r} is already running")
            source = prompt_source(msg)
            check_admissible(msg.params, self.vocab_size, self.max_model_len)
        except RequestError as e:
            self._reply_error(identity, msg.request_id, e.code, e.message)
            return
        if isinstance(source, str) or msg.structured_outputs is not None or msg.constraint is not None:
            self._tokenizing[key] = False
            self._tokenize_pool.submit(len(source), self._tokenize, key, msg, source)
        else:
            self._admit(key, msg, source)

    def _tokenize(self, key: RequestKey, req: GenerateRequest, prompt: str | list[int]) -> None:
        """In the tokenizer pool: the prompt tokenized and the structured-output constraint
        compiled (either may take a while); replies go out through the I/O thread."""
        try:
            ids = admit_prompt(self.tokenizer, prompt, req.params, self.vocab_size, self.max_model_len, req.resume)
            grammar = None
            if req.structured_outputs is not None and req.constraint is not None:
                raise RequestError("bad_request", "set structured_outputs or constraint, not both", "constraint")
            if req.structured_outputs is not None:
                grammar = self.grammars.compile(spec_from_message(req.structured_outputs))
            elif req.constraint is not None:
                grammar = self.grammars.compile(GrammarSpec(**msgspec.structs.asdict(req.constraint)))
        except RequestError as e:
            self._tokenizing.pop(key, None)
            self._failed.put((key.client, ErrorReply(req.request_id, e.code, e.message)))
            return
        except Exception:  # a tokenizer failure must not kill the pool's thread
            self._tokenizing.pop(key, None)
            log.exception("request %s: tokenizing its prompt failed", req.request_id)
            self._failed.put((key.client, ErrorReply(req.request_id, "internal", "internal error while tokenizing the "
                                                 "prompt (the server log has the details)")))
            return
        if self._tokenizing.pop(key, False):  # aborted while tokenizing
            self._failed.put((key.client, Delta(req.request_id, "", [], "abort", usage=Usage(len(ids), 0))))
            return
        self.inbox.put(AddCommand(key, req.request_id, ids, req.params, req.stream, req.cache_salt, grammar, req.handoff,
                                  req.resume, req.lora, req.priority, req.background))

    def _admit(self, key: RequestKey, req: GenerateRequest, ids: list[int]) -> None:
        """A request of token ids, on the I/O thread (checking them is cheap)."""
        try:
            admit_prompt(self.tokenizer, ids, req.params, self.vocab_size, self.max_model_len, req.resume)
        except RequestError as e:
            self._reply_error(key.client, req.request_id, e.code, e.message)
            return
        self.inbox.put(AddCommand(key, req.request_id, ids, req.params, req.stream, req.cache_salt,
                                  handoff=req.handoff, resume=req.resume, lora=req.lora, priority=req.priority,
                                  background=req.background))

    def _refuse(self, identity: bytes, frame: bytes | None, what: str) -> None:
        self._refused("refused an unauthenticated client frame (%s)", what)
        # the request id, if the frame is a request sent without the secret or with another one
        request_id = None if frame is None else self._request_id(frame) or self._request_id(frame[:-TAG_BYTES])
        self._reply_error(identity, request_id, "unauthorized",
                          "the frame is not authenticated: this server needs its shared secret (server.secret; "
                          "Client(..., secret=...))", sealed=False)

    def _request_id(self, payload: bytes) -> str | None:
        """The request_id of a frame that failed validation, if it has one, for the error reply."""
        try:
            return self._id_decoder.decode(payload).request_id
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
