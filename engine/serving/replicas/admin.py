"""The front door's admin API: list the replicas, drain one (it takes no new requests and
finishes its streams, or moves them after `timeout`, then stops), restart one (drained
first; with config overrides: a new model.path is new weights, one replica at a time a
rolling restart), add one and remove one. Every call needs `Authorization: Bearer
<server.admin_key>`; with no admin key the API is off. The calls go to the front door's
loop as AdminCommands (it owns the replicas' state); `meshserve admin` is its CLI.

    GET    /admin/replicas                   -> {"replicas": [{"replica", "state", "restarts", ...}]}
    POST   /admin/replicas                   {"set": [...]}            add one -> {"replica": N}
    POST   /admin/replicas/{r}/drain         {"timeout": s}
    POST   /admin/replicas/{r}/restart       {"set": [...], "timeout": s}
    DELETE /admin/replicas/{r}               {"timeout": s}            drain, then remove
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from dataclasses import dataclass, field
from typing import Callable, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

Op = Literal["list", "add", "drain", "restart", "remove"]

DEPLOYMENT_KEYS = ("parallel.", "cluster.", "server.", "router.", "disaggregation.")
"""Overrides that belong to the deployment, not to one replica: refused in `set`."""
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class AdminError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class AdminCommand:
    op: Op
    replica: int | None = None
    sets: list[str] | None = None
    """Config overrides (KEY=VALUE) the replica starts with from now on (restart, add)."""
    timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    """Drain: seconds its requests get to finish before they move to other replicas."""
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Change(BaseModel, extra="forbid"):
    set: list[str] = Field(default_factory=list)
    timeout: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0.0)


def check_overrides(sets: list[str]) -> None:
    bad = [s for s in sets if "=" not in s or s.split("=", 1)[0].startswith(DEPLOYMENT_KEYS)]
    if bad:
        raise AdminError(400, f"overrides {bad} are not a replica's: give KEY=VALUE, and no "
                              f"{', '.join(k + '*' for k in DEPLOYMENT_KEYS)} (those are the deployment's)")


def admin_router(submit: Callable[[AdminCommand], None], admin_key: str | None,
                 check_sets: Callable[[list[str]], None]) -> APIRouter:
    """The routes; `submit(cmd)` puts a command in the front door's inbox; `check_sets(sets)`
    raises ValueError if the config with those overrides is not one a replica can start."""
    router = APIRouter(prefix="/admin")
    key = None if admin_key is None else admin_key.encode()

    async def call(request: Request, op: Op, replica: int | None = None, change: Change | None = None):
        if key is None:
            return _error(403, "the admin API is off: set server.admin_key (or MESHSERVE_ADMIN_KEY)")
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key):
            return _error(401, "missing or wrong admin key: send `Authorization: Bearer <server.admin_key>`")
        try:
            if change is not None and change.set:
                check_overrides(change.set)
                try:
                    await asyncio.to_thread(check_sets, change.set)
                except ValueError as e:
                    raise AdminError(400, f"overrides {change.set}: {e}") from None
            cmd = AdminCommand(op, replica, change.set if change is not None and change.set else None,
                               change.timeout if change is not None else DEFAULT_DRAIN_TIMEOUT_S)
            submit(cmd)
            return await asyncio.wrap_future(cmd.done)
        except AdminError as e:
            return _error(e.status, e.message)

    @router.get("/replicas")
    async def list_replicas(request: Request):
        return await call(request, "list")

    @router.post("/replicas")
    async def add_replica(request: Request, change: Change | None = None):
        return await call(request, "add", None, change or Change())

    @router.post("/replicas/{replica}/drain")
    async def drain_replica(request: Request, replica: int, change: Change | None = None):
        return await call(request, "drain", replica, change or Change())

    @router.post("/replicas/{replica}/restart")
    async def restart_replica(request: Request, replica: int, change: Change | None = None):
        return await call(request, "restart", replica, change or Change())

    @router.delete("/replicas/{replica}")
    async def remove_replica(request: Request, replica: int, change: Change | None = None):
        return await call(request, "remove", replica, change or Change())

    return router


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "admin_error", "code": status}}, status)
