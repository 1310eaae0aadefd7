"""Shared-secret authentication of ZeroMQ frames: an HMAC-SHA256 tag on every frame.

    auth = FrameAuth(secret, "control")
    sock.send(auth.seal(payload))             # payload + 32-byte tag
    payload = auth.open(sock.recv())          # None: not sealed with this secret -> drop it

Each channel derives its own key from the secret and a purpose ("client", "control",
"heartbeat"), so a frame sealed for one channel does not open on another. Without a secret
`seal` and `open` are the identity, and the wire format is plain msgpack as before.

What it does not do: encrypt (an observer of the network reads prompts and tokens), or stop
a captured frame from being replayed on the same channel. Run the control plane on a
private network; put TLS (a proxy) in front of client traffic that crosses untrusted ones.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

TAG_BYTES = 32


class FrameAuth:
    def __init__(self, secret: str | bytes | None, purpose: str):
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and not secret:
            raise ValueError("the shared secret is empty (use None for no authentication)")
        self._key = None if secret is None else hmac.new(secret, b"meshserve/" + purpose.encode(),
                                                         hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()

    def seal(self, frame: bytes) -> bytes:
        """`frame` followed by its tag (the identity without a secret)."""
        if self._key is None:
            return frame
        return frame + self._tag(frame)

    def open(self, frame: bytes) -> bytes | None:
        """The payload of a sealed frame, or None if the tag is missing or wrong (compared in
        constant time). The identity without a secret."""
        if self._key is None:
            return frame
        if len(frame) < TAG_BYTES:
            return None
        payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
        return payload if hmac.compare_digest(tag, self._tag(payload)) else None


class DropLog:
    """A warning per dropped frame, at most one line every `every` seconds (with the count
    since the last line), so a flood of garbage cannot flood the log."""

    def __init__(self, logger: logging.Logger, every: float = 10.0):
        self.logger, self.every = logger, every
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" (and {self._suppressed} more dropped since the last warning)"
        self.logger.warning(message, *args)
        self._last, self._suppressed = now, 0
