"""`meshserve serve` on one rank: engine, ZMQ frontend, step loop, signals."""

from __future__ import annotations

import logging
import signal
import sys

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.bootstrap import build_single_rank_engine
from meshserve.engine.frontend import Frontend
from meshserve.engine.server import Server
from meshserve.launcher.env import cpu_threads

log = logging.getLogger("meshserve")


def ready_line(zmq_address: str, http_address: str | None, config: Config) -> str:
    http = f"http://{http_address}" if http_address else "off"
    return f"meshserve ready zmq={zmq_address} http={http} model={config.model.path} world_size={config.world_size}"


def serve_single_rank(config: Config, info: ModelInfo, memory: MemoryPlan, drain_timeout: float = 30.0) -> int:
    engine = build_single_rank_engine(config, info, memory, threads=cpu_threads(config.device.threads, 1),
                                      show_progress=True)
    frontend = Frontend(config.server.zmq, engine.tokenizer, info.vocab_size, memory.max_model_len)
    server = Server(engine, frontend, config.scheduler.max_waiting)

    def on_signal(signum, frame):
        if server.stop_requested.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            sys.exit(1)
        log.info("%s: draining", signal.Signals(signum).name)
        server.stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # NOTE: HTTP (server.http) is served by the OpenAI-compatible API once it exists; until then it is off.
    print(ready_line(frontend.address, None, config), flush=True)
    try:
        server.run(drain_timeout)
    finally:
        frontend.close()
        engine.shutdown()
    log.info("stopped after %d steps, %d requests", engine.stats.steps, engine.stats.finished)
    return 0
