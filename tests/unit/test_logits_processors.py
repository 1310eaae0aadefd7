"""The sampling parameters that change the logits before a token is drawn
(layers/logits_processors.py, through layers/sampler.py): repetition, frequency and presence
penalties, logit_bias, min_p and a grammar's token bitmask, each against a plain loop
written here, on the C++ sampling path and the torch one; include_stop_str_in_output
(engine/output_processor.py); logit_bias ids checked at admission (engine/admission.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.comm.messages import Delta, SamplingParams
from meshserve.configs.model_info import read_model_info
from meshserve.engine.admission import RequestError, check_params
from meshserve.engine.output_processor import OutputProcessor, RequestState
from meshserve.engine.sequence import Sequence
from meshserve.engine.tokenizer import Tokenizer
from meshserve.layers import logits_processors
from meshserve.layers import sampler as sampler_module
from meshserve.layers.logits_processors import apply_processors, check_bitmask, unpack_bitmask
from meshserve.layers.sampler import Sampler, SamplingRow
from support.threads import one_torch_thread  # noqa: F401 (autouse: one intra-op thread here)

EOS = 2
VOCAB = 300
MIN_P_MARGIN = 1e-4
"""Relative distance from the min_p floor within which float32 and float64 may disagree."""

# Each row of a mixed batch: none of the processors, each alone, several at once, greedy
# and sampled (temperature, top-k, top-p, seeds).
PARAMS = [
    dict(),
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, seed=11),
    dict(frequency_penalty=0.8, presence_penalty=-0.5),
    dict(presence_penalty=1.5, temperature=0.0),
    dict(logit_bias=[(3, 5.0), (17, -100.0), (250, 2.5)]),
    dict(min_p=0.05),
    dict(min_p=0.3, temperature=0.5, seed=5),
    dict(temperature=0.7, top_p=0.9),
    dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, logit_bias=[(5, 3.0)], min_p=0.1,
         temperature=1.5),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, logit_bias=[(7, 4.0)], min_p=0.5),
    dict(top_k=20, seed=3, min_p=0.02, presence_penalty=0.3),
    dict(top_p=0.8, seed=4, repetition_penalty=1.1, frequency_penalty=-1.0),
    dict(temperature=0.0),
]
PROCESSOR_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_p")


def make_rows(rng: random.Random, params: list[dict], vocab: int = VOCAB) -> list[SamplingRow]:
    """One row per params dict, each with its own prompt and output: token ids drawn mostly
    from the first 40 (so they repeat), some from the whole vocabulary; one row has no
    output yet."""
    rows = []
    for i, p in enumerate(params):
        prompt_len = rng.randint(1, 30)
        num_output = 0 if i == 1 else rng.randint(1, 30)
        ids = [rng.randrange(40) if rng.random() < 0.8 else rng.randrange(vocab) for _ in range(prompt_len + num_output)]
        rows.append(SamplingRow(SamplingParams(**p), prompt_len + num_output, prompt_len, ids))
    return rows


def plain(row: SamplingRow) -> SamplingRow:
    """`row` without the processors' parameters (same temperature, top-k, top-p, seed)."""
    p = row.params
    kept = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed, logprobs=p.logprobs,
                min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos)
    return SamplingRow(SamplingParams(**kept), row.num_tokens, row.prompt_len, row.token_ids)


