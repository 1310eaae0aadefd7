"""The architecture (docs/architecture.md), checked on the source (ast) and at run time:

    configs <- comm <- parallel <- layers <- engine <- launcher

A package imports meshserve.X only for X to its left or itself; `client` imports only
`comm` and itself; the engine core (engine/*) never imports the serving front
(engine/serving/), and only the serving front imports the web stack; layers/kernels/ is a
leaf; the OpenAI serving layer never imports the transport beneath it; only
engine/serving/frontends.py constructs a frontend (launcher/ never does); `configs` and
`client` never import torch; nothing unpickles; layers receive their groups instead of
asking torch.distributed; only the launcher reads the environment.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["configs", "comm", "parallel", "layers", "engine", "launcher"]
PACKAGES = LAYERS + ["client"]
ALLOWED: dict[str, set[str]] = {pkg: set(LAYERS[: i + 1]) for i, pkg in enumerate(LAYERS)}
ALLOWED["client"] = {"comm", "client"}
ALLOWED["launcher"].add("client")  # the CLI's `bench` runs the client-side load generator


@dataclass(frozen=True)
class Source:
    package: str
    path: Path
    module: str
    tree: ast.Module

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


@lru_cache(maxsize=1)
def sources() -> tuple[Source, ...]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT / pkg).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join(("meshserve", pkg) + parts)
            out.append(Source(pkg, path, module, ast.parse(path.read_text(), filename=str(path))))
    return tuple(out)


def imported_modules(src: Source) -> list[tuple[int, str]]:
    """Absolute names of every module imported anywhere in the file (also inside
    functions and TYPE_CHECKING blocks), with relative imports resolved."""
    names = []
    is_pkg = src.path.name == "__init__.py"
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = src.module.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append((node.lineno, mod))
            # `from meshserve import engine` imports meshserve.engine
            if mod == "meshserve":
                names += [(node.lineno, f"meshserve.{a.name}") for a in node.names]
    return names


def test_every_package_has_sources():
    found = {s.package for s in sources()}
    assert found == set(PACKAGES)
    assert len(sources()) >= 30


def test_import_layering():
    violations = []
    for src in sources():
        for line, mod in imported_modules(src):
            parts = mod.split(".")
            if parts[0] != "meshserve" or len(parts) < 2:
                continue
            if parts[1] not in ALLOWED[src.package]:
                violations.append(f"{src.rel}:{line}: {src.package} imports {mod}")
    assert not violations, "layering broken (docs/architecture.md):\n" + "\n".join(violations)


def test_layering_check_sees_real_imports():
    # The check above would pass vacuously if it found no meshserve imports at all.
    seen = {(src.package, mod.split(".")[1]) for src in sources() for _, mod in imported_modules(src)
            if mod.startswith("meshserve.")}
    assert {("engine", "layers"), ("layers", "comm"), ("launcher", "configs"), ("client", "comm"),
            ("parallel", "comm")} <= seen


SERVING = "meshserve.engine.serving"
WEB_STACK = {"fastapi", "starlette", "uvicorn", "h11", "prometheus_client"}


def _serving_rule_violations(srcs) -> list[str]:
    """The engine core importing the serving front, or anything outside it the web stack."""
    bad = []
    for src in srcs:
        in_serving = src.module == SERVING or src.module.startswith(SERVING + ".")
        for line, mod in imported_modules(src):
            if src.package == "engine" and not in_serving and (mod == SERVING or mod.startswith(SERVING + ".")):
                bad.append(f"{src.rel}:{line}: the engine core imports the serving front ({mod})")
            if mod.split(".")[0] in WEB_STACK and not in_serving:
                bad.append(f"{src.rel}:{line}: imports {mod} outside engine/serving/")
    return bad


def test_the_engine_core_imports_nothing_of_the_serving_front():
    assert not _serving_rule_violations(sources()), "\n".join(_serving_rule_violations(sources()))
    assert any(src.module.startswith(SERVING + ".") for src in sources())


def test_serving_rule_detector_works():
    core = Source("engine", ROOT / "engine" / "x.py", "meshserve.engine.x",
                  ast.parse("from meshserve.engine.serving.server import Server\nimport fastapi\n"))
    front = Source("engine", ROOT / "engine" / "serving" / "y.py", "meshserve.engine.serving.y",
                   ast.parse("import fastapi\nfrom meshserve.engine.engine import Engine\n"))
    assert len(_serving_rule_violations([core, front])) == 2


KERNELS = "meshserve.layers.kernels"
KERNEL_MAY_IMPORT = (KERNELS, "meshserve.configs")
"""The kernels and their bindings are a leaf: they know the build cache and the CPU's
features (configs), never the model, the backends or the engine that call them."""


def _kernel_rule_violations(srcs) -> list[str]:
    return [f"{src.rel}:{line}: a kernel module imports {mod}" for src in srcs
            if src.module == KERNELS or src.module.startswith(KERNELS + ".")
            for line, mod in imported_modules(src)
            if mod.startswith("meshserve") and not any(mod == m or mod.startswith(m + ".") for m in KERNEL_MAY_IMPORT)]


def test_the_kernels_are_a_leaf():
    assert not _kernel_rule_violations(sources()), "\n".join(_kernel_rule_violations(sources()))
    assert sum(src.module.startswith(KERNELS + ".") for src in sources()) >= 5


def test_kernel_rule_detector_works():
    kernel = Source("layers", ROOT / "layers" / "kernels" / "k.py", "meshserve.layers.kernels.k",
                    ast.parse("from meshserve.layers.backend import Backend\nfrom meshserve.layers import llama\n"
                              "from meshserve.configs.artifact_cache import CACHE_ROOT\nfrom . import rotary\n"))
    assert [v.split(": ")[1] for v in _kernel_rule_violations([kernel])] == [
        "a kernel module imports meshserve.layers.backend", "a kernel module imports meshserve.layers"]


TRANSPORT = {f"{SERVING}.{m}" for m in ("http_frontend", "http_app", "http_protocol", "zmq_frontend", "server",
                                        "frontends")}
"""The transports of the serving front: the HTTP and ZMQ frontends, the step loop's server and
their assembly. The OpenAI pipelines are written against engine_link.EngineLink instead."""
OPENAI_LAYER = ("openai_", "responses_api", "tokenize_api", "request_body", "structured_request", "tools")


def _openai_layer(src: Source) -> bool:
    return src.module.startswith(SERVING + ".") and src.module[len(SERVING) + 1:].startswith(OPENAI_LAYER)


def _transport_rule_violations(srcs) -> list[str]:
    return [f"{src.rel}:{line}: the OpenAI serving layer imports the transport ({mod})" for src in srcs
            if _openai_layer(src) for line, mod in imported_modules(src)
            if any(mod == t or mod.startswith(t + ".") for t in TRANSPORT)]


def test_the_openai_serving_layer_never_imports_the_transport():
    assert not _transport_rule_violations(sources()), "\n".join(_transport_rule_violations(sources()))
    layer = {src.module.rsplit(".", 1)[-1] for src in sources() if _openai_layer(src)}
    assert {"openai_serving", "openai_generation", "responses_api", "tokenize_api"} <= layer


def test_transport_rule_detector_works():
    pipeline = Source("engine", ROOT / "engine" / "serving" / "openai_x.py", f"{SERVING}.openai_x",
                      ast.parse("from meshserve.engine.serving.http_frontend import HttpFrontend\n"
                                "from meshserve.engine.serving.engine_link import EngineLink\n"))
    transport = Source("engine", ROOT / "engine" / "serving" / "http_app.py", f"{SERVING}.http_app",
                       ast.parse("from meshserve.engine.serving.http_frontend import HttpFrontend\n"))
    assert len(_transport_rule_violations([pipeline, transport])) == 1


FRONTENDS = {"HttpFrontend", "ZmqFrontend"}


def test_one_assembly_of_the_frontends():
    """engine/serving/frontends.py (build_frontends) is the only package code that constructs
    a frontend or imports the modules that define them; launcher/ starts processes and
    calls it."""
    found = _constructions([(s.rel, s.tree) for s in sources()], FRONTENDS)
    assert found and all(f.startswith("engine/serving/frontends.py:") for f in found), "\n".join(found)
    defining = {f"{SERVING}.http_frontend", f"{SERVING}.zmq_frontend"}
    launcher = [f"{src.rel}:{line}: {mod}" for src in sources() if src.package == "launcher"
                for line, mod in imported_modules(src) if mod in defining]
    assert not launcher, "launcher/ never constructs a frontend:\n" + "\n".join(launcher)


@pytest.mark.parametrize("package", ["configs", "client"])
def test_no_torch_import_in_source(package):
    bad = [f"{src.rel}:{line}: {mod}" for src in sources() if src.package == package
           for line, mod in imported_modules(src) if mod.split(".")[0] == "torch"]
    assert not bad, bad


def test_configs_and_client_import_no_torch_at_run_time(tiny_checkpoints):
    # Import both packages and validate a real config with its memory plan, as the launcher
    # does before spawning ranks: torch must stay out of the process.
    code = ("import sys\n"
            "import meshserve.configs, meshserve.client, meshserve.configs.gguf_meta\n"
            "from meshserve.configs import load_config\n"
            "from meshserve.configs.validate import check_config\n"
            "from meshserve.configs.memory import plan_memory\n"
            f"c = load_config(None, ['model.path={tiny_checkpoints['llama']}'])\n"
            "plan_memory(c, check_config(c))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"torch imported by configs/client: {out.stdout.strip()}"


UNPICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}


def test_no_pickle_anywhere():
    bad = []
    for src in sources():
        for line, mod in imported_modules(src):
            if mod.split(".")[0] in UNPICKLERS:
                bad.append(f"{src.rel}:{line}: imports {mod}")
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Attribute) and node.attr in {"recv_pyobj", "send_pyobj", "recv_serialized",
                                                                  "send_serialized"}:
                bad.append(f"{src.rel}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Name) and node.id in UNPICKLERS:
                bad.append(f"{src.rel}:{node.lineno}: {node.id}")
    assert not bad, "no socket or file may be unpickled:\n" + "\n".join(bad)


def _is_torch_load(func: ast.expr) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name) \
        and func.value.id == "torch"


def _weights_only_true(call: ast.Call) -> bool:
    return any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def test_torch_load_only_with_weights_only():
    bad = []
    for src in sources():
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Call) and _is_torch_load(node.func) and not _weights_only_true(node):
                bad.append(f"{src.rel}:{node.lineno}")
        for node in ast.walk(src.tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
                bad.append(f"{src.rel}:{node.lineno}: from torch import load")
    assert not bad, "torch.load without weights_only=True unpickles arbitrary objects:\n" + "\n".join(bad)


def test_torch_load_detector_works():
    tree = ast.parse("torch.load(f)\ntorch.load(f, weights_only=True)\ntorch.load(f, weights_only=False)\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_torch_load(n.func)]
    assert [_weights_only_true(c) for c in sorted(calls, key=lambda c: c.lineno)] == [False, True, False]


RANK_QUERIES = {"get_rank", "get_world_size", "get_global_rank", "get_group_rank"}


def _dist_aliases(tree: ast.Module) -> set[str]:
    """Names bound to torch.distributed in this file (`import torch.distributed as dist`, ...)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return aliases | {"dist"}


