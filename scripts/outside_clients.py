"""Outside clients against a real `meshserve serve`, unmodified: the benchmark tools and the
framework users point at OpenAI-compatible servers, each from a virtual environment of its
own (they pin their own openai, httpx and pydantic). Per client: what it sent, how many
requests succeeded by its own count, and its own summary line. Writes
results/outside_clients.json.

    python scripts/outside_clients.py --guidellm ~/venv-guidellm --aiperf ~/venv-aiperf \\
        --langchain ~/venv-langchain --vllm ~/venv-vllm --agents ~/venv-agents [--openai ~/venv-openai] \
        --anthropic ~/venv-anthropic

Structured outputs and tool calling are checked one by one, each by the client's own
behaviour (no exception, the parsed object validates, the framework ran the tool):
- openai (--openai, else the langchain or agents venv): `chat.completions.parse` with a
  pydantic model, json_object, vLLM's structured_outputs/guided_*, tools with tool_choice
  required/named/auto/none, a streamed tool call, a `role: tool` turn, /v1/responses;
- langchain-openai (--langchain): `with_structured_output` (default, json_schema,
  function_calling, json_mode), `bind_tools` with a forced call that it executes, streamed,
  and the tool's result sent back; LangGraph's `create_react_agent` where that venv has it;
- openai-agents (--agents): an agent that must call a tool first (tool_choice="required",
  reset after the call) and then answers, plain and streamed, a structured final output,
  and the same loop over the Responses API;
- anthropic (--anthropic): an agent loop over the Messages API (/v1/messages), whole and
  streamed: a forced tool_use, the tool run, its tool_result sent back, the answer.

A client whose virtual environment is not given is skipped (and said so). The server runs the
default model; the clients that count tokens get its tokenizer as a Hugging Face directory.
The default model (135M) rarely calls a tool unasked, so the tool checks force the first call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.model_info import resolve_model_path
from meshserve.engine.tokenizer import load_tokenizer

from bench_http import Served, free_port

REPO = Path(__file__).resolve().parent.parent
CHECKS_DIR = Path(__file__).resolve().parent / "client_checks"
"""The structured-output and tool-calling checks each client runs, one file per client."""
MODEL = "smollm2-135m-instruct"
TIMEOUT = 900


def run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def tail(text: str, n: int = 1500) -> str:
    return text[-n:]


def guidellm(venv: Path, url: str, tokenizer: Path, requests: int, work: Path) -> dict:
    out = work / "guidellm.json"
    cmd = [str(venv / "bin" / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
           "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    p = run(cmd, work)
    report = json.loads(out.read_text()) if out.exists() else None
    ok = errors = None
    if report is not None:
        totals = report["benchmarks"][0]["metrics"]["request_totals"]
        ok, errors = totals["successful"], totals["errored"]
    return {"cmd": cmd, "exit_code": p.returncode, "sent": requests, "succeeded": ok, "errored": errors,
            "output": tail(p.stdout + p.stderr)}


def aiperf(venv: Path, url: str, tokenizer: Path, requests: int, work: Path) -> dict:
    artifacts = work / "aiperf"
    cmd = [str(venv / "bin" / "aiperf"), "profile", "--model", MODEL, "--url", url, "--endpoint-type", "chat",
           "--streaming", "--request-count", str(requests), "--concurrency", "2", "--tokenizer", str(tokenizer),
           "--synthetic-input-tokens-mean", "64", "--output-tokens-mean", "16", "--artifact-dir", str(artifacts),
           "--ui", "none"]
    p = run(cmd, work)
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    ok = errors = None
    if exports:
        report = json.loads(exports[0].read_text())
        ok = report.get("request_count", {}).get("avg")
        errors = report.get("error_request_count", {}).get("avg", 0)
    return {"cmd": cmd, "exit_code": p.returncode, "sent": requests, "succeeded": ok, "errored": errors,
            "output": tail(p.stdout + p.stderr)}


def vllm_bench(venv: Path, cli: Path, url: str, tokenizer: Path, requests: int, work: Path) -> dict:
    cmd = [str(venv / "bin" / "python"), str(cli), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
           "--num-prompts", str(requests), "--max-concurrency", "2", "--save-result", "--result-dir", str(work),
           "--result-filename", "vllm_bench.json"]
    p = run(cmd, work)
    out = work / "vllm_bench.json"
    report = json.loads(out.read_text()) if out.exists() else {}
    ok = report.get("completed")
    return {"cmd": cmd, "exit_code": p.returncode, "sent": requests, "succeeded": ok,
            "errored": None if ok is None else requests - ok, "output": tail(p.stdout + p.stderr)}


LANGCHAIN = textwrap.dedent('''
    import json, sys
    from langchain_openai import ChatOpenAI, OpenAI
    url, n = sys.argv[1], int(sys.argv[2])
    chat = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="{model}", max_tokens=16, temperature=0)
    ok = 0
    for i in range(n - 2):
        ok += bool(chat.invoke(f"What is {{i}} + {{i}}?").content)
    ok += bool("".join(c.content for c in chat.stream("Name a color.")))
    ok += bool(OpenAI(base_url=url + "/v1", api_key="unused", model="{model}", max_tokens=8).invoke("Once upon"))
    print(json.dumps({{"succeeded": ok}}))
''').format(model=MODEL)


def last_json(stdout: str) -> dict:
    """The client script's report: the last line of its stdout, if that is a JSON object."""
    lines = stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def langchain(venv: Path, url: str, requests: int, work: Path) -> dict:
    script = work / "langchain_client.py"
    script.write_text(LANGCHAIN)
    cmd = [str(venv / "bin" / "python"), str(script), url, str(requests)]
    p = run(cmd, work)
    ok = last_json(p.stdout).get("succeeded")
    return {"cmd": cmd, "exit_code": p.returncode, "sent": requests, "succeeded": ok,
            "errored": None if ok is None else requests - ok, "output": tail(p.stdout + p.stderr)}


