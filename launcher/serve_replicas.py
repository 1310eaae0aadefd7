"""`meshserve serve` of parallel.data replicas: on node 0, bind the front door's frontends
(engine/serving/frontends.py), start this node's replicas (launcher/replicas.py), wait until
every replica of every node serves, then route requests to them
(engine/serving/replicas/front_door.py) until stopped; on another node (`--node-rank K`),
start that node's replicas, announce them to node 0 (launcher/replica_registry.py) and stop
them when node 0 says so or goes away. SIGTERM/SIGINT stop either as they stop a single
replica (launcher/signals.py), and each replica gets the same signals in turn."""

from __future__ import annotations

import logging
import queue
import threading
import time

import httpx
import torch.distributed as dist
import zmq

from meshserve.configs.adapters import AdapterError
from meshserve.configs.memory import MemoryPlan
from meshserve.configs.model_info import ModelInfo
from meshserve.configs.schema import Config
from meshserve.engine.serving.frontends import build_frontends
from meshserve.engine.serving.replicas.front_door import FrontDoor, WakingInbox
from meshserve.engine.serving.replicas.link import ReplicaLink
from meshserve.engine.serving.replicas.metrics import front_door_registry
from meshserve.engine.serving.replicas.routing import Router
from meshserve.engine.tokenizer import Tokenizer
from meshserve.launcher.errors import StartupError
from meshserve.launcher.network import host_address, interface_address
from meshserve.engine.serving.replicas.admin import admin_router
from meshserve.engine.serving.replicas.replica_states import ReplicaDown, ReplicaStates, ReplicaUp
from meshserve.launcher.replica_keeper import ReplicaKeeper
from meshserve.launcher.replica_registry import ReplicaRegistry
from meshserve.launcher.replicas import (STOP_GRACE_S, ReplicaProcess, core_shares, disaggregation_overrides, free_ports,
                                         replica_argv, replica_overrides, start_replica)
from meshserve.launcher.signals import on_stop_signals

log = logging.getLogger("meshserve")

RESET_TIMEOUT_S = 30.0
NODE_POLL_S = 0.5


def front_door_ready_line(zmq_address: str, http_address: str | None, config: Config) -> str:
    http = f"http://{http_address}" if http_address else "off"
    return (f"meshserve ready zmq={zmq_address} http={http} model={config.model.path} "
            f"replicas={config.parallel.data} world_size={config.world_size}")


def node_replicas(config: Config, node_rank: int) -> list[int]:
    """The replicas node `node_rank` runs (each replica whole on one node, in order)."""
    per_node = config.ranks_per_node // config.world_size
    return list(range(node_rank * per_node, (node_rank + 1) * per_node))


def replica_host(config: Config) -> str:
    """Where this node's replicas listen for the front door: loopback on one node, else the
    node's address on cluster.interface (or its host name's)."""
    if config.cluster.nodes == 1:
        return "127.0.0.1"
    return interface_address(config.cluster.interface) if config.cluster.interface else host_address()


def kv_store_address(config: Config, local_store: dist.TCPStore | None) -> str:
    """Where disaggregated replicas' ranks meet: node 0's registry across nodes, else the
    store the front door hosts on loopback."""
    if local_store is None:
        return f"{config.cluster.master_addr}:{config.cluster.master_port}"
    return f"127.0.0.1:{local_store.port}"


def replica_starter(config: Config, argv: list[str], node_rank: int, kv_store: str = ""):
    """`start(replica, on_exit, sets)`: one of node `node_rank`'s replicas started (again),
    with the config overrides `sets` (the admin API's) after the deployment's, its ZMQ
    frontend on a port free now. A replica added at run time shares the cores of the one
    it wraps around to."""
    host = replica_host(config)
    shares = core_shares(config)
    indices = node_replicas(config, node_rank)
    base = replica_argv(argv)

    def start(r: int, on_exit, sets: list[str] = ()) -> ReplicaProcess:
        port, = free_ports(1, host)
        own = [item for s in sets for item in ("--set", s)]
        return start_replica(r, base, own + replica_overrides(config, (r - indices[0]) % len(indices), shares, port,
                                                              host) + disaggregation_overrides(config, r, kv_store),
                             on_exit)

    return start


