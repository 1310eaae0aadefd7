"""Data-parallel replicas behind one front door (`meshserve serve` with parallel.data=2):

- SmolLM2 at dp=2: greedy tokens equal transformers', requests spread over both replicas,
  a conversation's second turn goes to the replica holding its first (and reuses its
  cache), /health and /metrics speak for both replicas;
- SmolLM2 at dp=2, 16 greedy and seeded streams in flight, the rank of replica 1 SIGKILLed:
  every stream completes with the tokens and text of the undisturbed run (its streams move
  to replica 0 with their output), replica 1 is started again and serves within 60 s, and
  nothing of the killed one is left behind;
- dp=2 with tp=2 inside each replica, no migration and no restarts, a rank of one replica
  SIGKILLed under load: the other replica's requests all complete, the dead replica's
  streams get `unavailable` within the failure timeout, new requests are served, /health
  says degraded (200), the dead replica leaves no process behind, and SIGTERM then stops
  the rest cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from meshserve.client import Client, MeshserveError
from support.reference import hf_greedy
from support.deployments import chat_ids, generate_concurrently, replica_process, replica_rank_pids, samples, serve
from support.server import alive

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello."]
FAILURE_TIMEOUT = 4.0
STREAM_TOKENS = 480  # with the 20-token prompts, near the tiny models' 512 positions: the streams outlast the kill


@pytest.mark.slow
def test_two_replicas_serve_transformers_tokens_and_keep_a_conversation_on_its_replica(tmp_path, smollm2_reference):
    from support.checkpoints import smollm2_tokenizer

    tok = smollm2_tokenizer()
    server, address, url = serve(tmp_path, "dp2", "parallel.data=2")
    try:
        log = server.tail(1 << 20)
        assert "replicas=2" in server.wait_ready()
        for r in (0, 1):  # each replica on a core of its own, one thread
            assert re.search(rf"replica {r} \| .*rank 0: 1 intra-op thread, cores {r}\b", log), log[-3000:]
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        prompts = [chat_ids(tok, c) for c in chats]
        results = generate_concurrently(address, prompts, 12)
        for i, prompt in enumerate(prompts):
            want = hf_greedy(smollm2_reference, prompt, 12)
            cut = want.index(2) + 1 if 2 in want else len(want)
            assert results[i] == want[:cut], QUESTIONS[i]

        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = api.models.list().data[0].id
        history = [{"role": "user", "content": "Write one sentence about the sea."}]
        first = api.chat.completions.create(model=model, messages=history, max_tokens=24, temperature=0)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Now one about mountains."}]
        second = api.chat.completions.create(model=model, messages=history, max_tokens=12, temperature=0)
        want = hf_greedy(smollm2_reference, chat_ids(tok, history), 12)
        cut = want.index(2) if 2 in want else len(want)
        assert second.choices[0].message.content == tok.decode(want[:cut], skip_special_tokens=True)
        assert second.usage.prompt_tokens_details.cached_tokens >= 16  # its first turn's blocks, on that replica

        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        routed = samples(metrics, "meshserve_router_requests_total")
        by_replica = {r: sum(v for k, v in routed.items() if f'replica="{r}"' in k) for r in "01"}
        assert by_replica["0"] >= 1 and by_replica["1"] >= 1 and sum(by_replica.values()) == len(prompts) + 2, routed
        assert sum(v for k, v in routed.items() if 'reason="history"' in k) == 1, routed
        up = samples(metrics, "meshserve_replica_up")
        assert up == {('replica="0"',): 1.0, ('replica="1"',): 1.0}, up
        # the replicas' own metrics, labelled
        tokens = samples(metrics, "meshserve_generation_tokens_total")
        assert {k for k in tokens if any('replica="' in label for label in k)}, metrics[:3000]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "replicas": {"total": 2, "serving": 2, "down": [], "restarts": 0, "each": [
            {"replica": 0, "state": "serving", "restarts": 0}, {"replica": 1, "state": "serving", "restarts": 0}]}}
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
    finally:
        server.kill()


def _stream(address: str, prompt: list[int], started: threading.Event, outcome: dict) -> None:
    with Client(address, timeout=120) as client:
        try:
            n = 0
            for delta in client.generate(prompt, stream=True, max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0):
                n += len(delta.token_ids)
                started.set()
            outcome["tokens"] = n
        except MeshserveError as e:
            outcome["error"] = (e.code, str(e), time.monotonic())


HEAL_QUESTIONS = ["Tell me about the moon.", "Describe a forest.", "What do cats eat?", "Explain rain.",
                  "Why is the sky blue?", "Describe a city at night.", "What is a river?", "Tell me about bread.",
                  "How do birds fly?", "What is music?", "Describe winter.", "Explain how a bicycle works.",
                  "What is a library?", "Tell me about the ocean.", "What are stars?", "Describe a garden."]
HEAL_TOKENS = 72


VIAS = ["zmq", "zmq", "http", "zmq-whole", "zmq", "http-whole", "zmq", "http"]
"""How each request of the healing test is sent (in turn): a ZMQ stream, a whole ZMQ
request, an OpenAI client stream or a whole OpenAI request."""


def _streams(address: str, url: str, prompts: list[list[int]], params: list[dict],
             progress: list[threading.Event] | None = None, min_tokens: int = 0) -> list[dict]:
    """Every prompt at once, each by VIAS[i % len(VIAS)] (a client each): per request its
    tokens (over ZMQ), its text and the time of each delta, or its error. progress[i] is set
    once stream i has `min_tokens` (at once for a whole request)."""
    outcomes = [{"tokens": [], "text": "", "times": []} for _ in prompts]

    def one(i: int) -> None:
        out, via = outcomes[i], VIAS[i % len(VIAS)]
        p = dict(params[i])
        if progress is not None and via.endswith("whole"):
            progress[i].set()
        try:
            if via.startswith("http"):
                api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=180, max_retries=0)
                p["extra_body"] = {k: p.pop(k) for k in ("ignore_eos", "top_p") if k in p}
                reply = api.completions.create(model=api.models.list().data[0].id, prompt=prompts[i],
                                               stream=via == "http", **p)
                for chunk in ([reply] if via == "http-whole" else reply):
                    out["text"] += chunk.choices[0].text if chunk.choices else ""
                    out["times"].append(time.monotonic())
                    if progress is not None and len(out["times"]) >= min_tokens:
                        progress[i].set()
                return
            with Client(address, timeout=180) as client:
                if via == "zmq-whole":
                    done = client.generate(prompts[i], **p)
                    out["tokens"], out["text"] = done.token_ids, done.text
                    out["times"].append(time.monotonic())
                    return
                for delta in client.generate(prompts[i], stream=True, **p):
                    out["tokens"] += delta.token_ids
                    out["text"] += delta.text
                    out["times"].append(time.monotonic())
                    if progress is not None and len(out["tokens"]) >= min_tokens:
                        progress[i].set()
        except (MeshserveError, openai.APIError) as e:
            out["error"] = str(e)
            if progress is not None:
                progress[i].set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return outcomes


def _shm_files(pids=()) -> set[str]:
    """meshserve's shared-memory segments, and OpenMP's registration files of `pids`."""
    names = {p.name for p in Path("/dev/shm").glob("meshserve-*")}
    return names | {p.name for pid in pids for p in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*")}


@pytest.mark.slow
def test_a_killed_replicas_streams_move_with_their_tokens_and_it_serves_again(tmp_path, smollm2):
    """dp=2, 16 requests (greedy and seeded; streamed and whole, over ZMQ and the OpenAI API)
    in flight, the rank of replica 1 SIGKILLed: every request completes with the tokens and
    text of the undisturbed run, the replica is started again and serves within 60 s, and
    nothing of it is left behind."""
    from support.checkpoints import smollm2_tokenizer

    shm_before = _shm_files()
    server, address, url = serve(tmp_path, "dp2-heal", "parallel.data=2", "router.restart_backoff=0.5",
                                  f"cluster.failure_timeout={FAILURE_TIMEOUT}", "cluster.heartbeat_interval=0.5")
    try:
        tok = smollm2_tokenizer()
        prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in HEAL_QUESTIONS]
        params = [dict(max_tokens=HEAL_TOKENS, ignore_eos=True, temperature=0) if i % 2 == 0 else
                  dict(max_tokens=HEAL_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.95, seed=100 + i)
                  for i in range(len(prompts))]
        want = _streams(address, url, prompts, params)
        assert all("error" not in w and w["text"] for w in want), want

        assert not replica_rank_pids(server)  # one rank each: the replica's process is its rank
        rank = replica_process(server, 1)
        replica1 = [rank]
        progress = [threading.Event() for _ in prompts]
        killed = {}

        def kill_when_all_streamed() -> None:
            assert all(p.wait(120) for p in progress), "not every stream started"
            killed["at"] = time.monotonic()
            os.kill(rank, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_all_streamed, daemon=True)
        killer.start()
        got = _streams(address, url, prompts, params, progress, min_tokens=8)
        killer.join(5)
        assert "at" in killed
        for i, (g, w) in enumerate(zip(got, want)):
            assert "error" not in g, (i, g["error"])
            assert (g["tokens"], g["text"]) == (w["tokens"], w["text"]), (i, HEAL_QUESTIONS[i])
        after_kill = [g for g in got if g["times"][-1] > killed["at"]]
        assert after_kill, "every stream ended before the kill"

        while (health := httpx.get(f"{url}/health", timeout=5).json())["replicas"]["serving"] < 2:
            assert time.monotonic() - killed["at"] < 60, health
            time.sleep(0.2)
        assert health["status"] == "ok" and health["replicas"]["each"][1] == {"replica": 1, "state": "serving",
                                                                              "restarts": 1}, health
        assert not alive(replica1), "a process of the killed replica outlived it"
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert samples(metrics, "meshserve_replica_restarts_total") == {('replica="1"',): 1.0}, metrics[-2000:]
        moved = samples(metrics, "meshserve_router_migrations_total").get(('replica="1"',), 0)
        assert moved >= 1, metrics[-2000:]
        routed = samples(metrics, "meshserve_router_requests_total")
        before = sum(v for k, v in routed.items() if 'replica="1"' in k)
        greedy = [0, 4, 6, 8]  # over ZMQ in the runs above
        results = generate_concurrently(address, [prompts[i] for i in greedy], 6)  # the restarted one takes a share
        routed = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_router_requests_total")
        assert sum(v for k, v in routed.items() if 'replica="1"' in k) > before
        assert results == [want[i]["tokens"][:6] for i in greedy]
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
        assert _shm_files(replica1) <= shm_before, _shm_files(replica1) - shm_before
    finally:
        server.kill()


@pytest.mark.slow
def test_without_migration_or_restarts_a_killed_rank_takes_out_that_replica_only(tmp_path, tiny_checkpoints):
    server, address, url = serve(tmp_path, "dp2-kill", f"model.path={tiny_checkpoints['llama']}", "parallel.data=2",
                                  "parallel.tensor=2", "cache.memory=16MiB", "router.migration_limit=0",
                                  "router.restart_limit=0",
                                  f"cluster.failure_timeout={FAILURE_TIMEOUT}", "cluster.heartbeat_interval=0.5")
    try:
        pids = replica_rank_pids(server)
        assert set(pids) == {(0, 0), (0, 1), (1, 0), (1, 1)}, pids
        with Client(address, timeout=120) as client:  # each replica's first step, before the streams
            for i in range(2):
                client.generate([5 + i] * 8, max_tokens=2, temperature=0)
        outcomes = [{} for _ in range(6)]
        started = [threading.Event() for _ in outcomes]
        threads = [threading.Thread(target=_stream, args=(address, list(range(100 + i, 120 + i)), s, o), daemon=True)
                   for i, (s, o) in enumerate(zip(started, outcomes))]
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started), "not every stream started"
        # frozen at once, replica 1's streams cannot finish before the kill below (a slow
        # /metrics under load left that window open)
        os.kill(pids[1, 1], signal.SIGSTOP)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        # least-loaded routing counts output too: streams that start late may tip the split
        split = samples(metrics, "meshserve_replica_requests")
        on = {r: int(split.get((f'replica="{r}"',), 0)) for r in (0, 1)}
        assert on[0] >= 1 and on[1] >= 1 and on[0] + on[1] == 6, split
        killed_at = time.monotonic()
        replica1 = [pid for (r, _), pid in pids.items() if r == 1] + [replica_process(server, 1)]
        os.kill(pids[1, 1], signal.SIGKILL)
        with Client(address, timeout=120) as client:  # served meanwhile, whichever replica it meets
            late = [client.generate(list(range(200 + i, 210 + i)), max_tokens=8, temperature=0) for i in range(4)]
        assert all(len(c.token_ids) == 8 for c in late)
        for t in threads:
            t.join(FAILURE_TIMEOUT + 120)
        errors = [o["error"] for o in outcomes if "error" in o]
        done = [o["tokens"] for o in outcomes if "tokens" in o]
        assert len(errors) == on[1] and done == [STREAM_TOKENS] * on[0], outcomes
        for code, message, at in errors:
            assert code == "unavailable" and "] replica 1: " in message, message
            assert at - killed_at < FAILURE_TIMEOUT + 10, f"the error took {at - killed_at:.1f} s"
        deadline = time.monotonic() + 15
        while alive(replica1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(replica1), "a rank of the failed replica outlived it"
        while (health := httpx.get(f"{url}/health", timeout=5)).json()["status"] == "ok":
            assert time.monotonic() - killed_at < FAILURE_TIMEOUT + 10, "/health still says ok"
            time.sleep(0.2)
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["status"] == "degraded" and body["replicas"]["serving"] == 1
        assert [d["replica"] for d in body["replicas"]["down"]] == [1]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert samples(metrics, "meshserve_replica_up") == {('replica="0"',): 1.0, ('replica="1"',): 0.0}
        assert "rank 1 died first (killed by SIGKILL)" in server.tail(1 << 20)
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not alive(pids.values())
    finally:
        server.kill()


@pytest.mark.slow
def test_a_rolling_restart_under_load_loses_no_request_and_the_admin_api_adds_and_removes(tmp_path):
    """dp=2 with an admin key, `meshserve bench` at concurrency 8 over and over while `meshserve
    admin rolling-restart` restarts both replicas with a new override, one at a time: every
    request of every run completes; each replica restarted once, with the override. Then
    the admin API adds a replica (it serves), removes it, and refuses a bad override or key."""
    env = dict(os.environ, MESHSERVE_ADMIN_KEY="admin-secret")
    server, address, url = serve(tmp_path, "dp2-admin", "parallel.data=2", "server.admin_key=admin-secret")
    try:
        admin = [sys.executable, "-m", "meshserve.launcher.cli", "admin", url]
        rolling = subprocess.Popen([*admin, "rolling-restart", "--set", "scheduler.max_num_seqs=48", "--timeout", "20"],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs = []
        while rolling.poll() is None or not runs:
            out = tmp_path / f"bench{len(runs)}.json"
            subprocess.run([sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, "--num-prompts",
                            "24", "--max-concurrency", "8", "--input-len", "48", "--output-len", "24", "--seed",
                            str(len(runs)), "--output", str(out), "--no-plots", "--disable-tqdm"], check=True,
                           stdout=subprocess.DEVNULL, timeout=300)
            runs.append(json.loads(out.read_text()))
        stdout, stderr = rolling.communicate(timeout=60)
        assert rolling.returncode == 0, stderr
        assert len(runs) >= 2 and all(r["failed"] == 0 and r["completed"] == 24 for r in runs), \
            [(r["completed"], r["failed"], r.get("errors", [])[:3]) for r in runs]
        replicas = json.loads(stdout)
        assert [(r["replica"], r["state"], r["restarts"]) for r in replicas] == [(0, "serving", 1), (1, "serving", 1)]
        for r in (0, 1):  # started again with the override
            assert b"scheduler.max_num_seqs=48" in Path(f"/proc/{replica_process(server, r)}/cmdline").read_bytes()
        log = server.tail(1 << 20)
        assert "replica 0: starting" not in log  # restarted by the admin API, not healed
        for r in (0, 1):
            assert re.search(rf"replica {r}: drained \(\d+ requests moved\); restarting it", log), log[-3000:]

        def call(*args, key="admin-secret"):
            return subprocess.run([*admin, *args], env=dict(env, MESHSERVE_ADMIN_KEY=key), capture_output=True,
                                  text=True, timeout=300)

        bad = call("add", "--set", "model.max_model_len=abc")
        assert bad.returncode == 1 and "model.max_model_len" in bad.stderr, bad.stderr
        assert "401" in call("list", key="wrong").stderr
        added = call("add")
        assert added.returncode == 0 and json.loads(added.stdout) == {"replica": 2, "state": "starting"}, added.stderr
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{url}/health", timeout=5).json())["replicas"]["serving"] < 3:
            assert time.monotonic() < deadline, health
            time.sleep(0.3)
        before = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_router_requests_total")
        generate_concurrently(address, [[7 + i] * 12 for i in range(6)], 4)
        routed = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_router_requests_total")
        assert sum(v - before.get(k, 0) for k, v in routed.items() if 'replica="2"' in k) >= 1, routed
        assert call("remove", "2").returncode == 0
        while (health := httpx.get(f"{url}/health", timeout=5).json())["replicas"]["total"] > 2:
            assert time.monotonic() < deadline + 60, health
            time.sleep(0.3)
        assert health["status"] == "ok" and health["replicas"]["each"][2]["state"] == "removed", health
        assert call("drain", "1").returncode == 0  # stopped by the admin API, then started again by it
        while (health := httpx.get(f"{url}/health", timeout=5).json())["replicas"]["each"][1]["state"] != "stopped":
            assert time.monotonic() < deadline + 120, health
            time.sleep(0.3)
        assert call("restart", "1").returncode == 0
        while (health := httpx.get(f"{url}/health", timeout=5).json())["replicas"]["each"][1]["state"] != "serving":
            assert time.monotonic() < deadline + 180, health
            time.sleep(0.3)
        state = samples(httpx.get(f"{url}/metrics", timeout=30).text, "meshserve_replica_state")
        assert state[('replica="2"', 'state="removed"')] == 1.0, state
        assert server.stop() == 0, server.tail()
        assert not server.group_alive() and not server.descendants()
    finally:
        server.kill()