def checks(name: str, venv: Path, url: str, work: Path) -> dict:
    """Runs one client's checks (client_checks/<name>_checks.py, with client_checks/common.py
    beside it) with `venv`'s python; per check, what it sent and whether the client got what it
    asked for."""
    for source in (CHECKS_DIR / "common.py", CHECKS_DIR / f"{name}_checks.py"):
        shutil.copy(source, work / source.name)
    cmd = [str(venv / "bin" / "python"), str(work / f"{name}_checks.py"), url, MODEL]
    p = run(cmd, work)
    report = last_json(p.stdout)
    results = report.get("checks")
    ok = None if results is None else sum(r["ok"] for r in results.values())
    return {"cmd": cmd, "exit_code": p.returncode, "versions": report.get("versions"),
            "sent": None if results is None else len(results), "succeeded": ok,
            "errored": None if ok is None else len(results) - ok, "checks": results,
            "output": tail(p.stdout + p.stderr)}


def print_result(name: str, r: dict) -> None:
    """One line per client, then one per check for the clients that run checks."""
    if "skipped" in r:
        print(f"{name:<18} skipped: {r['skipped']}")
        return
    print(f"{name:<18} exit {r['exit_code']}: {r['succeeded']} of {r['sent']} succeeded, {r['errored']} errored")
    for check, c in (r.get("checks") or {}).items():
        print(f"    {'ok    ' if c['ok'] else 'FAILED'} {check}" + ("" if c["ok"] else f": {c['error'][:400]}"))
    if r.get("checks") is None and "versions" in r:
        print("    no report; the client's output ends:\n" + textwrap.indent(r["output"][-800:], "    "))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("guidellm", "aiperf", "langchain", "vllm", "agents", "openai", "anthropic"):
        ap.add_argument(f"--{name}", type=Path, default=None, metavar="VENV", help=f"the virtual environment of {name}")
    ap.add_argument("--vllm-cli", type=Path, default=Path(__file__).resolve().parent / "peers" / "vllm_cli.py",
                    help="the `vllm` command, run by the --vllm venv's python")
    ap.add_argument("--requests", type=int, default=20,
                    help="requests per benchmark client (structured-output and tool checks run once each)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "outside_clients.json")
    return ap.parse_args()


def run_clients(args: argparse.Namespace, url: str, tokenizer: Path, work: Path) -> dict[str, dict]:
    """Each client whose virtual environment was given, one after the other."""
    clients = {
        "guidellm": (args.guidellm, lambda v: guidellm(v, url, tokenizer, args.requests, work)),
        "aiperf": (args.aiperf, lambda v: aiperf(v, url, tokenizer, args.requests, work)),
        "vllm bench serve": (args.vllm, lambda v: vllm_bench(v, args.vllm_cli, url, tokenizer, args.requests, work)),
        "langchain-openai": (args.langchain, lambda v: langchain(v, url, args.requests, work)),
        # NOTE: langchain-openai and openai-agents both install openai, so either venv serves.
        "openai structured+tools": (args.openai or args.langchain or args.agents,
                                    lambda v: checks("openai", v, url, work)),
        "langchain structured+tools": (args.langchain, lambda v: checks("langchain", v, url, work)),
        "openai-agents": (args.agents, lambda v: checks("agents", v, url, work)),
        "anthropic messages": (args.anthropic, lambda v: checks("anthropic", v, url, work)),
    }
    return {name: client(venv) if venv is not None else {"skipped": "no virtual environment given"}
            for name, (venv, client) in clients.items()}


def main() -> None:
    args = parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="outside-clients-"))
    tokenizer = work / "tokenizer"
    load_tokenizer(resolve_model_path(f"builtin:{MODEL}")).save_pretrained(str(tokenizer))
    port = free_port()
    served = Served("meshserve", [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--port", str(port),
                                  "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", "--max-model-len", "2048"],
                    work / "server.log")
    try:
        results = run_clients(args, served.wait_http(f"http://127.0.0.1:{port}"), tokenizer, work)
        ignored = [line for line in served.log.read_text().splitlines() if "ignoring request fields" in line]
    finally:
        served.stop()
    report = {"cpu": cpu_features().describe(), "clients": results, "ignored_fields_logged": ignored,
              "server_log": str(served.log)}
    args.out.write_text(json.dumps(report, indent=2))
    print(report["cpu"])
    for name, r in results.items():
        print_result(name, r)
    for line in ignored:
        print("server:", line[line.index("ignoring"):])
    print(f"server log: {served.log}\nwrote {args.out}")


if __name__ == "__main__":
    main()
