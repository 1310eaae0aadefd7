"""`meshserve admin`: the front door's admin API from the command line (httpx, no torch).

    meshserve admin URL list
    meshserve admin URL drain R [--timeout S]
    meshserve admin URL restart R [--set KEY=VALUE ...]
    meshserve admin URL rolling-restart [--set KEY=VALUE ...]   every serving replica, one at a time
    meshserve admin URL add [--set KEY=VALUE ...]
    meshserve admin URL remove R

The key: --admin-key, else $MESHSERVE_ADMIN_KEY.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

POLL_S = 0.5


class AdminApi:
    def __init__(self, url: str, key: str | None, timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        reply = httpx.request(method, f"{self.url}/admin{path}", json=body, headers=self.headers, timeout=self.timeout)
        if reply.status_code >= 400:
            try:
                message = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = reply.text
            raise AdminFailed(f"{method} /admin{path}: {reply.status_code}: {message}")
        return reply.json()

    def replicas(self) -> list[dict]:
        return self._call("GET", "/replicas")["replicas"]

    def drain(self, replica: int, timeout: float) -> dict:
        return self._call("POST", f"/replicas/{replica}/drain", {"timeout": timeout})

    def restart(self, replica: int, sets: list[str], timeout: float) -> dict:
        return self._call("POST", f"/replicas/{replica}/restart", {"set": sets, "timeout": timeout})

    def add(self, sets: list[str]) -> dict:
        return self._call("POST", "/replicas", {"set": sets})

    def remove(self, replica: int, timeout: float) -> dict:
        return self._call("DELETE", f"/replicas/{replica}", {"timeout": timeout})

    def wait_serving(self, replica: int, restarts_above: int, timeout: float) -> dict:
        """Until `replica` serves with more than `restarts_above` restarts (or `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            item = next(r for r in self.replicas() if r["replica"] == replica)
            if item["state"] == "serving" and item["restarts"] > restarts_above:
                return item
            if item["state"] in ("failed", "stopped", "removed"):
                raise AdminFailed(f"replica {replica} is {item['state']}: {item.get('reason', '')}")
            if time.monotonic() > deadline:
                raise AdminFailed(f"replica {replica} did not serve again within {timeout:.0f} s ({item['state']})")
            time.sleep(POLL_S)

    def rolling_restart(self, sets: list[str], drain_timeout: float, start_timeout: float, say=print) -> None:
        """Every serving replica restarted in turn: the next one drains only once the last
        serves again, so all but one serve throughout."""
        for item in [r for r in self.replicas() if r["state"] == "serving"]:
            r = item["replica"]
            say(f"replica {r}: draining, then restarting")
            started = time.monotonic()
            self.restart(r, sets, drain_timeout)
            self.wait_serving(r, item["restarts"], drain_timeout + start_timeout)
            say(f"replica {r}: serving again after {time.monotonic() - started:.1f} s")


class AdminFailed(Exception):
    pass


def add_parser(sub, api_key_default) -> None:
    p = sub.add_parser("admin", help="list, drain, restart, add and remove the replicas of a running front door")
    p.add_argument("url", metavar="URL", help="the front door's HTTP base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("action", choices=["list", "drain", "restart", "rolling-restart", "add", "remove"])
    p.add_argument("replica", nargs="?", type=int, metavar="R")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="restart, rolling-restart, add: a config override for the replica (repeatable)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a draining replica's requests get to finish before they move to another replica")
    p.add_argument("--start-timeout", type=float, default=300.0, help="rolling-restart: seconds a replica gets to "
                                                                      "serve again")
    p.add_argument("--admin-key", default=None, help="default: $MESHSERVE_ADMIN_KEY")
    p.set_defaults(admin_key_default=api_key_default)


def run(args: argparse.Namespace) -> int:
    api = AdminApi(args.url, args.admin_key or args.admin_key_default())
    needs_replica = args.action in ("drain", "restart", "remove")
    if needs_replica != (args.replica is not None):
        print(f"meshserve admin {args.action}: {'give' if needs_replica else 'no'} replica number", file=sys.stderr)
        return 2
    try:
        if args.action == "list":
            out = api.replicas()
        elif args.action == "drain":
            out = api.drain(args.replica, args.timeout)
        elif args.action == "restart":
            out = api.restart(args.replica, args.sets, args.timeout)
        elif args.action == "add":
            out = api.add(args.sets)
        elif args.action == "remove":
            out = api.remove(args.replica, args.timeout)
        else:
            api.rolling_restart(args.sets, args.timeout, args.start_timeout,
                                say=lambda line: print(line, file=sys.stderr, flush=True))
            out = api.replicas()
    except (AdminFailed, httpx.HTTPError) as e:
        print(f"meshserve admin: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0