def rank_queries(tree: ast.Module) -> list[tuple[int, str]]:
    """Calls that ask torch.distributed for a rank or a world size."""
    aliases = _dist_aliases(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RANK_QUERIES:
            base = node.func.value
            if (isinstance(base, ast.Name) and base.id in aliases) or \
                    (isinstance(base, ast.Attribute) and base.attr == "distributed"):
                hits.append((node.lineno, f"{ast.unparse(node.func)}()"))
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            hits += [(node.lineno, f"from torch.distributed import {a.name}")
                     for a in node.names if a.name in RANK_QUERIES]
    return hits


def test_layers_never_ask_torch_distributed_for_ranks():
    bad = [f"{src.rel}:{line}: {what}" for src in sources() if src.package == "layers"
           for line, what in rank_queries(src.tree)]
    assert not bad, "layers receive their group in the constructor (docs/architecture.md):\n" + "\n".join(bad)


def test_rank_query_detector_works():
    code = ("import torch.distributed as d\nfrom torch import distributed\nd.get_rank()\n"
            "distributed.get_world_size()\ntorch.distributed.get_rank()\nself.group.rank\ngroup.get_rank()\n"
            "dist.get_world_size(group)\nfrom torch.distributed import get_rank\n")
    assert [line for line, _ in sorted(rank_queries(ast.parse(code)))] == [3, 4, 5, 8, 9]


ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_uses(src: Source) -> list[str]:
    uses = []
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_ATTRS and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            uses.append(f"{src.rel}:{node.lineno}: os.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            uses += [f"{src.rel}:{node.lineno}: from os import {a.name}" for a in node.names if a.name in ENV_ATTRS]
    return uses


def test_only_the_launcher_reads_the_environment():
    bad = [u for src in sources() if src.package != "launcher" for u in env_uses(src)]
    assert not bad, "only launcher/ reads environment variables (docs/architecture.md):\n" + "\n".join(bad)
    # and the detector does see the launcher's own reads
    assert any(env_uses(src) for src in sources() if src.package == "launcher")


def _constructions(trees, names: set[str]) -> list[str]:
    """Calls of the classes in `names` (by their bare name or as an attribute)."""
    found = []
    for rel, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in names:
                    found.append(f"{rel}:{node.lineno}: {name}(...)")
    return found


def test_one_builder_assembles_every_engine():
    """engine/build.py is the only place that constructs a ModelRunner or an Engine: the
    launcher, the scripts and the tests call its functions."""
    trees = [(s.rel, s.tree) for s in sources()]
    for folder in ("scripts", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            trees.append((str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))))
    found = _constructions(trees, {"ModelRunner", "Engine"})
    assert found and all(f.startswith("engine/build.py:") for f in found), "\n".join(found)
    assert _constructions([("x.py", ast.parse("Engine(a)\nm.ModelRunner(b)\n"))], {"ModelRunner", "Engine"})


def test_every_package_folder_is_installed():
    """A folder with an __init__.py that pyproject does not list is missing from a wheel
    (an editable install finds it all the same, so only this test notices)."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: name for name, folder in setuptools["package-dir"].items()}
    found = set()
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join([folders[rel[0]], *rel[1:]]))
    assert found - set(setuptools["packages"]) == set()
