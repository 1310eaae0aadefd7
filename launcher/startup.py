"""Joining the world a launcher created, and checking it is the config's, on every rank.

Every rank joins the launcher's world first (whatever the config says), then all-gathers
what it loaded: the hash of its resolved config, the world size that config needs, the
launcher's count of ranks on its node, and its host. Every rank then runs the same checks
on the same facts, so a mismatch fails alike on every node, with the numbers, instead of
one node failing and the others waiting for it.
"""

from __future__ import annotations

import hashlib
import json
import socket
from dataclasses import dataclass

from meshserve.comm.control import all_gather_text
from meshserve.configs.schema import Config
from meshserve.launcher.env import RankEnv, use_network_interface
from meshserve.launcher.errors import StartupError
from meshserve.launcher.network import interface_address
from meshserve.parallel.process_groups import init_process_groups, join_world
from meshserve.parallel.topology import Groups, Topology


def config_hash(config: Config) -> str:
    """Hash of the resolved config (file and --set overrides), less what may differ per node
    (cluster.interface: interface names can differ between hosts)."""
    data = config.model_dump(mode="json")
    data["cluster"].pop("interface", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankFacts:
    """What each rank tells the others at start-up."""

    config_hash: str
    config_world_size: int
    local_world_size: int
    host: str

    def encode(self) -> str:
        return f"{self.config_hash} {self.config_world_size} {self.local_world_size} {self.host}"

    @classmethod
    def decode(cls, text: str) -> "RankFacts":
        h, world, local, host = text.split(" ", 3)
        return cls(h, int(world), int(local), host)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def world_problems(config: Config, env: RankEnv, facts: list[RankFacts]) -> list[str]:
    """The same list on every rank: configs that differ, or a launcher world that is not the config's."""
    hashes: dict[str, list[int]] = {}
    for rank, f in enumerate(facts):
        hashes.setdefault(f.config_hash, []).append(rank)
    if len(hashes) > 1:
        parts = [f"{h} on ranks {_ranges(ranks)} (host {facts[ranks[0]].host}, world size "
                 f"{facts[ranks[0]].config_world_size})" for h, ranks in hashes.items()]
        return [f"the ranks loaded different configs: config hash {' but '.join(parts)}; start every node with "
                f"the same config file and --set overrides"]
    p = config.parallel
    problems = []
    if env.world_size != config.world_size:
        problems.append(f"{env.launcher} started {env.world_size} ranks but the config needs {p.sizes()} = "
                        f"{config.world_size}")
    local = sorted({f.local_world_size for f in facts})
    if not problems and local != [config.ranks_per_node]:
        problems.append(f"{env.launcher} started {' or '.join(map(str, local))} ranks per node but the config has "
                        f"cluster.nodes={config.cluster.nodes} x cluster.ranks_per_node={config.ranks_per_node}")
    if not problems:
        for first in range(0, len(facts), p.tensor):
            hosts = sorted({f.host for f in facts[first:first + p.tensor]})
            if len(hosts) > 1:
                problems.append(f"the tensor-parallel group of ranks {first}-{first + p.tensor - 1} spans hosts "
                                f"{', '.join(hosts)}: the launcher must place consecutive ranks on one node "
                                f"(e.g. mpirun --map-by slot)")
                break
    return problems


def start_world(config: Config, env: RankEnv, shm_slot_bytes: int = 0) -> Groups:
    """Join the launcher's world (waiting up to cluster.rendezvous_timeout for every rank),
    check it against the config on every rank, then build the process groups."""
    cluster = config.cluster
    if cluster.interface:
        interface_address(cluster.interface)  # fails now, naming this node's interfaces, if it has no such one
        use_network_interface(cluster.interface)
    where = f"rank {env.global_rank} (node {env.node_rank})"
    if env.world_size == 1:
        if config.world_size != 1:
            raise StartupError(f"{where}: " + "; ".join(world_problems(config, env, [_facts(config, env)])))
        return Groups.single()
    try:
        join_world(env.global_rank, env.world_size, env.master_addr, env.master_port, config.device.type,
                   env.local_rank, timeout_s=cluster.rendezvous_timeout)
    except Exception as e:  # torch raises DistStoreError, DistNetworkError or RuntimeError here
        raise StartupError(f"{where}: waited {cluster.rendezvous_timeout} s (cluster.rendezvous_timeout) at "
                           f"tcp://{env.master_addr}:{env.master_port} for all {env.world_size} ranks of the world "
                           f"to join the process group: {type(e).__name__}: {_first_line(e)}") from None
    facts = [RankFacts.decode(t) for t in all_gather_text(_facts(config, env).encode())]
    problems = world_problems(config, env, facts)
    if problems:
        raise StartupError(f"{where}: " + "; ".join(problems))
    topology = Topology(config.parallel.tensor, config.parallel.pipeline, config.parallel.context,
                        config.parallel.expert)
    return init_process_groups(topology, env.global_rank, env.master_addr, env.master_port, config.device.type,
                               env.local_rank, shm_slot_bytes=shm_slot_bytes)


def _facts(config: Config, env: RankEnv) -> RankFacts:
    return RankFacts(config_hash(config), config.world_size, env.local_world_size, socket.gethostname())


def _first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else ""
