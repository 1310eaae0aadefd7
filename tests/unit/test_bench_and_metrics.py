"""The arithmetic behind `meshserve bench` (SLO parsing, summary, goodput) and the Prometheus
observer's bookkeeping (latencies, token counters, MFU/MBU), on synthetic inputs with known
answers. The end-to-end checks against a real server are in tests/e2e/test_http_api.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshserve.client.bench import endpoint_url, parse_slo
from meshserve.client.bench_data import load_jsonl
from meshserve.client.bench_stats import RequestResult, summarize
from meshserve.client.bench_workloads import multi_turn, prefix_repetition
from meshserve.comm.messages import SamplingParams
from meshserve.configs.model_info import read_model_info
from meshserve.engine.serving.metrics import EngineMetrics, Roofline
from meshserve.engine.perf import ModelCost
from meshserve.engine.scheduler import ScheduledBatch
from meshserve.engine.sequence import Sequence


def test_parse_slo_both_spellings():
    assert parse_slo(["ttft=2000,tpot=100"]) == {"ttft": 2000.0, "tpot": 100.0}
    assert parse_slo(["ttft:2000", "e2el:9000"]) == {"ttft": 2000.0, "e2el": 9000.0}
    assert parse_slo([]) == {}
    for bad in ("ttfx=3", "ttft", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo([bad])


def test_endpoint_url():
    assert endpoint_url("http://h:1", "/v1/completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/", "/v1/chat/completions") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1/completions", "/v1/chat/completions") == "http://h:1/v1/completions"


def test_prefix_repetition_groups_share_their_prefix():
    prompts = prefix_repetition(np.random.default_rng(0), 10, 3, prefix_len=60, suffix_len=12, output_len=5,
                                tokens_per_word=1.5)
    prefixes = [p.prompt.split("\n")[0] for p in prompts]
    assert len(prompts) == 10 and len(set(prefixes)) == 3
    assert sorted(prefixes.count(x) for x in set(prefixes)) == [3, 3, 4]
    assert all(len(x.split()) == 40 for x in prefixes) and all(p.output_len == 5 for p in prompts)
    assert len({p.prompt for p in prompts}) == 10  # the questions differ


def test_multi_turn_resends_the_history():
    (conv,) = multi_turn(np.random.default_rng(0), 1, 3, input_len=20, output_len=4, tokens_per_word=2.0)
    first = conv.turn(0, chat=True).prompt
    assert first == [{"role": "user", "content": conv.questions[0]}] and len(conv.questions[0].split()) == 10
    conv.answered(0, "an answer")
    second = conv.turn(1, chat=True).prompt
    assert second[:2] == [first[0], {"role": "assistant", "content": "an answer"}] and len(second) == 3
    text = conv.turn(1, chat=False).prompt
    assert text == f"User: {conv.questions[0]}\nAssistant: an answer\nUser: {conv.questions[1]}\nAssistant:"


def test_summary_reports_the_hit_rate_when_the_server_does():
    ok = [RequestResult(success=True, prompt_len=100, output_len=2, ttft=0.1, latency=0.2, itl=[0.1],
                        cached_tokens=c) for c in (0, 64, 96)]
    assert summarize(ok, 1.0, {})["prefix_cache_hit_rate"] == pytest.approx(160 / 300)
    for r in ok:
        r.cached_tokens = None
    assert summarize(ok, 1.0, {})["prefix_cache_hit_rate"] is None


def _result(ttft, latency, n, itl=None, ok=True):
    return RequestResult(success=ok, prompt_len=10, output_len=n, ttft=ttft, latency=latency,
                         itl=itl if itl is not None else [(latency - ttft) / (n - 1)] * (n - 1),
                         error="" if ok else "HTTP 500")


def test_summary_counts_throughput_and_goodput():
    results = [_result(0.1, 1.1, 11), _result(0.5, 2.5, 11), _result(3.0, 4.0, 11), _result(0, 0, 0, [], ok=False)]
    res = summarize(results, duration=10.0, slo_ms={"ttft": 1000, "tpot": 150})
    assert res["completed"] == 3 and res["failed"] == 1
    assert res["total_output_tokens"] == 33 and res["total_input_tokens"] == 30
    assert res["output_throughput"] == pytest.approx(3.3) and res["request_throughput"] == pytest.approx(0.3)
    # TPOTs: 100, 200, 100 ms; TTFTs: 100, 500, 3000 ms -> only the first meets both SLOs
    assert res["request_goodput"] == pytest.approx(0.1)
    assert res["median_ttft_ms"] == pytest.approx(500) and res["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert res["p99_ttft_ms"] == pytest.approx(np.percentile([100, 500, 3000], 99))
    assert res["median_e2el_ms"] == pytest.approx(2500)
    assert res["errors"] == ["", "", "", "HTTP 500"] and len(res["itls"]) == 4
    assert summarize(results, 10.0, {})["request_goodput"] is None


def test_load_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello", "output_len": 5}\n\n{"prompt": [1, 2, 3]}\n')
    prompts = load_jsonl(f, 3, default_output_len=7)
    assert [(p.prompt, p.output_len, p.prompt_len) for p in prompts] == [("hello", 5, None), ([1, 2, 3], 7, 3),
                                                                        ("hello", 5, None)]
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=":1:"):
        load_jsonl(f, 1, 7)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_engine_metrics_follow_one_request(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("meshserve.engine.serving.metrics.time.monotonic", clock)
    m = EngineMetrics()
    info = read_model_info("builtin:smollm2-135m-instruct")
    cost = ModelCost(info, 4)
    m._cost, m._roofline = cost, Roofline(peak_flops=1e12, memory_bandwidth=1e10, source="test")
    seq = Sequence(0, "k", list(range(8)), 8, SamplingParams(max_tokens=3), arrival_time=99.0)

    def value(name, labels=None):
        return m.registry.get_sample_value(name, labels or {})

    m.on_scheduled(ScheduledBatch([seq], [8]))  # first scheduled at t=100: queued 1 s
    clock.now = 100.5
    seq.token_ids.append(1)
    m.on_token(seq)  # first token at 100.5: TTFT 1.5 s
    m.on_step(ScheduledBatch([seq], [8]), [8], 0.5)
    assert value("meshserve_model_flops_utilization") == pytest.approx(cost.flops(8, 8) / 0.5 / 1e12)
    assert value("meshserve_memory_bandwidth_utilization") == \
        pytest.approx((cost.weight_bytes + 8 * cost.kv_bytes_per_token) / 0.5 / 1e10)
    for t in (100.7, 101.1):
        clock.now = t
        seq.token_ids.append(1)
        m.on_token(seq)
    m.on_scheduled(ScheduledBatch([seq], [1]))  # scheduled again: not a second queue time
    clock.now = 101.5
    m.on_finished(SimpleNamespace(seq=seq, finish_reason="length"))
    assert value("meshserve_request_queue_time_seconds_count") == 1
    assert value("meshserve_request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert value("meshserve_time_to_first_token_seconds_sum") == pytest.approx(1.5)
    assert value("meshserve_inter_token_latency_seconds_count") == 2
    assert value("meshserve_inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value("meshserve_time_per_output_token_seconds_sum") == pytest.approx(0.3)  # (101.1 - 100.5) / 2
    assert value("meshserve_e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    assert value("meshserve_prompt_tokens_total") == 8 and value("meshserve_generation_tokens_total") == 3
    assert value("meshserve_request_success_total", {"finished_reason": "length"}) == 1
    # an aborted request counts as such, with no latency
    other = Sequence(1, "j", [1, 2], 2, SamplingParams(), arrival_time=100.0)
    m.on_scheduled(ScheduledBatch([other], [2], preempted=[seq]))
    m.on_finished(SimpleNamespace(seq=other, finish_reason="abort"))
    assert value("meshserve_request_success_total", {"finished_reason": "abort"}) == 1
    assert value("meshserve_e2e_request_latency_seconds_count") == 1
    assert value("meshserve_num_preemptions_total") == 1


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, "none"), (torch.bfloat16, "int4"),
                                                (torch.float32, "int8")])
def test_the_roofline_peak_times_the_multiply_the_config_runs(monkeypatch, dtype, quantization):
    """MFU's peak is the faster of torch.mm and the model's own multiply for the config's
    dtype and quantization (a bf16 torch.mm on a CPU without bf16 dot products runs at a
    fraction of what the model's widened products do)."""
    from meshserve.engine import perf

    calls, real = [], perf.plan_matmuls
    monkeypatch.setattr(perf, "plan_matmuls", lambda dev, d, q, lib: calls.append((dev, d, q)) or real(dev, d, q, lib))
    assert perf.measure_matmul_peak(dtype, n=64, repeats=1, quantization=quantization) > 0
    assert calls == [("cpu", dtype, quantization)]


def test_bench_sends_top_p_and_top_k_only_when_given_and_spreads_requests_over_lora_modules():
    from meshserve.client.bench import Target
    from meshserve.client.bench_data import BenchPrompt

    args = SimpleNamespace(temperature=0.7, ignore_eos=False, top_p=None, top_k=None)
    prompt = BenchPrompt("hello", 8, 4)
    body = Target("http://x/v1/completions", "m", False, args).body(prompt)
    assert body["temperature"] == 0.7 and "top_p" not in body and "top_k" not in body
    args.top_p, args.top_k = 0.9, 40
    body = Target("http://x/v1/completions", "m", False, args).body(prompt)
    assert (body["top_p"], body["top_k"]) == (0.9, 40)
    # --lora-modules: each request names one of the adapters, at random but each of them
    args.lora_modules, args.seed = ["a", "b", "c"], 3
    target = Target("http://x/v1/completions", "m", False, args)
    models = [target.body(prompt)["model"] for _ in range(60)]
    assert set(models) == {"a", "b", "c"}
    again = Target("http://x/v1/completions", "m", False, args)
    assert models == [again.body(prompt)["model"] for _ in range(60)]  # --seed fixes the choices
