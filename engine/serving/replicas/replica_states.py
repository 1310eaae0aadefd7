"""What the front door knows of each replica: serving, restarting (its launcher starts it
again), failed (for good) or stopped, why it is out, and how often it was restarted; and
the events that change it, which the launcher's threads put in the front door's inbox.
/health answers from here. Plain Python."""

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
    """A restarted replica serves, its ZMQ frontend at `zmq`."""

    replica: int
    zmq: str


class State(str, Enum):
    SERVING = "serving"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class ReplicaStates:
    def __init__(self, num_replicas: int):
        self.state = [State.SERVING] * num_replicas
        self.reason = [""] * num_replicas
        self.restarts = [0] * num_replicas

    def __len__(self) -> int:
        return len(self.state)

    def down(self, event: ReplicaDown, stopping: bool) -> None:
        r = event.replica
        if event.expected or stopping:
            self.state[r], self.reason[r] = State.STOPPED, "stopped"
        else:
            self.state[r] = State.RESTARTING if event.restart_in is not None else State.FAILED
            self.reason[r] = event.reason

    def up(self, replica: int) -> None:
        self.state[replica], self.reason[replica] = State.SERVING, ""
        self.restarts[replica] += 1

    def serving(self, replica: int) -> bool:
        return self.state[replica] is State.SERVING

    def out(self) -> dict[int, str]:
        """The replicas out of service -> why."""
        return {r: self.reason[r] for r in range(len(self)) if self.state[r] is not State.SERVING}

    def may_serve_again(self) -> bool:
        """Some replica serves or is being restarted."""
        return any(s in (State.SERVING, State.RESTARTING) for s in self.state)

    def health(self) -> tuple[int, dict]:
        """/health: 200 `ok` with every replica serving, 200 `degraded` with some (a load
        balancer keeps sending), 503 `failed` with none."""
        out = self.out()
        serving = len(self) - len(out)
        replicas = {"total": len(self), "serving": serving,
                    "down": [{"replica": r, "reason": why, "state": self.state[r].value} for r, why in sorted(out.items())],
                    "restarts": sum(self.restarts),
                    "each": [{"replica": r, "state": s.value, "restarts": self.restarts[r]}
                             for r, s in enumerate(self.state)]}
        if not serving:
            return 503, {"status": "failed", "replicas": replicas}
        return 200, {"status": "degraded" if out else "ok", "replicas": replicas}
