"""Every code block of README.md, run as a user would copy it.

Each block is claimed by exactly one checker below (test_every_block_is_checked fails on a
block no checker knows, so a new snippet needs a check too):
- the two set-up commands: the test command is .ci/run's, and the serve command's
  `meshserve serve` is what the `served` fixture runs, verbatim, on its default addresses;
- Python snippets run in a subprocess against that server and must print what they promise;
  the Batch API's, against a server with server.batch.data_dir;
- `meshserve serve ...` lines are checked with `meshserve check` and the same arguments
  (what serve validates before it starts anything); other `meshserve` lines run verbatim;
  lines of other launchers (torchrun, mpirun, deepspeed) have their config checked the same;
- the configuration reference loads as the built-in default, key for key;
- `meshserve bench` lines run against the server with smaller counts (noted per line);
- the command-line synopsis names only flags the parser has.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from meshserve.configs import load_config
from support.server import MeshserveProcess

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
TIMEOUT = 300
LAUNCHERS = ("torchrun", "mpirun", "deepspeed")


def lines_of(body: str) -> list[str]:
    """Shell lines of a block, continuations joined, comments dropped."""
    text = body.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip()]


EXPORTED = {"MESHSERVE_SECRET": "readme-test-secret-" + "0" * 32, "MESHSERVE_API_KEY": "readme-test-key"}
"""What README's several-node section says to export on every node first."""


def meshserve(*args: str, timeout: float = TIMEOUT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshserve.launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_cwd(), env=env)


_CWD: list[Path] = []


def tmp_cwd() -> Path:
    return _CWD[0] if _CWD else REPO


def expand(line: str) -> list[str]:
    """A shell line's words, with $(...) substituted by running it (no other shell syntax)."""
    for sub in re.findall(r'"\$\((.*?)\)"', line):
        out = subprocess.run(["bash", "-c", sub], capture_output=True, text=True, timeout=60, check=True)
        line = line.replace(f'"$({sub})"', shlex.quote(out.stdout.strip()))
    return shlex.split(line)


def kind(lang: str, body: str) -> str:
    if lang == "" and body.lstrip().startswith("configs  <-"):
        return "picture"
    if lang == "" and body.lstrip().startswith("meshserve serve    ["):
        return "synopsis"
    if lang == "yaml":
        return "reference"
    if lang == "python" and "client.batches" in body:
        return "batch"
    if lang == "python":
        return "python"
    if lang == "bash" and body.startswith('pip install -e ".[gpu]"'):
        return "gpu"
    if lang == "bash" and body.startswith("pip install torch=="):
        return "setup"
    if lang == "bash" and "meshserve bench" in body:
        return "bench"
    if lang == "bash":
        return "commands"
    return "unknown"


def test_every_block_is_checked():
    kinds = [kind(lang, body) for lang, body in BLOCKS]
    assert "unknown" not in kinds, [b[:80] for (_, b), k in zip(BLOCKS, kinds) if k == "unknown"]
    assert {"picture", "synopsis", "reference", "python", "setup", "bench", "commands", "gpu", "batch"} <= set(kinds)


def blocks(k: str) -> list[str]:
    return [body for lang, body in BLOCKS if kind(lang, body) == k]


def test_the_picture_names_the_packages_there_are():
    names = set(re.findall(r"\b[a-z]+\b", blocks("picture")[0].splitlines()[0]))
    assert names == {"configs", "comm", "parallel", "layers", "engine", "launcher", "client", "only"}
    assert all((REPO / n).is_dir() for n in names - {"only"})


def test_the_setup_commands_are_what_ci_runs():
    serve, tests = sorted(blocks("setup"), key=lambda b: "pytest" in b)
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert tests.strip() == ci.strip()
    assert serve.strip() == tests.strip().replace('DS_BUILD_OPS=0 pip install -e ".[test]"', "pip install -e .").replace(
        "python -m pytest", "meshserve serve")


def test_the_configuration_reference_is_the_default_key_for_key(tmp_path):
    ref = blocks("reference")[0]
    (tmp_path / "ref.yaml").write_text(ref)
    assert load_config(tmp_path / "ref.yaml") == load_config(None)
    documented = yaml.safe_load(ref)
    default = load_config(None).model_dump(mode="json")
    for section, keys in default.items():
        missing = set(keys) - set(documented.get(section, {}))
        assert not missing, f"README's reference lacks {section}: {sorted(missing)}"


def test_the_synopsis_names_only_real_flags():
    from meshserve.launcher.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    command = None
    for line in blocks("synopsis")[0].splitlines():
        m = re.match(r"meshserve ([\w-]+)", line)
        command = m.group(1) if m else command  # a continuation line keeps its command
        known = {s for a in sub[command]._actions for s in a.option_strings}
        for flag in re.findall(r"\[(--?[a-z][\w-]*)", line):
            assert flag in known, f"{command} has no {flag}"


def test_the_gpu_commands_name_a_real_extra_and_check():
    install, *serves = lines_of(blocks("gpu")[0])
    assert install == 'pip install -e ".[gpu]"'
    assert re.search(r"^gpu = \[", (REPO / "pyproject.toml").read_text(), re.M)
    for line in serves:  # validated as serve would, before it looks for a GPU
        words = shlex.split(line)
        assert words[:2] == ["meshserve", "serve"], line
        out = meshserve("check", *words[2:])
        assert out.returncode == 0, f"{line}\n{out.stderr[-3000:]}"