def reference(x: torch.Tensor, row: SamplingRow, allowed: list[bool] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One row processed in float64, token by token: the mask, logit_bias, repetition
    penalty over the sequence's distinct tokens, frequency and presence penalties over the
    output's, then min_p on the probabilities after temperature. Also returns which tokens
    sit so close to the min_p floor that rounding may place them either side."""
    p = row.params
    x = x.double().clone()
    if allowed is not None:
        for t in range(len(x)):
            if not allowed[t]:
                x[t] = float("-inf")
    for t, bias in p.logit_bias:
        x[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(row.token_ids[:row.num_tokens]):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(row.token_ids[row.prompt_len:row.num_tokens]).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    borderline = torch.zeros(len(x), dtype=torch.bool)
    if p.min_p and not p.greedy:
        probs = (x / p.temperature).softmax(-1)
        floor = p.min_p * probs.max()
        borderline = (probs / floor - 1).abs() < MIN_P_MARGIN
        x[probs < floor] = float("-inf")
    return x, borderline


def random_logits(seed: int, rows: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- the processors themselves


@pytest.mark.parametrize("seed", range(4))
def test_processors_match_the_reference(seed):
    rng = random.Random(seed)
    rows = make_rows(rng, PARAMS)
    logits = random_logits(seed, len(rows))
    got = logits.clone()
    apply_processors(got, rows)
    for i, r in enumerate(rows):
        want, borderline = reference(logits[i], r)
        both = ~borderline
        assert torch.equal(got[i].isneginf()[both], want.isneginf()[both]), (i, r.params)
        finite = both & want.isfinite()
        assert torch.allclose(got[i][finite].double(), want[finite], rtol=1e-5, atol=1e-4), (i, r.params)
        if not any(getattr(r.params, f) != getattr(SamplingParams(), f) for f in PROCESSOR_FIELDS):
            assert torch.equal(got[i], logits[i]), "a row without processors is untouched"


def test_each_penalty_by_hand():
    # repetition: token 0 (in the prompt only) 2.0 -> 2.0 / 1.25 = 1.6; token 1 (output)
    # -1.0 -> -1.25; frequency/presence count the output only: token 2 twice, token 0 never
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]] * 3)
    ids = [0, 3, 1, 2, 2]  # prompt [0, 3], output [1, 2, 2]
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.25), 5, 2, ids),
            SamplingRow(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 5, 2, ids),
            SamplingRow(SamplingParams(logit_bias=[(3, 1.5), (0, -2.0)]), 5, 2, ids)]
    apply_processors(logits, rows)
    assert logits[0].tolist() == pytest.approx([1.6, -1.25, 0.8, 0.4])
    assert logits[1].tolist() == pytest.approx([2.0, -1.0 - 0.5 - 0.25, 1.0 - 2 * 0.5 - 0.25, 0.5])
    assert logits[2].tolist() == pytest.approx([0.0, -1.0, 1.0, 2.0])


def test_min_p_keeps_tokens_within_the_ratio_at_the_row_temperature():
    # probabilities 0.5, 0.25, 0.15, 0.1 at temperature 1: min_p 0.4 keeps >= 0.2
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    for temperature, kept in [(1.0, [True, True, False, False]), (2.0, [True, True, True, True])]:
        # at temperature 2 the probabilities go as their square roots: sqrt(0.1 / 0.5) = 0.45 >= 0.4
        logits = probs.log()[None].clone()
        apply_processors(logits, [SamplingRow(SamplingParams(min_p=0.4, temperature=temperature), 1, 1, [0])])
        assert logits[0].isfinite().tolist() == kept, temperature
    greedy = probs.log()[None].clone()
    apply_processors(greedy, [SamplingRow(SamplingParams(min_p=0.9, temperature=0.0), 1, 1, [0])])
    assert torch.equal(greedy, probs.log()[None]), "min_p leaves greedy rows alone"


def test_repetition_penalty_reads_only_the_first_num_tokens():
    # the caller's list may be longer than the row's sequence (a token appended later)
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    apply_processors(logits, [SamplingRow(SamplingParams(repetition_penalty=2.0), 2, 1, [0, 1, 2])])
    assert logits[0].tolist() == [0.5, 0.5, 1.0]


def test_a_batch_without_processors_never_calls_them(monkeypatch):
    def fail(*args):
        raise AssertionError("processors called for a batch that uses none")

    monkeypatch.setattr(sampler_module, "apply_processors", fail)
    rows = make_rows(random.Random(0), [dict(), dict(temperature=0.0), dict(top_k=5, seed=1), dict(logprobs=2)])
    tokens, _ = Sampler((EOS,), 0)(random_logits(0, 4), rows)
    assert len(tokens) == 4


# ---------------------------------------------------------------- through the sampler


def sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int = 0, library=None, **kw):
    return Sampler((EOS,), seed, library)(logits.clone(), rows, **kw)


@pytest.mark.parametrize("seed", range(3))
def test_sampled_tokens_are_those_of_the_reference_logits(backend, seed):
    """Sampling with the processors draws, row for row, what sampling the reference's
    processed logits without them draws from the same random numbers: greedy rows their
    argmax, seeded and unseeded rows the same token."""
    rng = random.Random(100 + seed)
    rows = make_rows(rng, PARAMS * 2)
    logits = random_logits(100 + seed, len(rows))
    want = torch.stack([reference(logits[i], r)[0] for i, r in enumerate(rows)]).float()
    got, _ = sample(logits, rows, seed=seed, library=backend)
    expected, _ = sample(want, [plain(r) for r in rows], seed=seed, library=backend)
    assert got == expected
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    assert [got[i] for i in greedy] == want[greedy].argmax(-1).tolist()


def test_seeded_row_samples_the_same_whatever_shares_its_batch(backend):
    vocab = 2000
    g = torch.Generator().manual_seed(9)
    rng = random.Random(9)
    mine_params = dict(seed=42, temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.2,
                       logit_bias=[(1, 2.0), (9, -3.0)], min_p=0.01)
    got_a, got_b = [], []
    for n in range(12):
        ids = [rng.randrange(60) for _ in range(20 + n)]
        me = SamplingRow(SamplingParams(**mine_params), 20 + n, 20, ids)
        mine = torch.randn(vocab, generator=g) * 2
        others = make_rows(rng, [dict(), dict(repetition_penalty=1.5, temperature=0.0), dict(min_p=0.2, top_k=30),
                                 dict(logit_bias=[(0, 50.0)], seed=5)], vocab)
        # Batch A: alone. Batch B: third, among rows with other processors, one of them masked.
        a = sample(mine[None], [me], seed=n, library=backend)[0][0]
        b_logits = torch.stack([torch.randn(vocab, generator=g), torch.randn(vocab, generator=g), mine,
                                torch.randn(vocab, generator=g), torch.randn(vocab, generator=g)])
        mask = pack_bitmask(torch.rand(1, vocab, generator=g) < 0.5)
        b = sample(b_logits, others[:2] + [me] + others[2:], seed=1000 + n, bitmask=mask, bitmask_rows=[3],
                   library=backend)[0][2]
        got_a.append(a)
        got_b.append(b)
    assert got_a == got_b
    assert len(set(got_a)) > 5, "a seeded row should still vary with the sequence length"


def test_logprobs_are_taken_before_the_processors():
    rows = make_rows(random.Random(3), [dict(p, logprobs=3) for p in PARAMS])
    logits = random_logits(3, len(rows))
    tokens, lps = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        assert lp.token_id == t and lp.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert [tid for tid, _ in lp.top] == raw[i].topk(3).indices.tolist()


# ---------------------------------------------------------------- grammar bitmask


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's layout, word by word: bit j of word w set when token 32 * w + j is allowed."""
    k, vocab = allowed.shape
    words = -(-vocab // 32)
    out = torch.zeros(k, words, dtype=torch.int32)
    for r in range(k):
        for w in range(words):
            word = sum(1 << j for j in range(32) if 32 * w + j < vocab and allowed[r, 32 * w + j])
            out[r, w] = word - (1 << 32) if word >= 1 << 31 else word
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 300])
def test_unpack_bitmask_is_the_packed_layout(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=g) < 0.5
    allowed[0] = True  # from vocab 32 on, a word with bit 31 set: a negative int32
    bitmask = pack_bitmask(allowed)
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    # tokens past the mask's words are disallowed
    wider = unpack_bitmask(bitmask, bitmask.shape[1] * 32 + 7)
    assert not wider[:, bitmask.shape[1] * 32:].any() and torch.equal(wider[:, :vocab], allowed)


