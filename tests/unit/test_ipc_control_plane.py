"""The control plane and heartbeats on one node (comm/endpoints.py): unix sockets in a fresh
directory of mode 0700 (launcher/rank.py: private_socket_dir), which a rank of the same user
joins and another user cannot enter: a process running as `nobody` neither connects to the
sockets nor hears or sends anything through ZeroMQ."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest

from meshserve.comm.control import DriverChannel, WorkerChannel
from meshserve.comm.endpoints import UNIX_PATH_MAX, Listener
from meshserve.comm.heartbeat import HeartbeatMonitor
from meshserve.comm.messages import StepPlan
from meshserve.launcher.rank import private_socket_dir

NOBODY = 65534

OUTSIDER = """
import json, socket, sys, time, zmq
from meshserve.comm.messages import RankStats, encoder
out = {}
for address in sys.argv[1:]:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(address.removeprefix("ipc://"))
        out[address] = "connected"
    except OSError as e:
        out[address] = type(e).__name__
ctx = zmq.Context()
subs = []
for address in sys.argv[1::2]:  # the PUB sockets
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    subs.append(sub)
pushes = []
for address in sys.argv[2::2]:  # the PULL sockets
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    push.send(encoder().encode(RankStats(1, 1.0, 1.0, 77)), zmq.NOBLOCK)
    pushes.append(push)
time.sleep(1.5)
out["heard"] = sum(s.poll(0) for s in subs)
print(json.dumps(out))
"""


@pytest.fixture
def socket_dir():
    path = private_socket_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _outsider(addresses: list[str], as_nobody: bool) -> dict:
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if as_nobody else []
    if as_nobody and subprocess.run([*user, sys.executable, "-c", "import zmq"], capture_output=True).returncode:
        pytest.skip("user nobody cannot import this virtual environment's packages (a directory above it is "
                    "private, e.g. a clone under mktemp -d), so no outsider process can be started")
    out = subprocess.run([*user, sys.executable, "-c", OUTSIDER, *addresses], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_private_socket_dir():
    path = private_socket_dir()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.stat(path).st_uid == os.getuid()
        assert os.path.basename(path).startswith("meshserve-") and os.listdir(path) == []
        assert len(f"{path}/heartbeat-pull") <= UNIX_PATH_MAX
        other = private_socket_dir()
        shutil.rmtree(other)
        assert other != path  # fresh each time
    finally:
        shutil.rmtree(path)


def test_listener_refuses_a_shared_or_too_long_directory(tmp_path):
    import zmq

    ctx = zmq.Context()
    try:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)
        with pytest.raises(PermissionError, match="mode 755: the control plane's directory must be private"):
            Listener(ctx, "control", None, ipc_dir=str(shared))
        deep = tmp_path / ("d" * 100)
        deep.mkdir(mode=0o700)
        with pytest.raises(ValueError, match=f"leave no room for the socket names within a unix socket path's "
                                             f"{UNIX_PATH_MAX} bytes"):
            Listener(ctx, "control", None, ipc_dir=str(deep))
        with pytest.raises(ValueError, match="exactly one"):
            Listener(ctx, "control", None)
    finally:
        ctx.term()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="running as another user needs root and setpriv (util-linux)")
def test_another_user_cannot_reach_the_control_plane(socket_dir, caplog):
    """No secret: the directory is all that keeps other users out. A rank of this user
    joins; `nobody` is refused at connect(), hears nothing, and its frames never arrive;
    this user's own outsider process does connect (the check can fail)."""
    with caplog.at_level(logging.INFO, logger="meshserve.comm"):
        driver = DriverChannel(2, None, ipc_dir=socket_dir)
        beats = HeartbeatMonitor(0, 2, driver.session, 0.2, 5.0, lambda reason: None, ipc_dir=socket_dir)
    addresses = [*driver.addresses.split(), *beats.addresses.split()]
    assert all(a.startswith(f"ipc://{socket_dir}/") for a in addresses), addresses
    assert "(PULL): unix sockets in a directory of mode 0700" in caplog.text
    worker = WorkerChannel(driver.addresses, 1)
    beats.start()
    try:
        t = threading.Thread(target=worker.handshake, args=(10,))
        t.start()
        driver.handshake(10)
        t.join(10)
        publishing = threading.Event()

        def publish():
            step = 0
            while not publishing.is_set():
                driver.publish(StepPlan(step, [], [], []))
                step += 1
                time.sleep(0.02)

        publisher = threading.Thread(target=publish)
        publisher.start()
        try:
            nobody = _outsider(addresses, as_nobody=True)
            same_user = _outsider(addresses, as_nobody=False)
        finally:
            publishing.set()
            publisher.join(10)
        assert nobody == {**{a: "PermissionError" for a in addresses}, "heard": 0}, nobody
        assert same_user == {**{a: "connected" for a in addresses}, "heard": 2}, same_user
        driver.drain()
        assert driver.rank_stats[1].steps == 77  # this user's outsider got through: the HMAC secret is for that
        del driver.rank_stats[1]
        assert isinstance(worker.recv(10), StepPlan)
    finally:
        beats.stop()
        worker.close()
        driver.close()
