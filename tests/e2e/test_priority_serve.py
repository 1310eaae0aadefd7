"""Priority scheduling through a real `meshserve serve` (scheduler.policy=priority): the
`priority` field of chat, completions and responses and the ZMQ client's `priority=`, answered as
without priorities; metrics by priority; a priority out of range is a 400 naming it. (The
order of service is tested on the engine: tests/unit/test_priority.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest

from meshserve.client import Client
from support.server import http_server, openai_client

MODEL = "smollm2-135m-instruct"


def test_priorities_over_http_and_zmq_with_metrics(tmp_path):
    with http_server(tmp_path, "scheduler.policy=priority", "scheduler.max_num_seqs=2", "cache.memory=32MiB",
                     "model.max_model_len=512") as (proc, url), openai_client(url, 120) as oai:
        kw = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        plain = oai.completions.create(prompt="Once upon a time", **kw).choices[0].text
        urgent = oai.completions.create(prompt="Once upon a time", **kw | {"extra_body": {
            "ignore_eos": True, "priority": -3}}).choices[0].text
        assert urgent == plain
        chat = oai.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw | {"extra_body": {
            "priority": 7}})
        assert chat.usage.completion_tokens <= 4
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body={"priority": 7})
        zmq = next(line for line in proc.stdout if "ready" in line).split("zmq=")[1].split()[0]
        with Client(zmq, timeout=60) as client:
            assert client.generate("Once upon a time", max_tokens=4, temperature=0, ignore_eos=True,
                                   priority=-3).text == plain
        with pytest.raises(openai.BadRequestError, match="priority"):
            oai.completions.create(prompt="x", **kw | {"extra_body": {"priority": 1 << 40}})
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'meshserve_priority_requests_total{priority="-3"} 2.0' in metrics
        assert 'meshserve_priority_requests_total{priority="7"} 2.0' in metrics
        assert 'meshserve_priority_time_to_first_token_seconds_count{priority="0"} 1.0' in metrics
