"""A script of scripts/ imported as a module, for tests of its helpers."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@contextmanager
def script_module(name: str):
    """scripts/NAME.py as a module: its folder on sys.path (scripts import their siblings, as
    bench_http) and the module in sys.modules (dataclasses look their module up)."""
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(SCRIPTS))
