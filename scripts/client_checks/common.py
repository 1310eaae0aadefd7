"""One client's checks against meshserve: each runs the client's own API once and records
what it sent, whether the client accepted the answer, and the error text when not."""
import importlib.metadata
import json
import sys

from pydantic import BaseModel

URL, MODEL = sys.argv[1] + "/v1", sys.argv[2]
ASK = 'Add 2 and 3. Reply in JSON like {"a": 1, "b": 1, "total": 2}.'
TOOL_ASK = "What is 2 + 3? Use the add tool."
RESULTS = {}


# NOTE: integers only, so that a 135M model's answer stays short; the docstring is sent as
# the schema's description.
class Sum(BaseModel):
    """Two addends and their total."""
    a: int
    b: int
    total: int


def need(condition, what):
    """Fails the running check with `what` (not an assert: those vanish under -O)."""
    if not condition:
        raise RuntimeError(what)


def server_answer(e):
    """The HTTP status and body behind a client's exception (or the one it wraps), verbatim."""
    while e is not None:
        if getattr(e, "status_code", None) is not None:
            return {"status": e.status_code, "body": getattr(e, "body", None)}
        e = e.__cause__ or e.__context__
    return {}


def check(name, sent, fn):
    """Runs `fn` (the client's own calls); it raises when the client did not get what it asked for."""
    try:
        RESULTS[name] = {"sent": sent, "ok": True, "got": repr(fn())[:300]}
    except Exception as e:
        RESULTS[name] = {"sent": sent, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
                         **server_answer(e)}
    print(f"{name}: {'ok' if RESULTS[name]['ok'] else 'FAILED'}", file=sys.stderr, flush=True)


def report(packages):
    """Prints the one JSON line the runner reads: package versions and per-check results."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    print(json.dumps({"versions": versions, "checks": RESULTS}))
