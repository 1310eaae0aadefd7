"""Resumed requests (comm/messages.py Resume; engine.add_request(..., resume=)): a stream
another replica started goes on here from its output so far. The oracle is the undisturbed
run on one engine: a second engine, given the prompt and the first k tokens a client had
(and the characters of text it had), sends exactly the rest: the same tokens, text,
logprobs, finish and stop reasons, with greedy and seeded sampling, penalties and
min_tokens, stop strings held back across the cut, and a JSON-schema constraint."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import Resume, SamplingParams, StructuredOutputs
from meshserve.engine.admission import RequestError, check_resume
from meshserve.engine.structured import GrammarCompiler, spec_from_message
from support.engines import make_engine
from support.schemas import PROMPTS as SCHEMA_PROMPTS, SCHEMAS

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023))]
PARAMS = [
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.4),
    SamplingParams(max_tokens=16, temperature=1.0, min_p=0.05, seed=5, ignore_eos=True, min_tokens=12,
                   frequency_penalty=1.0, logprobs=0),
]


def run(engine, prompts, params, grammars=None, resumes=None):
    """Every request to its end, streamed: per request its deltas."""
    deltas = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(i, str(i), prompt, params[i], grammar=grammars[i] if grammars else None,
                           resume=resumes[i] if resumes else None)
    while engine.has_work():
        for i, delta in engine.step():
            deltas[i].append(delta)
    return [deltas[i] for i in range(len(prompts))]


def cut(deltas, n):
    """What a client had after its first `n` deltas, as the front door resumes it, and the rest."""
    had, rest = deltas[:n], deltas[n:]
    tokens = [t for d in had for t in d.token_ids]
    return Resume(tokens, sum(len(d.text) for d in had)), rest


def seen(deltas):
    """What a client sees: the tokens, text, logprobs' tokens, finish, stop reason and count
    (the logprobs' values apart: a resumed token's KV comes from a prefill, not a decode step)."""
    return ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
            [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs(deltas)], deltas[-1].finish_reason,
            deltas[-1].stop_reason, deltas[-1].usage.completion_tokens)


def logprobs(deltas):
    return [lp for d in deltas for lp in (d.logprobs or [])]


def assert_resumed_like_undisturbed(make, prompts, params, grammars_for=lambda: None):
    want = run(make(), prompts, params, grammars_for())
    resumes, rests = zip(*(cut(d, max(1, len(d) // 2)) for d in want))
    got = run(make(), prompts, params, grammars_for(), list(resumes))
    for i in range(len(prompts)):
        assert seen(got[i]) == seen(rests[i]), i
        assert [lp.logprob for lp in logprobs(got[i])] == pytest.approx([lp.logprob for lp in logprobs(rests[i])],
                                                                         abs=1e-4)
        assert got[i][-1].usage.prompt_tokens == len(prompts[i])
    return want


def test_resumed_streams_go_on_as_undisturbed_with_sampling_penalties_and_logprobs(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    want = assert_resumed_like_undisturbed(lambda: make_engine(path), PROMPTS, PARAMS)
    assert all(len(d) > 4 for d in want)


def test_a_stop_string_held_back_across_the_cut_and_a_constraint_go_on_with_smollm2(smollm2):
    def make():
        return make_engine(smollm2, "model.max_model_len=512")

    tok = make().tokenizer
    compiler = GrammarCompiler(tok, make().vocab_size)

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}])

    name = list(SCHEMAS)[0]
    prompts = [chat(SCHEMA_PROMPTS[name]), chat("List the days of the week, one per line."),
               chat("Write a haiku about the sea.")]
    params = [SamplingParams(max_tokens=60, temperature=0),
              SamplingParams(max_tokens=80, temperature=0, stop=["Thursday,", "Sunday\nSunday"]),
              SamplingParams(max_tokens=40, temperature=0.7, seed=1, stop=["\n\n"])]
    want = assert_resumed_like_undisturbed(
        make, prompts, params, lambda: [compiler.compile(spec_from_message(StructuredOutputs(json=SCHEMAS[name]))),
                                        None, None])
    assert want[1][-1].finish_reason == "stop" and want[1][-1].stop_reason == "Thursday,"


def test_a_resume_that_cannot_go_on_is_refused_alone(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[9])
    with pytest.raises(RequestError, match="nothing to resume"):
        engine.add_request("a", "a", [5, 6, 7], params, resume=Resume([3, 9, 4]))
    with pytest.raises(RequestError, match="max_tokens=4"):
        check_resume(Resume([3, 4, 5, 6]), params, engine.vocab_size)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        check_resume(Resume([engine.vocab_size]), params, engine.vocab_size)
    engine.add_request("b", "b", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       resume=Resume([3]))
    out = []
    while engine.has_work():
        out += engine.step()
    assert [k for k, _ in out] == ["b"] * 3 and out[-1][1].usage.completion_tokens == 4
    assert not engine.requests
