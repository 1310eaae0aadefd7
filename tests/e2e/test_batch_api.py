"""OpenAI's Batch API through a real `meshserve serve` with server.batch.data_dir and the real
`openai` client: files.create -> batches.create -> batches.retrieve -> files.content, each
answer what the same request gets online (greedy); bad lines fail the job before anything
runs and bad requests land in the error file; another API key sees none of it; cancel; and
a server killed mid-job and started again on the same directory finishes the job with
every request answered exactly once. `meshserve run-batch` answers a file offline over two pipeline stages as
transformers does."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from support.reference import hf_greedy
from support.server import EXACT, http_server, openai_client

MODEL = "smollm2-135m-instruct"
SETTINGS = ("model.max_model_len=512", "cache.memory=32MiB")


def lines(requests: list[tuple[str, str, dict]]) -> bytes:
    return b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode() + b"\n"
                    for cid, url, body in requests)


def chat_body(i: int, max_tokens: int = 6) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": max_tokens,
            "temperature": 0}


def wait_for(oai, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"), timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout} s")


def results(oai, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    out = {}
    for line in oai.files.content(file_id).text.splitlines():
        item = json.loads(line)
        assert item["custom_id"] not in out, f"{item['custom_id']} answered twice"
        out[item["custom_id"]] = item
    return out


def test_a_batch_round_trip_matches_online_answers(tmp_path):
    with http_server(tmp_path, *SETTINGS, f"server.batch.data_dir={tmp_path / 'data'}") as (_, url), \
            openai_client(url, 120) as oai, openai_client(url, 120, api_key="someone-else") as other:
        requests = [(f"chat-{i}", "/v1/chat/completions", chat_body(i)) for i in range(5)]
        requests.append(("bad-model", "/v1/chat/completions", chat_body(9) | {"model": "nope"}))
        upload = oai.files.create(file=("in.jsonl", io.BytesIO(lines(requests))), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(lines(requests))
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                   completion_window="24h", metadata={"job": "test"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
        done = wait_for(oai, batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
        answers = results(oai, done.output_file_id)
        assert set(answers) == {f"chat-{i}" for i in range(5)}
        for cid, url_, body in requests[:5]:
            online = oai.chat.completions.create(**body).choices[0].message.content
            got = answers[cid]["response"]
            assert got["status_code"] == 200 and got["body"]["choices"][0]["message"]["content"] == online
        failed = results(oai, done.error_file_id)["bad-model"]["response"]
        assert failed["status_code"] == 404 and "nope" in failed["body"]["error"]["message"]

        # another API key sees none of it
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(done.output_file_id)
        assert batch.id not in [b.id for b in other.batches.list()]
        assert batch.id in [b.id for b in oai.batches.list()]
        assert {upload.id, done.output_file_id} <= {f.id for f in oai.files.list()}

        # an input with a bad line fails whole, before any request runs
        broken = oai.files.create(file=("bad.jsonl", io.BytesIO(lines(requests[:2]) + b'{"custom_id": "x"}\n')),
                                  purpose="batch")
        failed_job = wait_for(oai, oai.batches.create(input_file_id=broken.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)
        assert failed_job.status == "failed" and failed_job.errors.data[0].line == 3, failed_job
        assert failed_job.request_counts.completed == 0 and failed_job.output_file_id is None
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            oai.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            other.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

        # cancel: what ran is kept, what is queued or running is dropped
        many = oai.files.create(file=("many.jsonl", io.BytesIO(lines(
            [(f"c-{i}", "/v1/chat/completions", chat_body(i, 32)) for i in range(200)]))), purpose="batch")
        job = oai.batches.create(input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(oai, job.id, ("in_progress",))
        assert oai.batches.cancel(job.id).status in ("cancelling", "cancelled")
        cancelled = wait_for(oai, job.id)
        assert cancelled.status == "cancelled" and cancelled.request_counts.completed < 200
        assert len(results(oai, cancelled.output_file_id)) == cancelled.request_counts.completed

        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'meshserve_batch_requests_answered{outcome="failed"} 1.0' in metrics


def test_a_server_killed_mid_batch_finishes_it_after_a_restart_answering_each_request_once(tmp_path):
    data = tmp_path / "data"
    requests = [(f"r{i}", "/v1/completions", {"model": MODEL, "prompt": f"Number {i}:", "max_tokens": 16,
                                              "temperature": 0, "ignore_eos": True}) for i in range(48)]
    settings = (*SETTINGS, f"server.batch.data_dir={data}", "server.batch.max_in_flight=4")
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
    with http_server(tmp_path / "first", *settings) as (proc, url), openai_client(url, 120) as oai:
        upload = oai.files.create(file=("in.jsonl", io.BytesIO(lines(requests))), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 300
        while oai.batches.retrieve(batch.id).request_counts.completed < 8:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.kill()  # SIGKILL: requests in flight are lost with the process
    journal = (data / "batches" / f"{batch.id}.output.jsonl").read_bytes()
    before = {json.loads(line)["custom_id"] for line in journal.splitlines()}
    assert 8 <= len(before) < 48
    with http_server(tmp_path / "second", *settings) as (_, url), openai_client(url, 120) as oai:
        done = wait_for(oai, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 48, done
        answers = results(oai, done.output_file_id)  # asserts no custom_id twice
        assert set(answers) == {cid for cid, _, _ in requests}
        for cid, _, body in requests[:3] + requests[-3:]:
            online = oai.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                            extra_body={"ignore_eos": True}).choices[0].text
            assert answers[cid]["response"]["body"]["choices"][0]["text"] == online


def test_run_batch_answers_a_file_offline_over_two_pipeline_stages_as_transformers(tmp_path, smollm2_reference):
    prompts = [[1, 504, 3458, 28, 253], [1, 18, 1392, 314, 253, 3401], [1, 357]]
    requests = [(f"p{i}", "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                              "return_token_ids": True}) for i, ids in enumerate(prompts)]
    requests.append(("chat", "/v1/chat/completions", chat_body(3)))
    requests.append(("too-long", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 6}))
    (tmp_path / "in.jsonl").write_bytes(lines(requests))
    out = subprocess.run([sys.executable, "-m", "meshserve.launcher.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"),
                          "-o", str(tmp_path / "out.jsonl"), "--set", EXACT, "--set", "parallel.pipeline=2",
                          "--set", "cache.memory=32MiB", "--set", "model.max_model_len=512"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    answers = {}
    for line in (tmp_path / "out.jsonl").read_text().splitlines():
        item = json.loads(line)
        assert item["custom_id"] not in answers
        answers[item["custom_id"]] = item["response"]
    assert set(answers) == {cid for cid, _, _ in requests}
    for i, ids in enumerate(prompts):
        assert answers[f"p{i}"]["body"]["choices"][0]["token_ids"] == hf_greedy(smollm2_reference, ids, 8)
    assert answers["chat"]["status_code"] == 200 and answers["chat"]["body"]["choices"][0]["message"]["content"]
    assert answers["too-long"]["status_code"] == 400
    assert "4 completed, 1 failed" in out.stderr
