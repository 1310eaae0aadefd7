"""The driver serving clients: ZMQ and HTTP frontends, step loop, graceful drain on signals."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo, served_name
from meshserve.configs.schema import Config
from meshserve.engine.engine import Engine
from meshserve.engine.serving.commands import Frontend, Inbox
from meshserve.engine.serving.server import Server
from meshserve.engine.serving.zmq_frontend import ZmqFrontend
from meshserve.engine.structured import GrammarCompiler
from meshserve.engine.tokenizer import Tokenizer

log = logging.getLogger("meshserve")

SAME_SIGNAL_S = 1.0
"""A signal this soon after the first is the same stop request arriving by another path
(Ctrl-C reaches every process of the terminal's group, and the launcher forwards it)."""
FAILURE_LINGER_S = 1.0
"""After the engine fails: how long /health answers 503 before the process exits."""
EXIT_ENGINE_FAILED = 1


def ready_line(zmq_address: str, http_address: str | None, config: Config) -> str:
    http = f"http://{http_address}" if http_address else "off"
    return f"meshserve ready zmq={zmq_address} http={http} model={config.model.path} world_size={config.world_size}"


class ServeMode:
    def __init__(self, drain_timeout: float = 30.0):
        self.drain_timeout = drain_timeout
        self.inbox = Inbox()
        self.frontend: ZmqFrontend | None = None
        self.http = None
        """The HTTP frontend (engine/serving/http_frontend.py), unless server.http is null."""
        self.metrics = None
        self.config: Config | None = None
        self.info: ModelInfo | None = None

    def prepare(self, config: Config, tokenizer: Tokenizer, info: ModelInfo, memory: MemoryPlan) -> None:
        self.config, self.info = config, info
        grammars = GrammarCompiler(tokenizer, info.vocab_size)
        self.frontend = ZmqFrontend(config.server.zmq, self.inbox, tokenizer, info.vocab_size, memory.max_model_len,
                                    secret=config.server.secret, curve=config.server.curve, grammars=grammars)
        if config.server.http is None:
            return
        from meshserve.engine.serving.http_frontend import HttpFrontend  # FastAPI and uvicorn only when served
        from meshserve.engine.serving.metrics import EngineMetrics

        self.metrics = EngineMetrics()
        try:
            self.http = HttpFrontend(config.server.http, self.inbox, tokenizer, info.vocab_size, memory.max_model_len,
                                     config.server.model_name or served_name(config.model.path),
                                     self.metrics.registry, api_key=config.server.api_key,
                                     limits=config.server.http_limits, metrics_public=config.server.metrics.public,
                                     cors_allowed_origins=config.server.cors_allowed_origins,
                                     grammars=grammars)
        except OSError:
            self.frontend.close()
            raise

    def run(self, engine: Engine) -> int:
        frontends: list[Frontend] = [self.frontend]
        if self.http is not None:
            from meshserve.engine.serving.metrics import serving_metrics

            m = self.config.server.metrics
            serving_metrics(self.info, self.config.torch_dtype_name, self.config.device.type, self.config.world_size,
                            m.peak_flops, m.memory_bandwidth, engine, self.metrics, self.config.model.quantization,
                            self.config.cache.dtype)
            frontends.append(self.http)
        server = Server(engine, self.inbox, frontends, self.config.scheduler.max_waiting,
                        self.config.scheduler.max_waiting_tokens)
        engine.executor.failure.on_failure(lambda reason: self._fail(server, frontends, reason))

        first_signal: list[float] = []

        def on_signal(signum, frame):
            name = signal.Signals(signum).name
            if not first_signal:
                first_signal.append(time.monotonic())
                log.info("%s: draining (up to %.0f s; a second signal ends the requests now)", name,
                         self.drain_timeout)
                server.request_stop()
            elif time.monotonic() - first_signal[0] < SAME_SIGNAL_S:
                pass  # one Ctrl-C reaching us twice: from the terminal and forwarded by the launcher
            elif not server.stop_now.is_set():
                log.warning("second %s: ending the requests in flight now", name)
                server.request_stop(now=True)
            else:
                log.warning("third %s: exiting at once", name)
                sys.exit(1)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        print(ready_line(self.frontend.address, self.http.address if self.http else None, self.config), flush=True)
        try:
            server.run(self.drain_timeout)
        finally:
            for frontend in frontends:
                frontend.close()
        log.info("stopped after %d steps, %d requests", engine.stats.steps, engine.stats.finished)
        return 1 if server.stop_now.is_set() else 0

    @staticmethod
    def _fail(server: Server, frontends: list[Frontend], reason: str) -> None:
        """The failure reaction (any thread): every request in flight gets an error, /health
        says 503 for FAILURE_LINGER_S, the frontends flush, and the process exits non-zero."""
        server.fail(reason)
        time.sleep(FAILURE_LINGER_S)
        for frontend in frontends:
            frontend.close()
        log.error("exiting: %s", reason)
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)
