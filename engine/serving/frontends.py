"""The frontends of a process that serves clients, built from the config's server section:
ZMQ always, HTTP (the OpenAI API) unless server.http is null. One assembly for both such
processes: a replica's driver (launcher/serve.py, the step loop behind the frontends) and
the front door of several replicas (launcher/serve_replicas.py, the replicas behind them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo, served_name
from meshserve.configs.schema import Config
from meshserve.engine.serving.commands import Frontend, Inbox
from meshserve.engine.serving.zmq_frontend import ZmqFrontend
from meshserve.engine.structured import GrammarCompiler
from meshserve.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from meshserve.engine.serving.http_frontend import HttpFrontend


@dataclass
class Frontends:
    zmq: ZmqFrontend
    http: HttpFrontend | None = None
    """None when server.http is null."""

    @property
    def all(self) -> list[Frontend]:
        """What the step loop (or the front door) serves: each reply goes to its request's."""
        return [self.zmq] if self.http is None else [self.zmq, self.http]

    @property
    def http_address(self) -> str | None:
        return None if self.http is None else self.http.address

    def close(self) -> None:
        for frontend in self.all:
            frontend.close()


def build_frontends(config: Config, info: ModelInfo, memory: MemoryPlan, tokenizer: Tokenizer, inbox: Inbox,
                    registry: CollectorRegistry | None = None) -> Frontends:
    """Bind the frontends' addresses (server.zmq, server.http). Both put what their clients
    ask into `inbox`, bound requests by `memory.max_model_len`, and share one compiler of
    structured-output grammars. `registry`: the metrics HTTP's /metrics serves (the engine's,
    or the front door's of every replica). An address already taken raises OSError, and
    nothing is left bound."""
    server = config.server
    grammars = GrammarCompiler(tokenizer, info.vocab_size)
    zmq = ZmqFrontend(server.zmq, inbox, tokenizer, info.vocab_size, memory.max_model_len, secret=server.secret,
                      curve=server.curve, grammars=grammars)
    if server.http is None:
        return Frontends(zmq)
    from meshserve.engine.serving.http_frontend import HttpFrontend  # FastAPI and uvicorn only when served

    try:
        http = HttpFrontend(server.http, inbox, tokenizer, info.vocab_size, memory.max_model_len,
                            server.model_name or served_name(config.model.path), registry, api_key=server.api_key,
                            limits=server.http_limits, metrics_public=server.metrics.public,
                            cors_allowed_origins=server.cors_allowed_origins, grammars=grammars,
                            adapters=dict(config.lora.adapters) if config.lora.active else None,
                            max_stored_responses=server.responses.max_stored,
                            reasoning_parser=server.reasoning_parser, batch=server.batch)
    except OSError:
        zmq.close()
        raise
    return Frontends(zmq, http)