@pytest.mark.parametrize("seed", range(3))
def test_masked_rows_sample_as_the_reference_and_only_allowed_tokens(cpu_build, backend, seed):
    backend = cpu_build if backend is not None else None  # the native path in every build
    rng = random.Random(200 + seed)
    rows = make_rows(rng, [dict(p, logprobs=2) for p in PARAMS])
    logits = random_logits(200 + seed, len(rows))
    g = torch.Generator().manual_seed(seed)
    mask_rows = sorted(rng.sample(range(len(rows)), 8))
    allowed = torch.rand(len(mask_rows), VOCAB, generator=g) < 0.3
    allowed[0] = False
    allowed[0, rng.randrange(VOCAB)] = True  # a row with one allowed token
    bitmask = pack_bitmask(allowed)
    masks = {r: allowed[k].tolist() for k, r in enumerate(mask_rows)}
    want = torch.stack([reference(logits[i], r, masks.get(i))[0] for i, r in enumerate(rows)]).float()
    got, lps = sample(logits, rows, seed=seed, bitmask=bitmask, bitmask_rows=mask_rows, library=backend)
    expected, _ = sample(want, [plain(r) for r in rows], seed=seed, library=backend)
    assert got == expected
    for k, i in enumerate(mask_rows):
        assert allowed[k, got[i]], (i, got[i])
    raw = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(raw[i, got[i]].item(), abs=1e-5), "logprobs ignore the mask"
        assert [tid for tid, _ in lp.top] == raw[i].topk(2).indices.tolist()


