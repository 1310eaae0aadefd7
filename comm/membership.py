"""What replicas started by their own launchers (torchrun, mpirun/srun, the deepspeed
launcher, `meshserve serve` elsewhere) and a `meshserve router` say to each other, on the
router's registration socket (router.listen): a replica joins with where its ZMQ frontend
is and what it serves, then beats; the router answers each with Welcome (its place), or
Refused (why it may not serve here, or that the router does not know it: join again), and
may ask it to stop (the admin API's drain). Frames are sealed with server.secret and the
socket is CURVE-encrypted with keys from it (comm/auth.py, comm/curve.py)."""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

Name = Annotated[str, Meta(min_length=1, max_length=256)]


class Join(Struct, tag="join", frozen=True, forbid_unknown_fields=True):
    name: Name
    """Stable across the replica's restarts (its advertised address, or router.name): a
    replica that joins again under its name takes its place again."""
    zmq: Annotated[str, Meta(min_length=1, max_length=512)]
    """Where the router reaches its ZMQ frontend."""
    http: Annotated[str, Meta(max_length=512)] | None
    """Its HTTP base URL (the router scrapes its /metrics), if it serves HTTP."""
    model: Annotated[str, Meta(max_length=4096)]
    vocab_size: Annotated[int, Meta(ge=1)]
    max_model_len: Annotated[int, Meta(ge=1)]
    world_size: Annotated[int, Meta(ge=1)]


class Heartbeat(Struct, tag="heartbeat", frozen=True, forbid_unknown_fields=True):
    name: Name


class Leave(Struct, tag="leave", frozen=True, forbid_unknown_fields=True):
    """The replica stops: `done` False when it starts draining (route nothing more to it),
    True once it stopped."""

    name: Name
    done: bool = False


class Welcome(Struct, tag="welcome", frozen=True):
    replica: int
    heartbeat_interval: float


class Refused(Struct, tag="refused", frozen=True):
    reason: str
    rejoin: bool = False
    """The router does not know the replica (it started again): join again."""


class StopReplica(Struct, tag="stop", frozen=True):
    """Drain and exit (the admin API's drain or remove of a replica that joined)."""

    reason: str


ToRouter = Union[Join, Heartbeat, Leave]
ToReplica = Union[Welcome, Refused, StopReplica]


def router_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToRouter)


def replica_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToReplica)
