"""What the front door knows of each replica: starting (added at run time), serving,
draining (it takes no new requests), restarting (its launcher starts it again), failed (for
good), stopped or removed, why it is out, and how often it was restarted; and the events
that change it, which the launcher's threads put in the front door's inbox. /health, the
admin API's list and /metrics answer from here. Plain Python."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ReplicaDown:
    """A replica's processes ended (from the launcher's threads)."""

    replica: int
    reason: str
    expected: bool = False
    """It stopped because the deployment is stopping."""
    restart_in: float | None = None
    """Seconds until its launcher starts it again; None: it is not restarted."""


@dataclass(frozen=True)
class ReplicaUp:
    """A started (or joined) replica serves, its ZMQ frontend at `zmq`."""

    replica: int
    zmq: str
    name: str | None = None
    """A replica that joined: the name it joined under."""


@dataclass(frozen=True)
class ReplicaLeaving:
    """A replica that joined is draining on its own (its launcher stops it): route nothing
    more to it."""

    replica: int
    reason: str


class State(str, Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"
    REMOVED = "removed"


COMING = (State.STARTING, State.SERVING, State.DRAINING, State.RESTARTING)
"""States of a replica that serves, or will again without anyone's help."""


class ReplicaStates:
    def __init__(self, num_replicas: int):
        self.state = [State.SERVING] * num_replicas
        self.reason = [""] * num_replicas
        self.restarts = [0] * num_replicas
        self.names: dict[int, str] = {}
        """The names replicas joined under."""

    def __len__(self) -> int:
        return len(self.state)

    def add(self) -> int:
        """A replica added at run time (starting); its index."""
        self.state.append(State.STARTING)
        self.reason.append("starting")
        self.restarts.append(0)
        return len(self.state) - 1

    def down(self, event: ReplicaDown, stopping: bool, removed: bool = False) -> None:
        r = event.replica
        if removed:
            self.state[r], self.reason[r] = State.REMOVED, "removed"
        elif stopping:
            self.state[r], self.reason[r] = State.STOPPED, "stopped"
        elif event.restart_in is not None:
            self.state[r], self.reason[r] = State.RESTARTING, event.reason
        elif event.expected:
            self.state[r], self.reason[r] = State.STOPPED, event.reason
        else:
            self.state[r], self.reason[r] = State.FAILED, event.reason

    def draining(self, replica: int, why: str) -> None:
        self.state[replica], self.reason[replica] = State.DRAINING, why

    def up(self, replica: int) -> None:
        if self.state[replica] is not State.STARTING:
            self.restarts[replica] += 1
        self.state[replica], self.reason[replica] = State.SERVING, ""

    def serving(self, replica: int) -> bool:
        return self.state[replica] is State.SERVING

    def out(self) -> dict[int, str]:
        """The replicas out of service (removed ones aside) -> why."""
        return {r: self.reason[r] for r in range(len(self)) if self.state[r] not in (State.SERVING, State.REMOVED)}

    def may_serve_again(self) -> bool:
        """Some replica serves, or will again without anyone's help."""
        return any(s in COMING for s in self.state)

    def listed(self) -> list[dict]:
        return [{"replica": r, "state": s.value, "restarts": self.restarts[r],
                 **({"name": self.names[r]} if r in self.names else {}),
                 **({"reason": self.reason[r]} if self.reason[r] else {})} for r, s in enumerate(self.state)]

    def health(self) -> tuple[int, dict]:
        """/health: 200 `ok` with every replica serving, 200 `degraded` with some (a load
        balancer keeps sending), 503 `failed` with none."""
        out = self.out()
        total = sum(s is not State.REMOVED for s in self.state)
        serving = total - len(out)
        replicas = {"total": total, "serving": serving,
                    "down": [{"replica": r, "reason": why, "state": self.state[r].value} for r, why in sorted(out.items())],
                    "restarts": sum(self.restarts),
                    "each": [{"replica": r, "state": s.value, "restarts": self.restarts[r]}
                             for r, s in enumerate(self.state)]}
        if not total:
            return 503, {"status": "waiting", "replicas": replicas}
        if not serving:
            return 503, {"status": "failed", "replicas": replicas}
        return 200, {"status": "degraded" if out else "ok", "replicas": replicas}