def test_many_draws_of_a_masked_row_stay_allowed(backend):
    n = 400
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(VOCAB, generator=g) * 2).expand(n, -1).contiguous()
    allowed = torch.rand(1, VOCAB, generator=g) < 0.1
    bitmask = pack_bitmask(allowed).expand(n, -1).contiguous()
    params = [dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.1), dict(temperature=3.0)]
    rows = [SamplingRow(SamplingParams(**params[i % len(params)]), 10, 10, [0] * 10) for i in range(n)]
    tokens, _ = sample(logits, rows, bitmask=bitmask, bitmask_rows=list(range(n)), library=backend)
    assert all(allowed[0, t] for t in tokens)
    assert len(set(tokens)) > 3


def test_a_row_left_with_no_finite_logit_takes_the_raw_argmax(backend):
    """The grammar allows only tokens min_tokens bans (or nothing): the row takes the argmax
    of its logits as given, whatever its sampling parameters; its neighbours are unaffected."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, 64, generator=g)
    logits[:, EOS] = 9.0  # the model wants to stop
    logits[:, 11] = 8.0
    only_eos = torch.zeros(64, dtype=torch.bool)
    only_eos[EOS] = True
    nothing = torch.zeros(64, dtype=torch.bool)
    params = [dict(temperature=0.0), dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2, repetition_penalty=1.5),
              dict(temperature=0.0), dict(seed=3)]
    rows = [SamplingRow(SamplingParams(min_tokens=3, **p), 10, 10, list(range(10))) for p in params]
    rows[5] = SamplingRow(SamplingParams(temperature=0.0), 10, 10, list(range(10)))  # unmasked neighbour
    bitmask = pack_bitmask(torch.stack([only_eos, only_eos, only_eos, only_eos, only_eos, nothing]))
    tokens, _ = sample(logits, rows, bitmask=bitmask, bitmask_rows=[0, 1, 2, 3, 4, 6], library=backend)
    assert tokens[:5] == [EOS] * 5 and tokens[6] == EOS
    assert tokens[5] == EOS, "an unmasked greedy row without min_tokens"
    # min_tokens alone (no mask) still bans EOS: the next best
    tokens, _ = sample(logits[:1], rows[:1], library=backend)
    assert tokens == [11]


def test_bad_bitmask_arguments_name_the_parameter():
    rows = make_rows(random.Random(0), [dict(), dict()])
    logits = random_logits(0, 2)
    good = pack_bitmask(torch.ones(1, VOCAB, dtype=torch.bool))
    with pytest.raises(ValueError, match="bitmask:"):
        sample(logits, rows, bitmask=good.long(), bitmask_rows=[0])
    with pytest.raises(ValueError, match="bitmask_rows:"):
        sample(logits, rows, bitmask=good, bitmask_rows=[0, 1])
    with pytest.raises(ValueError, match="bitmask_rows:"):
        sample(logits, rows, bitmask=good, bitmask_rows=[2])
    with pytest.raises(ValueError, match="bitmask_rows:"):
        sample(logits, rows, bitmask=good)
    assert check_bitmask(good, torch.tensor([1]), 2).tolist() == [1]


def test_an_empty_bitmask_changes_nothing():
    rows = make_rows(random.Random(0), [dict(), dict(temperature=0.0)])
    logits = random_logits(0, 2)
    empty = torch.zeros(0, -(-VOCAB // 32), dtype=torch.int32)
    assert sample(logits, rows, bitmask=empty, bitmask_rows=[]) == sample(logits, rows)


# ---------------------------------------------------------------- include_stop_str_in_output

PROMPT = "Question: what is the answer?\nAnswer:"
TEXT = " The answer is 42. <<END>> and then 日本語 😀 more <<END>> text; the end."
STOP_TEXT = " aaa ab abc <<END>> x<<END>>y 日本語 😀😀 end end. ab"


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer(read_model_info(str(tiny_checkpoints["llama"])))


def run(tok: Tokenizer, out_ids: list[int], stream: bool = True, **params
        ) -> tuple[RequestState, list[Delta], list[str]]:
    """Feed `out_ids` one by one as if sampled until the request finishes: the state, the
    deltas and, after each token, the text streamed so far."""
    prompt_ids = tok.encode(PROMPT)
    p = SamplingParams(**{"max_tokens": 1000, **params})
    seq = Sequence(0, "key", list(prompt_ids), len(prompt_ids), p)
    state = RequestState(seq, "req-1", stream, tok.detokenizer(prompt_ids, p.skip_special_tokens))
    proc = OutputProcessor(tok.eos_token_ids, 4096)
    deltas: list[Delta] = []
    streamed: list[str] = []
    for t in out_ids:
        seq.token_ids.append(t)
        d = proc.on_token(state, None)
        if d is not None:
            deltas.append(d)
        streamed.append("".join(x.text for x in deltas))
        if state.finish_reason is not None:
            break
    return state, deltas, streamed


@pytest.mark.parametrize("stream", [True, False])
def test_include_stop_str_in_output_keeps_the_stop_string(tok, stream):
    ids = tok.encode(TEXT)
    state, deltas, streamed = run(tok, ids, stream=stream, stop=["<<END>>", "never"], include_stop_str_in_output=True)
    final = "".join(d.text for d in deltas)
    assert final == " The answer is 42. <<END>>"
    assert state.finish_reason == "stop" and state.stop_reason == "<<END>>"
    if stream:
        # nothing is held back: after each token before the last, all the text so far is sent
        so_far = "".join(_chunks(tok, ids)[:len(streamed) - 1])
        assert streamed[-2] == so_far
    else:
        assert len(deltas) == 1
    for s in streamed:
        assert final.startswith(s), f"streamed {s!r} leaks beyond the final text"
    _, excluded, _ = run(tok, ids, stream=stream, stop=["<<END>>", "never"])
    assert "".join(d.text for d in excluded) == " The answer is 42. "


def _chunks(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer(tok.encode(PROMPT))
    return [detok.step(t) for t in ids]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_include_stop_str_in_output_property(tok, data):
    """Generation ends at the first token after which a stop string occurs; the text runs
    to the end of the earliest occurrence, and nothing streamed goes past it."""
    ids = tok.encode(STOP_TEXT)
    chunks = _chunks(tok, ids)
    full = "".join(chunks)

    def substring():
        i = data.draw(st.integers(0, len(full) - 1))
        j = data.draw(st.integers(i + 1, min(len(full), i + 10)))
        return full[i:j]

    stops = data.draw(st.lists(st.one_of(st.builds(substring), st.text(min_size=1, max_size=4)),
                               min_size=1, max_size=3))
    state, deltas, streamed = run(tok, ids, max_tokens=len(ids), stop=stops, include_stop_str_in_output=True)
    final = "".join(d.text for d in deltas)
    end, want = 0, full
    for c in chunks:
        end += len(c)
        found = [(full[:end].find(s), s) for s in stops if s in full[:end]]
        if found:
            at, stop = min(found)
            want = full[:at + len(stop)]
            assert state.finish_reason == "stop" and state.stop_reason == stop
            break
    assert final == want
    for s in streamed:
        assert final.startswith(s), f"streamed {s!r} leaks beyond the final text {final!r}"


# ---------------------------------------------------------------- admission


def test_logit_bias_outside_the_vocabulary_is_refused():
    check_params(SamplingParams(logit_bias=[(0, 1.0), (99, -100.0)]), 100)
    with pytest.raises(RequestError) as e:
        check_params(SamplingParams(logit_bias=[(5, 1.0), (100, 2.0), (12345, -1.0)]), 100)
    err = e.value
    assert err.code == "bad_request" and err.param == "logit_bias"
    assert "[100, 12345]" in err.message and "100" in err.message and "logit_bias" in err.message


def test_processor_parameters_are_known_to_uses_processors():
    assert not logits_processors.uses_processors(SamplingParams(temperature=0.3, top_k=4, top_p=0.5, min_tokens=2))
    for field, value in [("repetition_penalty", 1.01), ("frequency_penalty", -0.1), ("presence_penalty", 0.1),
                         ("logit_bias", [(1, 0.0)]), ("min_p", 0.01)]:
        assert logits_processors.uses_processors(SamplingParams(**{field: value})), field
