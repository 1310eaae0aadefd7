"""Exceptions a client call raises."""

from __future__ import annotations


class MeshserveError(Exception):
    """The server refused or failed a request; `code` is its ErrorReply code."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.request_id = code, message, request_id


class RequestTimeout(MeshserveError):
    """No message from the server within the timeout; the request was aborted."""

    def __init__(self, request_id: str, timeout: float, address: str = "the server"):
        super().__init__("timeout", f"no reply from {address} within {timeout:g} s", request_id)


class ServerUnreachable(MeshserveError):
    """No connection to a server at the client's address within its connect timeout."""

    def __init__(self, address: str, timeout: float):
        super().__init__("unreachable", f"no meshserve server accepted a connection at {address} within "
                                        f"{timeout:g} s: is `meshserve serve` running with server.zmq={address}? "
                                        f"(a server with server.curve takes only clients with curve=True and its "
                                        f"secret)")
        self.address = address
