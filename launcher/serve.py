"""The driver serving clients: its frontends (engine/serving/frontends.py), the step loop,
and a graceful drain on SIGTERM/SIGINT (launcher/signals.py)."""

from __future__ import annotations

import logging
import os
import time

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.engine import Engine
from meshserve.engine.serving.commands import Inbox
from meshserve.engine.serving.frontends import Frontends, build_frontends
from meshserve.engine.serving.server import Server
from meshserve.engine.tokenizer import Tokenizer
from meshserve.launcher.signals import on_stop_signals

log = logging.getLogger("meshserve")

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
        self.frontends: Frontends | None = None
        self.config: Config | None = None
        self.info: ModelInfo | None = None

    def prepare(self, config: Config, tokenizer: Tokenizer, info: ModelInfo, memory: MemoryPlan) -> None:
        self.config, self.info = config, info
        self.frontends = build_frontends(config, info, memory, tokenizer, self.inbox)

    def run(self, engine: Engine) -> int:
        frontends = self.frontends
        if frontends.http is not None:
            self._serve_metrics(engine)
        server = Server(engine, self.inbox, frontends.all, self.config.scheduler.max_waiting,
                        self.config.scheduler.max_waiting_tokens)
        engine.executor.failure.on_failure(lambda reason: self._fail(server, frontends, reason))
        membership = self._membership(engine, server)

        def drain() -> None:
            if membership is not None:
                membership.leave(done=False)
            server.request_stop()

        on_stop_signals("draining", self.drain_timeout, drain=drain, end_now=lambda: server.request_stop(now=True))
        print(ready_line(frontends.zmq.address, frontends.http_address, self.config), flush=True)
        if membership is not None:
            membership.start()
        self.started(server)
        try:
            server.run(self.drain_timeout)
        finally:
            if membership is not None:
                membership.leave(done=True)
                membership.close()
            frontends.close()
        log.info("stopped after %d steps, %d requests", engine.stats.steps, engine.stats.finished)
        return 1 if server.stop_now.is_set() else 0

    def started(self, server: Server) -> None:
        """Called once the server is built, before it serves (a mode built on this one acts here)."""

    def _membership(self, engine: Engine, server: Server):
        """With router.join: this replica's membership of a `meshserve router` (not started)."""
        if self.config.router.join is None:
            return None
        from meshserve.launcher.join import RouterMembership

        def stop(reason: str) -> None:
            membership.leave(done=False)
            server.request_stop()

        membership = RouterMembership(self.config, self.frontends.zmq.address, self.frontends.http_address,
                                      engine.vocab_size, engine.memory.max_model_len, stop)
        return membership

    def _serve_metrics(self, engine: Engine) -> None:
        """The engine's metrics (MFU/MBU against the roofline included), on HTTP's /metrics."""
        from meshserve.engine.serving.metrics import EngineMetrics, serving_metrics

        config, m = self.config, self.config.server.metrics
        metrics = EngineMetrics(self.frontends.http.registry)
        serving_metrics(self.info, config.torch_dtype_name, config.device.type, config.world_size, m.peak_flops,
                        m.memory_bandwidth, engine, metrics, config.model.quantization, config.cache.dtype)

    @staticmethod
    def _fail(server: Server, frontends: Frontends, reason: str) -> None:
        """The failure reaction (any thread): every request in flight gets an error, /health
        says 503 for FAILURE_LINGER_S, the frontends flush, and the process exits non-zero."""
        server.fail(reason)
        time.sleep(FAILURE_LINGER_S)
        frontends.close()
        log.error("exiting: %s", reason)
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)
