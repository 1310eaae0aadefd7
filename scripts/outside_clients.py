"""Outside clients against a real `meshserve serve`, unmodified: the benchmark tools and the
framework users point at OpenAI-compatible servers, each from a virtual environment of its
own (they pin their own openai, httpx and pydantic). Per client: what it sent, how many
requests succeeded by its own count, and its own summary line. Writes
results/outside_clients.json.

    python scripts/outside_clients.py --guidellm ~/venv-guidellm --aiperf ~/venv-aiperf \\
        --langchain ~/venv-langchain --vllm ~/venv-vllm --vllm-cli ../shared/peers/vllm_cli.py

A client whose virtual environment is not given is skipped (and said so). The server runs the
default model; the clients that count tokens get its tokenizer as a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import json
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
MODEL = "smollm2-135m-instruct"
TIMEOUT = 900


def run(cmd: list[str], cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


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


def langchain(venv: Path, url: str, requests: int, work: Path) -> dict:
    script = work / "langchain_client.py"
    script.write_text(LANGCHAIN)
    cmd = [str(venv / "bin" / "python"), str(script), url, str(requests)]
    p = run(cmd, work)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
    ok = json.loads(last).get("succeeded") if last.startswith("{") else None
    return {"cmd": cmd, "exit_code": p.returncode, "sent": requests, "succeeded": ok,
            "errored": None if ok is None else requests - ok, "output": tail(p.stdout + p.stderr)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("guidellm", "aiperf", "langchain", "vllm"):
        ap.add_argument(f"--{name}", type=Path, default=None, metavar="VENV", help=f"the virtual environment of {name}")
    ap.add_argument("--vllm-cli", type=Path, default=None, help="the `vllm` command's script in that venv")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "outside_clients.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="outside-clients-"))
    tokenizer = work / "tokenizer"
    load_tokenizer(resolve_model_path(f"builtin:{MODEL}")).save_pretrained(str(tokenizer))
    port = free_port()
    served = Served("meshserve", [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--port", str(port),
                                  "--set", f"server.zmq=tcp://127.0.0.1:{free_port()}", "--max-model-len", "2048"],
                    work / "server.log")
    results: dict[str, dict] = {}
    try:
        url = served.wait_http(f"http://127.0.0.1:{port}")
        clients = {
            "guidellm": lambda v: guidellm(v, url, tokenizer, args.requests, work),
            "aiperf": lambda v: aiperf(v, url, tokenizer, args.requests, work),
            "vllm bench serve": lambda v: vllm_bench(v, args.vllm_cli, url, tokenizer, args.requests, work),
            "langchain-openai": lambda v: langchain(v, url, args.requests, work),
        }
        venvs = {"guidellm": args.guidellm, "aiperf": args.aiperf, "vllm bench serve": args.vllm,
                 "langchain-openai": args.langchain}
        for name, client in clients.items():
            venv = venvs[name]
            if venv is None or (name == "vllm bench serve" and args.vllm_cli is None):
                results[name] = {"skipped": "no virtual environment given"}
                continue
            results[name] = client(venv)
        ignored = [line for line in served.log.read_text().splitlines() if "ignoring request fields" in line]
    finally:
        served.stop()
    report = {"cpu": cpu_features().describe(), "clients": results, "ignored_fields_logged": ignored}
    args.out.write_text(json.dumps(report, indent=2))
    print(report["cpu"])
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<18} skipped: {r['skipped']}")
        else:
            print(f"{name:<18} exit {r['exit_code']}: {r['succeeded']} of {r['sent']} succeeded, "
                  f"{r['errored']} errored")
    for line in ignored:
        print("server:", line[line.index("ignoring"):])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
