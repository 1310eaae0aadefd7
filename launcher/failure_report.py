"""Why a rank gave up, told to the launcher that started it, so the launcher's last line
names the cause rather than the first process to exit.

A rank that exits because it saw another fail (a peer's heartbeat stopped, a collective
with a dead peer raised) is usually the first to exit: a hung peer never does. Under torch
elastic (`meshserve serve`, torchrun) every rank has an error file (TORCHELASTIC_ERROR_FILE)
that the agent reads when the rank fails; the rank writes its reason there, in the format
the agent reads (a string message and a timestamp), marked as meshserve's:

    meshserve: rank 1 sent no heartbeat for <cluster.failure_timeout> s (reported by rank 0, which then exited: exit code 1); ...
"""

from __future__ import annotations

import json
import time

from meshserve.launcher.env import elastic_error_file

MARK = "meshserve_reason"
"""Tells meshserve's report from what torch elastic fills in without one ({"message": "<NONE>"})."""


def report_failure(reason: str) -> None:
    """Write `reason` to this rank's elastic error file, if its launcher gave one."""
    path = elastic_error_file()
    if path is None:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": reason, "timestamp": int(time.time()), MARK: True}, f)
    except OSError:
        pass  # the launcher's line then names the rank only


def reported_reason(error_file_data: dict) -> str | None:
    """The reason a failed rank reported (a torch elastic ProcessFailure's error_file_data),
    or None: killed by a signal, or it exited without reporting one."""
    message = error_file_data.get("message")
    return message if error_file_data.get(MARK) is True and isinstance(message, str) and message else None
