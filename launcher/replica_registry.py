"""Where the replicas of several nodes meet the front door: a key-value store on node 0 at
cluster.master_addr:master_port (torch.distributed's TCPStore, as torch's rendezvous uses).

    replica/<r>  "<zmq address> <http base URL>"   set by replica r's node once it serves
    down/<r>     why replica r ended                 set by its node when its process exits
    stop         set by the front door: every node stops its replicas (they drain)

Node 0 hosts the store; a node that loses it (the front door's node went away) stops its
replicas, so none outlives the deployment.
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

    def announce(self, replica: int, zmq: str, http: str | None) -> None:
        self.store.set(f"replica/{replica}", f"{zmq} {http or 'off'}")

    def address(self, replica: int) -> tuple[str, str | None] | None:
        """Replica `replica`'s (zmq, http), once its node announced it."""
        if not self.store.check([f"replica/{replica}"]):
            return None
        zmq, http = self.store.get(f"replica/{replica}").decode().split(" ")
        return zmq, None if http == "off" else http

    def report_down(self, replica: int, reason: str) -> None:
        self.store.set(f"down/{replica}", reason)

    def down(self, replicas: list[int]) -> dict[int, str]:
        """Which of `replicas` their nodes reported ended, and why."""
        out = {}
        for r in replicas:
            if self.store.check([f"down/{r}"]):
                out[r] = self.store.get(f"down/{r}").decode()
        return out

    def stop(self) -> None:
        self.store.set("stop", "1")

    def stopping(self) -> bool:
        return self.store.check(["stop"])
