"""Processes that must not outlive the one that started them.

torch's elastic agent starts each rank in a session of its own, so a launcher killed
outright (SIGKILL, the OOM killer) would leave its ranks serving with nobody to stop them.
Each child therefore asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG,
Linux), which a driver takes as the start of a drain, as it takes any SIGTERM."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM to this process when the thread that started it ends (a no-op off Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_launcher(launcher_pid: int | None) -> None:
    """In a rank that `meshserve serve` started (`--launcher-pid`): SIGTERM when the launcher
    dies, and an exit now if it is gone already (then the request came too late to be heard).
    Ranks that torchrun, mpirun or deepspeed started have no such pid: their agents watch them."""
    if launcher_pid is None:
        return
    die_with_parent()
    if os.getppid() != launcher_pid:
        sys.exit(f"meshserve: the launcher (pid {launcher_pid}) is gone; this rank stops")
