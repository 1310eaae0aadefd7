"""LoRA adapters served by one engine (engine/lora, layers/lora.py): rows of several adapters
and of none in one batch, each given the greedy tokens of transformers with its adapter
merged (PEFT's merge_and_unload); the prefix cache never shares blocks across adapters;
lora.max_loras slots in rotation; adapters loaded and unloaded between requests."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.configs.adapters import AdapterError
from meshserve.engine.admission import RequestError
from support.engines import make_engine
from support.lora import PROMPTS, adapter_settings

TOKENS = 8
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


def run(engine, requests, cached=None):
    """requests: [(adapter or None, prompt)] -> each one's output tokens, all in one batch.
    `cached`: a list that gets each request's prompt tokens found in the prefix cache."""
    out = {i: [] for i in range(len(requests))}
    hits = {}
    for i, (name, prompt) in enumerate(requests):
        engine.add_request(i, str(i), prompt, GREEDY, lora=name)
    while engine.has_work():
        for key, delta in engine.step():
            out[key].extend(delta.token_ids)
            if delta.usage is not None:
                hits[key] = delta.usage.cached_tokens
    if cached is not None:
        cached += [hits[i] for i in range(len(requests))]
    return [out[i] for i in range(len(requests))]


def test_four_adapters_and_the_base_in_one_batch_each_match_transformers_merged(tiny_checkpoints, lora_adapters,
                                                                                lora_expected):
    engine = make_engine(tiny_checkpoints["llama-6h"], *adapter_settings(lora_adapters))
    requests = [(name, prompt) for prompt in PROMPTS for name in [None, *lora_adapters]]
    first = run(engine, requests)
    for (name, prompt), tokens in zip(requests, first):
        assert tokens == lora_expected(name, prompt), f"adapter {name}, prompt {prompt[:3]}..."
    assert len({tuple(t) for t in first[:5]}) == 5, "the adapters should change the output"
    # again: the first prompt's blocks are cached now, each under its own adapter
    cached = []
    assert run(engine, requests, cached) == first
    assert all(n >= 16 for n in cached[:5]), cached


def test_two_slots_serve_four_adapters_in_rotation(tiny_checkpoints, lora_adapters, lora_expected):
    engine = make_engine(tiny_checkpoints["llama-6h"], *adapter_settings(lora_adapters, max_loras=2),
                         "scheduler.max_num_seqs=3")
    names = list(lora_adapters)
    requests = [(names[i % 4], PROMPTS[i % 2]) for i in range(10)] + [(None, PROMPTS[0])]
    for (name, prompt), tokens in zip(requests, run(engine, requests)):
        assert tokens == lora_expected(name, prompt), f"adapter {name}"
    slots = engine.loras.slots
    assert slots.evictions >= 2 and len(slots.resident) == 2 and not slots.users
    # the memory plan counted the slots the ranks hold
    assert engine.memory.lora_bytes == engine.executor.runner.adapters.num_bytes > 0


def test_adapters_load_and_unload_between_requests(tiny_checkpoints, lora_adapters, lora_expected):
    engine = make_engine(tiny_checkpoints["llama-6h"], *adapter_settings(lora_adapters, names=["a0"], max_loras=2))
    with pytest.raises(RequestError, match="no LoRA adapter named 'a1'"):
        engine.add_request(0, "0", PROMPTS[0], GREEDY, lora="a1")
    engine.load_lora("a1", str(lora_adapters["a1"]))
    assert run(engine, [("a1", PROMPTS[0]), ("a0", PROMPTS[1])]) == [lora_expected("a1", PROMPTS[0]),
                                                                   lora_expected("a0", PROMPTS[1])]
    # the name now stands for another adapter: neither its old weights nor its cached blocks serve it
    engine.unload_lora("a1")
    engine.load_lora("a1", str(lora_adapters["a3"]))
    assert run(engine, [("a1", PROMPTS[0])]) == [lora_expected("a3", PROMPTS[0])]
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_lora("a0", str(lora_adapters["a2"]))
    with pytest.raises(AdapterError, match="no LoRA adapter named 'zz'"):
        engine.unload_lora("zz")