@pytest.mark.slow
def test_the_commands_check_and_run(tmp_path):
    _CWD[:] = [tmp_path]
    ran = 0
    for body in blocks("commands"):
        for line in lines_of(body):
            words = expand(line)
            if words[0] in LAUNCHERS:  # another launcher: its config is checked, its cluster is not here
                configs = [w for w in words if w.endswith(".yaml")]
                assert configs, line
                for c in configs:
                    load_config(REPO / c)
                continue
            assert words[0] == "meshserve", line
            args = [w if not w.startswith("configs/") else str(REPO / w) for w in words[1:]]
            if "K" in args:  # a placeholder (the node rank): checked with node 0
                args[args.index("K")] = "0"
            if args[0] in ("serve", "worker", "router"):
                args[0] = "check"
            out = meshserve(*args, env=os.environ | EXPORTED if "nodes" in line or "router" in line else None)
            assert out.returncode == 0, f"{line}\n{out.stderr[-3000:]}"
            prompts = [args[i + 1] for i, a in enumerate(args) if a == "--prompt"]
            if args[0] == "generate" and len(prompts) > 1:  # one header per prompt, as README says
                assert all(f"[{i}/{len(prompts)}] {p}\n" in out.stdout for i, p in enumerate(prompts, 1)), out.stdout
            ran += 1
    assert ran >= 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`meshserve serve`, verbatim: the default model on the default addresses, in the dtype
    this CPU's default resolves to, which its start-up line names with the reason."""
    root = tmp_path_factory.mktemp("readme")
    server = MeshserveProcess(["-m", "meshserve.launcher.cli", "serve"], root)
    try:
        line = server.wait_ready(TIMEOUT)
        assert "zmq=tcp://127.0.0.1:5555 http=http://127.0.0.1:8000" in line, line
        dtype, why = load_config(None).dtype_choice
        log = server.tail(1 << 20)
        assert f"30 layers of 30 (stage 1/1, tp rank 0/1), {dtype} ({why})" in log, log[-3000:]
        yield server
        assert server.stop() == 0, server.tail()
    finally:
        server.kill()


@pytest.mark.slow
def test_the_python_snippets_run_and_print_what_they_promise(served, tmp_path):
    client, openai_snippet = blocks("python")
    for name, code, promised in (("client", client, ["Paris", "too_long"]), ("openai", openai_snippet, ["Paris"])):
        (tmp_path / f"snippet_{name}.py").write_text(code)  # not openai.py: it would shadow the package
        out = subprocess.run([sys.executable, f"snippet_{name}.py"], capture_output=True, text=True, timeout=TIMEOUT,
                             cwd=tmp_path)
        assert out.returncode == 0, f"{name}:\n{out.stderr[-3000:]}"
        for text in promised:
            assert text in out.stdout, f"{name} printed:\n{out.stdout}"
    assert len(blocks("python")) == 2


@pytest.mark.slow
def test_the_batch_snippet_runs_a_job(tmp_path):
    from support.server import http_server

    (code,) = blocks("batch")
    example = [json.loads(line) for line in (REPO / "configs" / "batch_example.jsonl").read_text().splitlines()]
    chat = [line for line in example if line["url"] == "/v1/chat/completions"]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in chat))
    with http_server(tmp_path, f"server.batch.data_dir={tmp_path / 'data'}") as (_, url):
        (tmp_path / "snippet_batch.py").write_text(code.replace("http://127.0.0.1:8000", url))
        out = subprocess.run([sys.executable, "snippet_batch.py"], capture_output=True, text=True, timeout=TIMEOUT,
                             cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    counts, *answers = out.stdout.strip().splitlines()
    assert f"completed={len(chat)}" in counts and len(answers) == len(chat), out.stdout
    assert all(json.loads(a)["response"]["status_code"] == 200 for a in answers)


BENCH_SMALLER = {"--num-prompts": "4", "--input-len": "16", "--output-len": "8"}
"""`meshserve bench` lines run with these counts (and one request rate): the README's take minutes."""


@pytest.mark.slow
def test_the_bench_commands_run(served, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hello", "output_len": 4}\n'
                                            '{"prompt": "The capital of France is", "output_len": 6}\n')
    (tmp_path / "results").mkdir()
    for line in lines_of(blocks("bench")[0]):
        words = shlex.split(line)
        assert words[:2] == ["meshserve", "bench"], line
        for flag, value in BENCH_SMALLER.items():
            if flag in words:
                words[words.index(flag) + 1] = value
        if "--request-rate" in words:
            i = words.index("--request-rate") + 1
            while i < len(words) and not words[i].startswith("--"):
                words.pop(i)
            words.insert(i, "8")
        out = subprocess.run([sys.executable, "-m", "meshserve.launcher.cli", *words[1:]], capture_output=True,
                             text=True, timeout=TIMEOUT, cwd=tmp_path)
        assert out.returncode == 0, f"{line}\n{out.stderr[-3000:]}"
        if "--output" in words:
            result = json.loads((tmp_path / words[words.index("--output") + 1]).read_text())
            assert result and "wrote" in out.stderr
    assert httpx.get("http://127.0.0.1:8000/health", timeout=30).status_code == 200
