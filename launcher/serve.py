"""The driver serving clients: ZMQ frontend, step loop, graceful drain on signals."""

from __future__ import annotations

import logging
import signal
import sys

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.engine import Engine
from meshserve.engine.commands import Inbox
from meshserve.engine.server import Server
from meshserve.engine.zmq_frontend import ZmqFrontend
from meshserve.engine.tokenizer import Tokenizer

log = logging.getLogger("meshserve")


def ready_line(zmq_address: str, http_address: str | None, config: Config) -> str:
    http = f"http://{http_address}" if http_address else "off"
    return f"meshserve ready zmq={zmq_address} http={http} model={config.model.path} world_size={config.world_size}"


class ServeMode:
    def __init__(self, drain_timeout: float = 30.0):
        self.drain_timeout = drain_timeout
        self.inbox = Inbox()
        self.frontend: ZmqFrontend | None = None
        self.config: Config | None = None

    def prepare(self, config: Config, tokenizer: Tokenizer, info: ModelInfo, memory: MemoryPlan) -> None:
        self.config = config
        self.frontend = ZmqFrontend(config.server.zmq, self.inbox, tokenizer, info.vocab_size, memory.max_model_len)

    def run(self, engine: Engine) -> int:
        server = Server(engine, self.inbox, [self.frontend], self.config.scheduler.max_waiting)

        def on_signal(signum, frame):
            if server.stop_requested.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                sys.exit(1)
            log.info("%s: draining", signal.Signals(signum).name)
            server.stop_requested.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # NOTE: server.http is served by the OpenAI-compatible API once it exists; until then it is off.
        print(ready_line(self.frontend.address, None, self.config), flush=True)
        try:
            server.run(self.drain_timeout)
        finally:
            self.frontend.close()
        log.info("stopped after %d steps, %d requests", engine.stats.steps, engine.stats.finished)
        return 0
