"""What the OpenAI serving layer needs of the transport beneath it, and nothing more.

The pipelines (openai_serving.py, responses_api.py) turn HTTP bodies into AddCommands and
replies into response bodies; the transport (http_frontend.py) owns the event loop, the
server, the thread bridge to the step loop and the table that routes each reply to its
request. They meet here: the pipelines submit a command with the queue its replies go to,
and release a request when they no longer want its replies. They never see the transport's
thread, its routes or the step loop's inbox.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from meshserve.engine.serving.commands import AddCommand, RequestKey


class EngineLink(Protocol):
    tag: str
    """The first item of the keys of the requests submitted through this link."""
    accepting: bool
    """False while the server drains or once the engine died: new requests are refused."""

    def submit(self, command: AddCommand, replies: asyncio.Queue, index: int) -> None:
        """Hand `command` to the step loop; each reply for command.key arrives in `replies` as
        (index, message), on the event loop's thread."""

    def release(self, key: RequestKey, abort: bool) -> None:
        """Replies for `key` are no longer wanted; `abort`: the request may still run, and the
        step loop stops it."""
