"""`meshserve router`: a front door alone. It binds the frontends (server.zmq, server.http)
and router.listen, where replicas started by any launcher join (router.join on theirs:
torchrun, mpirun/srun, the deepspeed launcher, `meshserve serve` on other nodes; a Slurm job
array of replicas behind one address), and routes to each while its heartbeat comes
(engine/serving/replicas/membership.py, front_door.py). It loads the model's tokenizer, not
its weights, and starts no rank. SIGTERM stops it once its requests finished; the replicas
go on and join it again when it is back."""

from __future__ import annotations

import logging

import zmq

from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.serving.frontends import build_frontends
from meshserve.engine.serving.replicas.admin import admin_router
from meshserve.engine.serving.replicas.front_door import FrontDoor, WakingInbox
from meshserve.engine.serving.replicas.link import ReplicaLink
from meshserve.engine.serving.replicas.membership import Expected, Membership, MembershipControl
from meshserve.engine.serving.replicas.metrics import front_door_registry
from meshserve.engine.serving.replicas.replica_states import ReplicaStates
from meshserve.engine.serving.replicas.routing import Router
from meshserve.engine.tokenizer import Tokenizer
from meshserve.launcher.errors import StartupError
from meshserve.launcher.signals import on_stop_signals

log = logging.getLogger("meshserve")


def router_ready_line(zmq_address: str, http_address: str | None, listen: str, config: Config) -> str:
    http = f"http://{http_address}" if http_address else "off"
    return f"meshserve router ready zmq={zmq_address} http={http} listen={listen} model={config.model.path}"


def serve_router(config: Config, info: ModelInfo, memory: MemoryPlan, drain_timeout: float) -> int:
    if config.server.secret is None:
        raise StartupError("meshserve router needs server.secret (or MESHSERVE_SECRET): replicas join with it, and "
                           "the registration socket's CURVE keys come from it")
    tokenizer = Tokenizer(info, config.model.tokenizer)
    inbox = WakingInbox()
    router = Router(0, config.router.policy, config.cache.block_size, memory.num_blocks,
                    config.router.balance_abs_tokens, config.router.balance_rel)
    states = ReplicaStates(0)
    urls: dict[int, str | None] = {}
    prom, metrics = front_door_registry(router, lambda: [(r, url) for r, url in sorted(urls.items())
                                                         if url and router.up[r]], config.server.api_key, states)
    frontends = build_frontends(config, info, memory, tokenizer, inbox, prom)
    try:
        membership = Membership(config.router.listen, config.server.secret,
                                Expected(config.model.path, info.vocab_size, memory.max_model_len), inbox.put,
                                config.router.heartbeat_interval, config.router.heartbeat_timeout,
                                on_join=lambda index, join: urls.__setitem__(index, join.http))
    except zmq.ZMQError as e:
        frontends.close()
        raise StartupError(f"router.listen={config.router.listen}: {e}") from None
    ctx = zmq.Context()
    links: list[ReplicaLink | None] = []
    door = FrontDoor(inbox, frontends.all, links, router, config.router.retry, metrics,
                     migration_limit=config.router.migration_limit,
                     connect=lambda r, address: ReplicaLink(ctx, r, address, config.server.secret, config.server.curve),
                     control=MembershipControl(membership), states=states, open_ended=True)
    if frontends.http is not None:
        frontends.http.health_source = door.health
        frontends.http.app.include_router(admin_router(inbox.put, config.server.admin_key, lambda sets: None))
    on_stop_signals("draining the router", drain_timeout, drain=lambda: door.request_stop(drain_timeout),
                    end_now=lambda: door.request_stop(0.0))
    print(router_ready_line(frontends.zmq.address, frontends.http_address, membership.address, config), flush=True)
    try:
        return door.run()
    finally:
        membership.close()
        frontends.close()
        for link in links:
            if link is not None:
                link.close()
        ctx.term()
        inbox.close()