def serve_replicas(config: Config, info: ModelInfo, memory: MemoryPlan, argv: list[str], drain_timeout: float,
                   node_rank: int | None = None, check_sets=None) -> int:
    """`check_sets(sets)`: raises ValueError if a replica cannot start with these config
    overrides (the admin API's restart and add)."""
    nodes = config.cluster.nodes
    if nodes > 1 and (node_rank is None or not 0 <= node_rank < nodes):
        raise StartupError(f"cluster.nodes={nodes}: start `meshserve serve CONFIG --node-rank K` on each node, "
                           f"K = 0 .. {nodes - 1} (node 0 runs the front door)")
    if nodes == 1 and node_rank not in (None, 0):
        raise StartupError(f"--node-rank {node_rank}: the config has cluster.nodes=1 (node rank 0 only)")
    if nodes > 1 and node_rank > 0:
        return serve_node(config, argv, node_rank, drain_timeout)
    registry = ReplicaRegistry(config, host=True) if nodes > 1 else None
    tokenizer = Tokenizer(info, config.model.tokenizer)
    inbox = WakingInbox()
    router = Router(config.parallel.data, config.router.policy, config.cache.block_size, memory.num_blocks,
                    config.router.balance_abs_tokens, config.router.balance_rel,
                    config.lora.max_loras if config.lora.active else 0)
    urls: dict[int, str | None] = {}
    """Each replica's HTTP base URL (a restarted one's replaces its last)."""
    # NOTE: made whether or not HTTP serves them (counting unread is cheap), so that whether
    # there is an HTTP /metrics is build_frontends' choice alone.
    states = ReplicaStates(config.parallel.data)
    prom, metrics = front_door_registry(router, lambda: [(r, url) for r, url in sorted(urls.items())
                                                         if url and router.up[r]], config.server.api_key, states)
    frontends = build_frontends(config, info, memory, tokenizer, inbox, prom)
    started = time.monotonic()
    kv_store = None
    if config.disaggregation.enabled and nodes == 1:
        kv_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keeper = ReplicaKeeper(replica_starter(config, argv, 0, kv_store_address(config, kv_store)),
                           node_replicas(config, 0), config.router, inbox.put,
                           on_ready=lambda replica: urls.__setitem__(replica.index, replica.http))
    remote = [r for r in range(config.parallel.data) if r not in node_replicas(config, 0)]
    try:
        addresses = _wait_ready(keeper.replicas, registry, remote,
                                config.cluster.rendezvous_timeout + config.cluster.handshake_timeout)
    except StartupError:
        if registry is not None:
            registry.stop()
        keeper.stop_all()
        keeper.wait(STOP_GRACE_S)
        frontends.close()
        raise
    for r, (zmq_address, http_url) in sorted(addresses.items()):
        log.info("replica %d serves at %s (node %d)", r, zmq_address, r // len(node_replicas(config, 0)))
    log.info("%d replicas serve (started in %.1f s)", len(addresses), time.monotonic() - started)
    ctx = zmq.Context()

    def connect(r: int, address: str) -> ReplicaLink:
        return ReplicaLink(ctx, r, address, config.server.secret, config.server.curve)

    links = [connect(r, addresses[r][0]) for r in range(config.parallel.data)]
    urls.update({r: http_url for r, (_, http_url) in addresses.items()})
    door = FrontDoor(inbox, frontends.all, links, router, config.router.retry, metrics,
                     reset_prefix_caches=lambda: _reset_prefix_caches(urls, router, config.server.api_key),
                     prefill_replicas=config.disaggregation.prefill_replicas,
                     migration_limit=config.router.migration_limit, connect=connect, control=keeper, states=states,
                     change_adapter=lambda r, name, path: _change_adapter(urls, router, config.server.api_key, r, name,
                                                                          path))
    keeper.heal()
    if frontends.http is not None:
        frontends.http.app.include_router(admin_router(inbox.put, config.server.admin_key,
                                                       check_sets or (lambda sets: None)))
    if frontends.http is not None:
        frontends.http.health_source = door.health
    if registry is not None:
        _watch_remote(registry, remote, inbox, urls)
    on_stop_signals(f"draining {len(keeper.replicas)} replicas", drain_timeout,
                    drain=lambda: _drain(door, keeper, registry, drain_timeout),
                    end_now=keeper.stop_all)
    print(front_door_ready_line(frontends.zmq.address, frontends.http_address, config), flush=True)
    try:
        code = door.run()
    finally:
        if registry is not None:
            registry.stop()
        keeper.stop_all()
        keeper.wait(drain_timeout + STOP_GRACE_S)
        frontends.close()
        for link in links:
            if link is not None:
                link.close()
        ctx.term()
        inbox.close()
    return code


def serve_node(config: Config, argv: list[str], node_rank: int, drain_timeout: float) -> int:
    """Node `node_rank` > 0: its replicas, announced to node 0's registry (and announced
    again, a generation later, each time one is started again after a failure), until node
    0 says stop (or is gone: the store stops answering) or they all end for good; 0 if they
    were stopped."""
    log.info("node %d: meeting node 0 at %s:%d (up to %d s)", node_rank, config.cluster.master_addr,
             config.cluster.master_port, config.cluster.rendezvous_timeout)
    try:
        registry = ReplicaRegistry(config, host=False)
    except Exception as e:  # torch raises DistStoreError, DistNetworkError, RuntimeError
        raise StartupError(f"node {node_rank}: waited {config.cluster.rendezvous_timeout} s (cluster.rendezvous_timeout) "
                           f"for node 0's registry at {config.cluster.master_addr}:{config.cluster.master_port}: "
                           f"{type(e).__name__}: {e}") from None
    events: queue.Queue = queue.Queue()
    indices = node_replicas(config, node_rank)
    keeper = ReplicaKeeper(replica_starter(config, argv, node_rank, kv_store_address(config, None)), indices,
                           config.router, events.put)
    stopping: list[float] = []

    def stop_for(reason: str) -> None:
        if not stopping:
            log.info("node %d: %s: stopping its replicas (they drain, up to %.0f s)", node_rank, reason, drain_timeout)
            stopping.append(time.monotonic())
            keeper.stop_all()

    on_stop_signals(f"draining node {node_rank}'s {len(indices)} replicas", drain_timeout,
                    drain=lambda: stop_for("told to stop"), end_now=keeper.stop_all)
    ups = {r: -1 for r in indices}
    """Each replica's generation announced last (-1: not yet)."""
    downs = {r: 0 for r in indices}
    ended: set[int] = set()
    while len(ended) < len(indices):
        try:
            for replica in keeper.replicas:
                if replica.ready.is_set() and ups[replica.index] < 0:
                    ups[replica.index] = 0
                    registry.announce(replica.index, replica.zmq, replica.http)
            if min(ups.values()) >= 0:
                keeper.heal()
            try:
                event = events.get(timeout=NODE_POLL_S)
            except queue.Empty:
                event = None
            if isinstance(event, ReplicaDown):
                downs[event.replica] += 1
                registry.report_down(event.replica, event.reason, downs[event.replica], event.restart_in)
                if event.restart_in is None:
                    ended.add(event.replica)
            elif isinstance(event, ReplicaUp):
                ups[event.replica] += 1
                registry.announce(event.replica, event.zmq, keeper.processes[event.replica].http, ups[event.replica])
            if registry.stopping():
                stop_for("node 0 stops the deployment")
        except Exception as e:  # the store is gone with node 0
            stop_for(f"node 0's registry stopped answering ({type(e).__name__})")
            ended.update(r for r in indices if keeper.processes[r].process.poll() is not None)
        if stopping and time.monotonic() - stopping[0] > drain_timeout + STOP_GRACE_S:
            keeper.wait(0.0)
    keeper.wait(STOP_GRACE_S)
    return 0 if stopping else 1


def _wait_ready(replicas: list[ReplicaProcess], registry: ReplicaRegistry | None, remote: list[int],
                timeout: float) -> dict[int, tuple[str, str | None]]:
    """Every replica's (zmq, http) once it serves: this node's from their ready lines, the
    others' from the registry."""
    deadline = time.monotonic() + timeout
    addresses = {}
    for replica in replicas:
        while not replica.ready.wait(0.2):
            code = replica.process.poll()
            if code is not None:
                time.sleep(0.2)  # its last lines
                raise StartupError(f"replica {replica.index} exited while starting ({replica.exit_reason(code)})")
            if time.monotonic() > deadline:
                raise StartupError(f"replica {replica.index} did not serve within {timeout:.0f} s "
                                   f"(cluster.rendezvous_timeout + cluster.handshake_timeout)")
        addresses[replica.index] = replica.zmq, replica.http
    for r in remote:
        while (found := registry.announcement(r)) is None:
            down = registry.down_report(r)
            if down is not None:
                raise StartupError(f"replica {r} exited while starting ({down[1]})")
            if time.monotonic() > deadline:
                raise StartupError(f"replica {r} (on another node) did not serve within {timeout:.0f} s "
                                   f"(cluster.rendezvous_timeout + cluster.handshake_timeout): is its node started "
                                   f"with --node-rank?")
            time.sleep(NODE_POLL_S)
        addresses[r] = found[1:]
    return addresses


def _watch_remote(registry: ReplicaRegistry, remote: list[int], inbox: WakingInbox, urls: dict[int, str | None]
                  ) -> None:
    """Tell the front door when another node reports one of its replicas ended, and when it
    announces one it started again."""

    def watch() -> None:
        ups = {r: 0 for r in remote}
        downs = {r: 0 for r in remote}
        final: set[int] = set()
        while len(final) < len(remote):
            try:
                for r in remote:
                    down = registry.down_report(r)
                    if down is not None and down[0] > downs[r]:
                        downs[r] = down[0]
                        inbox.put(ReplicaDown(r, down[1], restart_in=down[2]))
                        if down[2] is None:
                            final.add(r)
                    up = registry.announcement(r)
                    if up is not None and up[0] > ups[r]:
                        ups[r] = up[0]
                        urls[r] = up[2]
                        inbox.put(ReplicaUp(r, up[1]))
            except Exception as e:  # the store is this process's own: it goes only at exit
                log.debug("registry: %s", e)
                return
            time.sleep(NODE_POLL_S)

    threading.Thread(target=watch, name="meshserve-registry", daemon=True).start()


def _drain(door: FrontDoor, keeper: ReplicaKeeper, registry: ReplicaRegistry | None, drain_timeout: float) -> None:
    """The front door refuses new requests, the other nodes are told to stop theirs, and every
    replica gets its first SIGTERM: it finishes its requests (up to `drain_timeout`). A
    replica's second SIGTERM (`end_now`) ends them now, as a single replica's does."""
    door.request_stop(drain_timeout + STOP_GRACE_S)
    if registry is not None:
        registry.stop()
    keeper.stop_all()


def _post_to_replicas(urls: dict[int, str | None], wanted, api_key: str | None, route: str,
                      body: dict | None = None):
    """POST `body` to `route` of each replica that has an HTTP URL and `wanted(r)` picks, in
    replica order; yields the replies."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for r, url in sorted(urls.items()):
        if url and wanted(r):
            yield httpx.post(f"{url}{route}", headers=headers, json=body, timeout=RESET_TIMEOUT_S)


def _change_adapter(urls: dict[int, str | None], router: Router, api_key: str | None, replica: int | None,
                    name: str, path: str | None) -> None:
    """Load (`path` set) or unload a LoRA adapter on `replica` (None: every replica up), through
    the replicas' own API; AdapterError with the first refusal's reason."""
    route, body = (("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}) if path is not None
                   else ("/v1/unload_lora_adapter", {"lora_name": name}))
    wanted = (lambda r: r == replica) if replica is not None else (lambda r: router.up[r])
    for reply in _post_to_replicas(urls, wanted, api_key, route, body):
        if reply.status_code == 400:
            raise AdapterError(reply.json().get("error", {}).get("message", reply.text))
        reply.raise_for_status()


def _reset_prefix_caches(urls: dict[int, str | None], router: Router, api_key: str | None) -> int:
    dropped = 0
    for reply in _post_to_replicas(urls, lambda r: router.up[r], api_key, "/reset_prefix_cache"):
        reply.raise_for_status()
        dropped += reply.json().get("dropped_blocks", 0)
    return dropped
