"""What the tests across nodes and launchers share: the command line, a secret, the
launchers installed with the test extras, and a config file for the tiny checkpoints (the
two network namespaces are conftest.py's `nodes` fixture)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from support.server import free_port

CLI = [sys.executable, "-m", "meshserve.launcher.cli"]
SECRET = "multinode-test-secret-0123456789abcdef"


def write_config(tmp_path: Path, model: Path, name: str, tensor: int, pipeline: int = 1, zmq: str | None = None,
                 cluster: dict | None = None, secret: str | None = None) -> Path:
    data = {
        "model": {"path": str(model), "max_model_len": 256, "dtype": "float32"},
        "parallel": {"tensor": tensor, "pipeline": pipeline},
        "device": {"threads": 1},
        "cache": {"memory": "16MiB"},
        "server": {"zmq": zmq or f"tcp://127.0.0.1:{free_port()}", "http": None},
    }
    if secret is not None:
        data["server"]["secret"] = secret
    if cluster:
        data["cluster"] = cluster
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def tool(name: str) -> str:
    """A launcher installed with the test extras (next to this Python, or on PATH)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found: install the test extras (README's test command)")
    return found
