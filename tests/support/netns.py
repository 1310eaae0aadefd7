"""Two "nodes" on one machine: two network namespaces joined by a veth pair, each with its
own loopback and one interface named `msnet0` (10.77.0.1 and 10.77.0.2). Processes started
with `TwoNodes.cmd(k, ...)` see only node k's network, as on a separate host; they share
the file system and /dev/shm with the test (as ranks of one real node do).

Needs root (CAP_NET_ADMIN) and iproute2. Namespace names carry the test process's pid, so
concurrent runs do not collide; `remove_stale()` deletes those left by dead processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

INTERFACE = "msnet0"
ADDRESSES = ("10.77.0.1", "10.77.0.2")
_NAME = re.compile(r"^msn(\d+)-[01]$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"msn{os.getpid()}-probe"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


class TwoNodes:
    def __init__(self):
        tag = f"msn{os.getpid()}"
        self.names = (f"{tag}-0", f"{tag}-1")
        self.addresses = ADDRESSES
        self.interface = INTERFACE
        self._veth = (f"ms{os.getpid()}a"[-15:], f"ms{os.getpid()}b"[-15:])

    def up(self) -> "TwoNodes":
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
            for name, veth, address in zip(self.names, self._veth, self.addresses):
                _ip("link", "set", veth, "netns", name)
                _ip("-n", name, "link", "set", veth, "name", self.interface)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", self.interface)
                _ip("-n", name, "link", "set", self.interface, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.down()
            raise RuntimeError(f"making the namespaces failed: {' '.join(e.cmd)}: {e.stderr.strip()}") from None
        return self

    def cmd(self, node: int, argv: list[str]) -> list[str]:
        """`argv` run inside node `node`'s network namespace."""
        return ["ip", "netns", "exec", self.names[node], *argv]

    def down(self) -> None:
        """Kill what still runs inside them (all started by the test), then delete both
        namespaces; the veth pair goes with them."""
        for name in self.names:
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in self.names:
            _ip("netns", "del", name, check=False)
        _ip("link", "del", self._veth[0], check=False)  # only if the pair never moved
