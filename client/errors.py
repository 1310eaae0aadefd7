"""Exceptions a client call raises."""

from __future__ import annotations


class MeshserveError(Exception):
    """The server refused or failed a request; `code` is its ErrorReply code."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.request_id = code, message, request_id


class RequestTimeout(MeshserveError):
    """No message from the server within the timeout; the request was aborted."""

    def __init__(self, request_id: str, timeout: float):
        super().__init__("timeout", f"no reply within {timeout} s", request_id)