def test_an_adapter_unloaded_while_its_request_runs_finishes_it(tiny_checkpoints, lora_adapters, lora_expected):
    engine = make_engine(tiny_checkpoints["llama-6h"], *adapter_settings(lora_adapters, names=["a0", "a2"]))
    engine.add_request(0, "0", PROMPTS[0], GREEDY, lora="a2")
    out = []
    for _ in range(3):
        out += [t for _, d in engine.step() for t in d.token_ids]
    engine.unload_lora("a2")
    with pytest.raises(RequestError, match="no LoRA adapter named 'a2'"):
        engine.add_request(1, "1", PROMPTS[0], GREEDY, lora="a2")
    while engine.has_work():
        out += [t for _, d in engine.step() for t in d.token_ids]
    assert out == lora_expected("a2", PROMPTS[0])
    assert not engine.loras.slots.resident, "the unloaded adapter's slot is free once its request ends"


@pytest.mark.slow
def test_smollm2_with_two_adapters_and_the_base_in_one_batch_matches_transformers_merged(smollm2, tmp_path):
    from support.checkpoints import smollm2_tokenizer
    from support.lora import base_model, make_adapter, merged_model
    from support.reference import hf_greedy

    base = base_model(smollm2)
    adapters = {"wide": make_adapter(smollm2, tmp_path / "wide", rank=8, alpha=16.0, seed=5, std=0.05, model=base),
                "attn": make_adapter(smollm2, tmp_path / "attn", rank=4, alpha=4.0, seed=6, std=0.1, model=base,
                                     targets=["q_proj", "k_proj", "v_proj", "o_proj"])}
    tok = smollm2_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    want = {None: hf_greedy(base, prompt, TOKENS),
            **{n: hf_greedy(merged_model(smollm2, p, model=base), prompt, TOKENS) for n, p in adapters.items()}}
    assert len({tuple(t) for t in want.values()}) == 3, "each adapter should change SmolLM2's answer"
    engine = make_engine(smollm2, *adapter_settings(adapters, max_loras=2))
    requests = [(n, prompt) for n in [None, "wide", "attn"]]
    assert run(engine, requests) == [want[n] for n, _ in requests]


def test_adapters_with_speculative_decoding_and_a_constraint_match_the_merged_checkpoint(tiny_checkpoints,
                                                                                          lora_adapters,
                                                                                          lora_expected, tmp_path):
    """n-gram drafts verified with each row's adapter, and a choice constraint on an adapter's
    row: the tokens of meshserve serving the checkpoint with that adapter merged."""
    from meshserve.comm.messages import StructuredOutputs
    from meshserve.engine.structured import GrammarCompiler, spec_from_message
    from support.checkpoints import save_tokenizer
    from support.lora import merged_model

    base = tiny_checkpoints["llama-6h"]
    spec = ("speculative.method=ngram", "speculative.num_speculative_tokens=4", "speculative.adaptive=false",
            "speculative.prompt_lookup_min=1")
    engine = make_engine(base, *adapter_settings(lora_adapters, ["a0", "a2"]), *spec)
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    choice = compiler.compile(spec_from_message(StructuredOutputs(choice=["red apple", "green pear", "blue sky"])))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # a prompt, the adapter's answer to it and the prompt again: the answer is likely again,
    # and the n-gram proposer proposes it
    again = {n: PROMPTS[1] + lora_expected(n, PROMPTS[1]) + PROMPTS[1] for n in ("a0", "a2")}
    requests = [("a0", again["a0"], None), ("a2", again["a2"], None), ("a2", PROMPTS[1], choice),
                (None, again["a0"], None)]

    def tokens(eng, reqs):
        out = {i: [] for i in range(len(reqs))}
        for i, (name, prompt, grammar) in enumerate(reqs):
            eng.add_request(i, str(i), prompt, params, grammar=grammar, lora=name)
        while eng.has_work():
            for key, delta in eng.step():
                out[key] += delta.token_ids
        return [out[i] for i in range(len(reqs))]

    got = tokens(engine, requests)
    assert engine.speculator.stats.num_draft_tokens > 0  # rows of drafts verified with their adapter
    for name in ("a0", "a2"):
        merged = tmp_path / name
        merged_model(base, lora_adapters[name]).save_pretrained(str(merged))
        save_tokenizer(merged)
        oracle = make_engine(merged, *spec)
        mine = [(None, p, compiler.compile(choice.spec) if g else None) for n, p, g in requests if n == name]
        assert [t for (n, _, _), t in zip(requests, got) if n == name] == tokens(oracle, mine), name


