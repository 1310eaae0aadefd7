"""Overlapped steps (scheduler.overlap; engine/engine.py): step n + 1 is scheduled and
submitted before the driver reads step n's tokens, which feed it on the device. The oracle
is the same engine without overlap: the same tokens, logprobs and finish reasons for
greedy and seeded sampling, penalties, prompt logprobs, chunked prefill beside decodes,
preemption, stops found a step late, structured outputs, speculative decoding, aborts,
and decode steps that replay graphs."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams, StructuredOutputs
from meshserve.configs import ConfigError, load_config
from meshserve.configs.validate import check_config
from meshserve.engine import build
from meshserve.engine.offline import generate
from meshserve.engine.structured import GrammarCompiler, spec_from_message
from support.checkpoints import make_checkpoint
from support.engines import make_engine
from support.schemas import PROMPTS as SCHEMA_PROMPTS, REGEX, SCHEMAS

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7], list(range(1000, 1023)),
           [9, 99, 999, 9999, 19999], list(range(2000, 2064))]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.4),
    SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=11, ignore_eos=True, prompt_logprobs=2),
    SamplingParams(max_tokens=25, temperature=1.0, min_p=0.05, seed=5, ignore_eos=True, min_tokens=3,
                   frequency_penalty=1.0, logprobs=0),
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
]


def run_staggered(engine, prompts, params, arrivals, abort=None):
    """Add request i at step arrivals[i] (and abort request `abort[0]` at step `abort[1]`);
    step until all finish. Returns per request its deltas."""
    deltas = {i: [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == step:
                engine.add_request(i, str(i), prompts[i], params[i])
        if abort is not None and step == abort[1]:
            deltas[abort[0]].append(engine.abort(abort[0]))
        for i, delta in engine.step():
            deltas[i].append(delta)
        step += 1
        assert step < 1000
    return [deltas[i] for i in range(len(prompts))]


def outcome(deltas):
    """What a client sees of a request: its tokens, text, logprobs, finish and prompt logprobs."""
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    prompt = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    return tokens, "".join(d.text for d in deltas), logprobs, deltas[-1].finish_reason, prompt


def assert_same(want, got):
    for w, g in zip(want, got):
        wt, wtext, wlp, wfin, wprompt = outcome(w)
        gt, gtext, glp, gfin, gprompt = outcome(g)
        assert (gt, gtext, gfin) == (wt, wtext, wfin)
        # the batches differ in who shares them, so the values only up to a reduction's rounding
        assert [(x.token_id, [t for t, _ in x.top]) for x in glp] == [(x.token_id, [t for t, _ in x.top]) for x in wlp]
        values = [[x.logprob, *(v for _, v in x.top)] for x in glp]
        assert values == [pytest.approx([x.logprob, *(v for _, v in x.top)], abs=1e-4) for x in wlp]
        assert len(gprompt) == len(wprompt)
        assert sum(len(d.token_ids) for d in g if d.finish_reason is None) <= len(gt)  # nothing after the end


def both(path, *overrides):
    return (make_engine(path, *overrides, "scheduler.overlap=false"),
            make_engine(path, *overrides, "scheduler.overlap=true"))


def test_sampling_penalties_and_logprobs_with_chunked_prefill_and_staggered_arrivals(tiny_checkpoints):
    off, on = both(tiny_checkpoints["llama"], "scheduler.max_batched_tokens=16", "cache.block_size=4")
    arrivals = [0, 1, 3, 4, 9, 10]
    want = run_staggered(off, PROMPTS, PARAMS, arrivals)
    got = run_staggered(on, PROMPTS, PARAMS, arrivals)
    assert_same(want, got)
    assert on.overlap and not off.overlap
    runner = on.executor.runner
    # nearly every decode token came from the device: all but each request's first
    assert runner.stats.deferred_tokens >= sum(p.max_tokens - 2 for p in PARAMS)
    assert off.executor.runner.stats.deferred_tokens == 0
    assert on.scheduler.blocks.num_free == on.memory.num_blocks


def test_preemption(tiny_checkpoints):
    # 24 blocks of 4 tokens cannot hold every sequence at once: the scheduler must preempt
    off, on = both(tiny_checkpoints["llama"], "cache.block_size=4", "cache.num_blocks=24", "model.max_model_len=96")
    want = run_staggered(off, PROMPTS, PARAMS, [0] * 6)
    got = run_staggered(on, PROMPTS, PARAMS, [0] * 6)
    assert_same(want, got)
    assert on.scheduler.num_preemptions > 0
    assert on.executor.runner.stats.deferred_tokens > 0
    assert on.scheduler.blocks.num_free == 24


def test_a_stop_found_a_step_late_streams_nothing_after_it_and_an_abort_frees_all(tiny_checkpoints):
    """Stop tokens taken from the greedy output itself: the overlapped engine has already
    computed the token after each when it reads it; that token is never streamed."""
    path = tiny_checkpoints["llama"]
    free = [c.token_ids for c in generate(make_engine(path), PROMPTS,
                                          SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[t[5 + i]])
              for i, t in enumerate(free)]
    off, on = both(path, "cache.prefix_caching=true")
    want = run_staggered(off, PROMPTS, params, [0, 0, 1, 1, 2, 2], abort=(3, 4))
    got = run_staggered(on, PROMPTS, params, [0, 0, 1, 1, 2, 2], abort=(3, 4))
    # an abort at a given step finds the overlapped engine a step behind in what it streamed
    assert_same(want[:3] + want[4:], got[:3] + got[4:])
    for i, deltas in enumerate(got):
        tokens, _, _, finish, _ = outcome(deltas)
        if i == 3:
            assert finish == "abort" and tokens == free[3][:len(tokens)]
            continue
        assert finish == "stop" and tokens[-1] == params[i].stop_token_ids[0] and len(tokens) <= 6 + i
    assert on.executor.runner.stats.deferred_tokens > 0
    assert on.scheduler.blocks.num_free == on.memory.num_blocks and not on.requests


def test_speculative_decoding(tmp_path):
    """n-gram drafts on repetitive prompts (small weights: the model falls into loops, which
    the lookup catches): the speculator's sequences wait for their tokens, which it drafts
    from; the output is the output without overlap."""
    path = make_checkpoint(tmp_path / "llama", "llama", seed=1, initializer_range=0.09)
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 2 + [5, 6, 7], list(range(100, 140)) * 2, [3, 4] * 20]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, presence_penalty=0.5)]
    ngram = ["speculative.method=ngram", "speculative.adaptive=false", "speculative.prompt_lookup_min=1"]
    off, on = both(path, *ngram)
    want = run_staggered(off, prompts, params, [0, 0, 2])
    got = run_staggered(on, prompts, params, [0, 0, 2])
    assert_same(want, got)
    assert on.speculator.stats.num_accepted_tokens > 0


def test_graph_replays(tiny_checkpoints, monkeypatch):
    """Decode steps replaying captured graphs (the CPU stand-in) take their deferred inputs
    from the device tensor too."""
    monkeypatch.setattr(build, "uses_decode_graphs", lambda config: True)
    off, on = both(tiny_checkpoints["llama"], "scheduler.max_num_seqs=8", "scheduler.max_batched_tokens=32")
    want = run_staggered(off, PROMPTS, PARAMS, [0] * 6)
    got = run_staggered(on, PROMPTS, PARAMS, [0] * 6)
    assert_same(want, got)
    assert on.executor.runner.decode.graphs.replays > 10 and on.executor.runner.stats.deferred_tokens > 0


def test_structured_outputs_and_stop_strings_with_smollm2(smollm2):
    """Constrained requests wait a step for their token (the grammar's next mask needs it)
    beside unconstrained ones that overlap; stop strings end requests a step late."""
    off, on = both(smollm2, "model.max_model_len=512")
    tok = off.tokenizer
    compiler = GrammarCompiler(tok, off.vocab_size)

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}])

    names = list(SCHEMAS)[:2]
    prompts = [chat(SCHEMA_PROMPTS[n]) for n in names] + [chat("Name a city and a number."),
                                                          chat("Count from one to twenty in words."),
                                                          chat("Write a haiku about the sea.")]
    grammars = [compiler.compile(spec_from_message(StructuredOutputs(json=SCHEMAS[n]))) for n in names]
    grammars += [compiler.compile(spec_from_message(StructuredOutputs(regex=REGEX))), None, None]
    params = [SamplingParams(max_tokens=60, temperature=0)] * 2 + [
        SamplingParams(max_tokens=30, temperature=0.8, seed=3),
        SamplingParams(max_tokens=60, temperature=0, stop=["seven", "ten"]),
        SamplingParams(max_tokens=40, temperature=0.7, seed=1, stop=["\n"], include_stop_str_in_output=True)]
    want = generate(off, prompts, params, grammars)
    got = generate(on, prompts, params, grammars)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [(g.text, g.finish_reason, g.stop_reason) for g in got] == [
        (w.text, w.finish_reason, w.stop_reason) for w in want]
    assert want[3].finish_reason == "stop" and want[3].stop_reason in ("seven", "ten")
    assert on.executor.runner.stats.deferred_tokens > 0


def config(path, *overrides):
    return load_config(None, [f"model.path={path}", *overrides])


def test_auto_is_on_for_cuda_only_and_true_is_refused_where_it_cannot_run(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    assert not build.uses_overlap(config(path))
    assert build.uses_overlap(config(path, "device.type=cuda"))
    assert build.uses_overlap(config(path, "device.type=cuda", "parallel.tensor=2"))
    assert not build.uses_overlap(config(path, "device.type=cuda", "parallel.pipeline=2"))
    assert build.uses_overlap(config(path, "scheduler.overlap=true"))
    with pytest.raises(ConfigError, match=r"scheduler.overlap=true needs one pipeline stage.*parallel.pipeline=2"):
        check_config(config(path, "scheduler.overlap=true", "parallel.pipeline=2"))
    with pytest.raises(ConfigError, match=r"scheduler.overlap=true .*parallel.context=2"):
        check_config(config(path, "scheduler.overlap=true", "parallel.context=2"))


def test_prefix_caching_keeps_the_blocks_a_pending_token_completed(tiny_checkpoints):
    """A block the step after a pending token filled is offered to the prefix cache once that
    token is known: a second turn that resends the history finds as many cached tokens as
    without overlap (the answer's last full block included)."""
    off, on = both(tiny_checkpoints["llama"], "cache.block_size=4")
    system = list(range(500, 542))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for engine in (off, on):
        first = generate(engine, [system + [7, 8, 9]], params)[0]
        history = system + [7, 8, 9] + first.token_ids
        second = generate(engine, [history + [31, 32]], params)[0]
        engine.turns = (first.token_ids, second.token_ids, second.usage.cached_tokens)
    assert on.turns == off.turns and off.turns[2] == 52  # 13 blocks: prompt and 7 answer tokens
    assert on.scheduler.blocks.hit_tokens == off.scheduler.blocks.hit_tokens


def test_each_overlapped_step_reports_the_time_it_ran(tiny_checkpoints):
    """The observer's step seconds (MFU, MBU, engine busy): on the CPU a step's kernels run in
    its submit, and the last step's result is only read by the call after it; that call's
    own time alone would make the last step look free (and its MFU huge)."""

    class Steps:
        seconds: list[float] = []

        def __getattr__(self, name):
            return lambda *args: None

        def on_step(self, batch, context_lens, seconds):
            self.seconds.append(seconds)

    engine = make_engine(tiny_checkpoints["llama"], "scheduler.overlap=true")
    engine.observer = Steps()
    generate(engine, PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    seconds = sorted(engine.observer.seconds[1:])  # the first step is the prefill
    assert len(seconds) == 11 and seconds[0] > 0.3 * seconds[len(seconds) // 2]
