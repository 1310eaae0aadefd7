"""Where the replicas of several nodes meet the front door: a key-value store on node 0 at
cluster.master_addr:master_port (torch.distributed's TCPStore, as torch's rendezvous uses).

    replica/<r>  "<generation> <zmq address> <http base URL>"   set by replica r's node each
                                                              time it serves (0: its first start)
    down/<r>     "<generation> <restart_in or -> <why>"        set by its node each time it ends
    stop         set by the front door: every node stops its replicas (they drain)

Node 0 hosts the store; a node that loses it (the front door's node went away) stops its
replicas, so none outlives the deployment. A replica's node starts it again when it fails
(router.restart_limit), as node 0 does its own: a new generation of either key says so.
"""

from __future__ import annotations

import datetime

from torch.distributed import TCPStore

from meshserve.configs.schema import Config


class ReplicaRegistry:
    def __init__(self, config: Config, host: bool):
        cluster = config.cluster
        self.num_replicas = config.parallel.data
        self.store = TCPStore(cluster.master_addr or "127.0.0.1", cluster.master_port, is_master=host,
                              timeout=datetime.timedelta(seconds=cluster.rendezvous_timeout),
                              wait_for_workers=False, use_libuv=True)

    def announce(self, replica: int, zmq: str, http: str | None, generation: int = 0) -> None:
        self.store.set(f"replica/{replica}", f"{generation} {zmq} {http or 'off'}")

    def announcement(self, replica: int) -> tuple[int, str, str | None] | None:
        """Replica `replica`'s latest (generation, zmq, http), once its node announced it."""
        if not self.store.check([f"replica/{replica}"]):
            return None
        generation, zmq, http = self.store.get(f"replica/{replica}").decode().split(" ")
        return int(generation), zmq, None if http == "off" else http

    def report_down(self, replica: int, reason: str, generation: int = 0, restart_in: float | None = None) -> None:
        self.store.set(f"down/{replica}", f"{generation} {'-' if restart_in is None else restart_in} {reason}")

    def down_report(self, replica: int) -> tuple[int, str, float | None] | None:
        """Replica `replica`'s latest end, as its node reported it: (generation, why, seconds
        until its node starts it again or None)."""
        if not self.store.check([f"down/{replica}"]):
            return None
        generation, restart_in, reason = self.store.get(f"down/{replica}").decode().split(" ", 2)
        return int(generation), reason, None if restart_in == "-" else float(restart_in)

    def stop(self) -> None:
        self.store.set("stop", "1")

    def stopping(self) -> bool:
        return self.store.check(["stop"])