def test_lora_config_mistakes_fail_before_any_rank_starts(tiny_checkpoints, lora_adapters, tmp_path):
    from meshserve.configs import ConfigError, load_config
    from meshserve.configs.validate import check_config
    from meshserve.launcher.flags import lora_modules

    def check(path, *sets):
        check_config(load_config(None, [f"model.path={path}", *sets]))

    base = tiny_checkpoints["llama-6h"]
    with pytest.raises(ConfigError, match=r"LoRA adapter 'a0' has rank 8; this server takes ranks 1\.\.4 "):
        check(base, *adapter_settings(lora_adapters, ["a0"], max_rank=4))
    with pytest.raises(ConfigError, match="missing"):
        check(base, f"lora.adapters={{x: {tmp_path}}}")
    with pytest.raises(ConfigError, match="disaggregated prefill/decode"):
        check(base, *adapter_settings(lora_adapters, ["a1"]), "parallel.data=2", "disaggregation.prefill_replicas=1")
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        check(tiny_checkpoints["qwen3-moe"], "lora.enabled=true")
    # another model's adapter: a shape that does not match, with the numbers
    with pytest.raises(ConfigError, match=r"layer 0 down_proj has A \(8, 192\) and B \(96, 8\); this model needs "
                                          r"A \(8, 160\) and "
                                          r"B \(64, 8\)"):
        check(tiny_checkpoints["llama"], *adapter_settings(lora_adapters, ["a2"]))
    with pytest.raises(ConfigError, match=r"'a0' carries embed_tokens weights of shape \(\d+, 96\); this model's are "
                                          r"\(\d+, 64\)"):
        check(tiny_checkpoints["llama"], *adapter_settings(lora_adapters, ["a0"]))
    assert lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        lora_modules(["nopath"])


def test_prompt_logprobs_read_each_rows_adapter_on_the_embedding_and_the_head(tiny_checkpoints, lora_adapters):
    """The rows prompt logprobs read go through the LM head's adapter of their own request
    (a3's), beside requests of the embedding's adapter (a0) and of none, in one batch."""
    import torch

    from support.lora import merged_model
    from support.reference import hf_logits, hf_model

    base = tiny_checkpoints["llama-6h"]
    engine = make_engine(base, *adapter_settings(lora_adapters))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    names = ["a3", None, "a0"]
    for i, name in enumerate(names):
        engine.add_request(i, str(i), PROMPTS[0], params, lora=name)
    got = {}
    while engine.has_work():
        for key, delta in engine.step():
            if delta.prompt_logprobs is not None:
                got[key] = delta.prompt_logprobs
    for i, name in enumerate(names):
        model = hf_model(base) if name is None else merged_model(base, lora_adapters[name])
        want = torch.log_softmax(hf_logits(model, PROMPTS[0]), dim=-1)
        for pos in range(1, len(PROMPTS[0])):
            assert got[i][pos].logprob == pytest.approx(float(want[pos - 1, PROMPTS[0][pos]]), abs=2e-3), (name, pos)
