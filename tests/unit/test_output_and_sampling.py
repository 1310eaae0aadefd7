"""What a client sees: stop conditions and incremental text (engine/output_processor.py, the
tokenizer's incremental detokenizer), token sampling (layers/sampler.py), and the typed
messages that carry both (comm/messages.py)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.comm.messages import (AbortRequest, Completion, Delta, ErrorReply, GenerateRequest, Hello, NewSeq,
                                     Ready, SamplingParams, SeqDelta, Shutdown, StepPlan, StepResult, TokenLogprob,
                                     Usage, client_decoder, control_decoder, encoder, rank_decoder, server_decoder)
from meshserve.configs.model_info import read_model_info
from meshserve.engine.output_processor import OutputProcessor, RequestState
from meshserve.engine.sequence import Sequence
from meshserve.engine.tokenizer import Tokenizer
from meshserve.layers.sampler import Sampler, SamplingRow, _row_seed
from support.threads import one_torch_thread  # noqa: F401 (autouse: one intra-op thread here)

EOS = 2  # <|im_end|> in SmolLM2's vocabulary; the tiny checkpoints' eos_token_id
PROMPT = "Question: what is the answer?\nAnswer:"
TEXT = " The answer is 42. <<END>> and then 日本語 😀 more <<END>> text; the end."


@pytest.fixture(scope="module")
def tok(tiny_checkpoints) -> Tokenizer:
    return Tokenizer(read_model_info(str(tiny_checkpoints["llama"])))


def run(tok: Tokenizer, out_ids: list[int], stream: bool = True, prompt: str = PROMPT, max_model_len: int = 4096,
        logprobs: list[TokenLogprob] | None = None, **params) -> tuple[RequestState, list[Delta], list[str]]:
    """Feed `out_ids` one by one as if sampled; stop at the finish. Returns the state, the
    deltas and, after each token, the text streamed so far."""
    prompt_ids = tok.encode(prompt)
    p = SamplingParams(**{"max_tokens": 1000, **params})
    seq = Sequence(0, "key", list(prompt_ids), len(prompt_ids), p)
    state = RequestState(seq, "req-1", stream, tok.detokenizer(prompt_ids, p.skip_special_tokens))
    proc = OutputProcessor(tok.eos_token_ids, max_model_len)
    deltas: list[Delta] = []
    streamed: list[str] = []
    for i, t in enumerate(out_ids):
        seq.token_ids.append(t)
        d = proc.on_token(state, logprobs[i] if logprobs else None)
        if d is not None:
            deltas.append(d)
        streamed.append("".join(x.text for x in deltas))
        if state.finish_reason is not None:
            break
    return state, deltas, streamed


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_tokenizer_eos(tok):
    assert tok.eos_token_ids == (EOS,)


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens_is_held_back_and_not_emitted(tok):
    ids = tok.encode(TEXT)
    pieces = [tok.decode([i]) for i in ids]
    assert {" <<", "END", ">>"} <= set(pieces), "precondition: '<<END>>' is split over three tokens"
    state, deltas, streamed = run(tok, ids, stop=["<<END>>"])
    final = text_of(deltas)
    assert final == " The answer is 42. "
    assert state.finish_reason == "stop" and state.stop_reason == "<<END>>"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "<<END>>"
    assert all(d.finish_reason is None for d in deltas[:-1])
    for s in streamed:
        assert final.startswith(s), f"streamed {s!r} is not a prefix of the final text"
        assert "<" not in s
    # Generation stopped at the token that completed the stop string; its tokens are reported.
    n = pieces.index(">>") + 1
    assert tokens_of(deltas) == ids[:n]
    assert deltas[-1].usage == Usage(len(tok.encode(PROMPT)), n)


def test_text_without_stop_strings_is_streamed_at_once(tok):
    ids = tok.encode(TEXT)
    state, deltas, streamed = run(tok, ids, max_tokens=len(ids))
    assert len(deltas) == len(ids)  # one delta per token while streaming
    detok = tok.detokenizer(tok.encode(PROMPT))
    want = ""
    for s, t in zip(streamed, ids):
        want += detok.step(t)
        assert s == want, "nothing is held back when there are no stop strings"
    assert state.finish_reason == "length"


def test_held_back_text_is_flushed_when_no_stop_string_matches(tok):
    ids = tok.encode(TEXT)
    stops = ["never appears here", "<<STOP>>"]
    state, deltas, streamed = run(tok, ids, max_tokens=len(ids), stop=stops)
    assert text_of(deltas) == tok.decode(ids)
    assert state.finish_reason == "length" and state.stop_reason is None
    # While streaming, at most len(longest stop) - 1 characters are held back.
    holdback = max(map(len, stops)) - 1
    text = ""
    for s, chunk in zip(streamed[:-1], _chunks(tok, ids)):
        text += chunk
        assert text.startswith(s)
        assert len(s) >= len(text) - holdback
    assert len(streamed[-2]) < len(text_of(deltas)), "precondition: something was held back until the end"


def _chunks(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer(tok.encode(PROMPT))
    return [detok.step(t) for t in ids]


STOP_TEXT = " aaa ab abc <<END>> x<<END>>y 日本語 😀😀 end end. ab"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_property(tok, data):
    ids = tok.encode(STOP_TEXT)
    chunks = _chunks(tok, ids)
    full = "".join(chunks)
    assert full == tok.decode(ids)

    def substring():
        i = data.draw(st.integers(0, len(full) - 1))
        j = data.draw(st.integers(i + 1, min(len(full), i + 10)))
        return full[i:j]

    stops = data.draw(st.lists(st.one_of(st.builds(substring), st.text(min_size=1, max_size=4)),
                               min_size=1, max_size=3))
    state, deltas, streamed = run(tok, ids, max_tokens=len(ids), stop=stops)
    final = text_of(deltas)
    # Spec: generation ends at the first token after which some stop string occurs in the
    # text; the output is the text before the earliest occurrence.
    end, k = 0, None
    for k_, c in enumerate(chunks):
        end += len(c)
        found = [(full[:end].find(s), s) for s in stops if s in full[:end]]
        if found:
            at = min(found)[0]
            k = k_
            break
    if k is None:
        assert final == full and state.finish_reason == "length"
    else:
        assert final == full[:at]
        assert state.finish_reason == "stop" and full[at:].startswith(state.stop_reason)
        assert tokens_of(deltas) == ids[:k + 1]
    for s in streamed:
        assert final.startswith(s), f"streamed {s!r} leaks beyond the final text {final!r}"


def test_non_stream_request_gets_one_delta_with_everything(tok):
    ids = tok.encode(TEXT)
    state, deltas, _ = run(tok, ids, stream=False, stop=["<<END>>"])
    assert len(deltas) == 1
    (d,) = deltas
    assert d.text == " The answer is 42. "
    assert d.finish_reason == "stop" and d.stop_reason == "<<END>>"
    assert d.token_ids == ids[:len(state.seq.output_token_ids)]
    assert d.usage == Usage(len(tok.encode(PROMPT)), len(d.token_ids))


def test_non_stream_length(tok):
    ids = tok.encode(TEXT)
    state, deltas, streamed = run(tok, ids, stream=False, max_tokens=5)
    assert streamed[:4] == [""] * 4
    assert len(deltas) == 1 and deltas[0].finish_reason == "length"
    assert deltas[0].text == tok.decode(ids[:5]) and deltas[0].token_ids == ids[:5]
    assert deltas[0].usage == Usage(len(tok.encode(PROMPT)), 5)


# ---------------------------------------------------------------- stop tokens, EOS, lengths


def test_stop_token_id_finishes_with_stop_reason(tok):
    ids = tok.encode(" Hello world again")
    state, deltas, _ = run(tok, ids, stop_token_ids=[ids[1]])
    assert state.finish_reason == "stop" and state.stop_reason == ids[1]
    assert text_of(deltas) == " Hello"  # the stop token's text is not part of the output
    assert tokens_of(deltas) == ids[:2]
    assert deltas[-1].stop_reason == ids[1]


def test_eos_finishes_with_stop(tok):
    ids = tok.encode(" Hi there") + [EOS] + tok.encode(" more")
    state, deltas, _ = run(tok, ids)
    assert state.finish_reason == "stop" and state.stop_reason is None
    assert text_of(deltas) == " Hi there"
    assert tokens_of(deltas)[-1] == EOS and len(tokens_of(deltas)) == len(ids) - 1


def test_ignore_eos_continues_to_max_tokens(tok):
    ids = tok.encode(" Hi there") + [EOS] + tok.encode(" more")
    state, deltas, _ = run(tok, ids, ignore_eos=True, max_tokens=len(ids))
    assert state.finish_reason == "length"
    assert tokens_of(deltas) == ids
    assert text_of(deltas) == " Hi there more"  # the special token is skipped in the text


def test_stop_token_ids_apply_even_with_ignore_eos(tok):
    ids = tok.encode(" a b c d")
    state, _, _ = run(tok, ids, ignore_eos=True, stop_token_ids=[ids[2]])
    assert state.finish_reason == "stop" and state.stop_reason == ids[2]


def test_min_tokens_defers_eos_and_stop_tokens(tok):
    a, b, c = tok.encode(" one two three")
    # EOS as the 2nd output token and a stop token as the 3rd are ignored under min_tokens=3;
    # EOS as the 4th ends the request.
    state, deltas, _ = run(tok, [a, EOS, c, EOS, b], min_tokens=3, stop_token_ids=[c])
    assert state.finish_reason == "stop" and state.stop_reason is None
    assert tokens_of(deltas) == [a, EOS, c, EOS]
    state, _, _ = run(tok, [a, b, c, EOS], min_tokens=2, stop_token_ids=[c])
    assert state.finish_reason == "stop" and state.stop_reason == c
    assert state.seq.num_output_tokens == 3


def test_max_tokens_finishes_with_length(tok):
    ids = tok.encode(TEXT)
    for n in (1, 3, 7):
        state, deltas, _ = run(tok, ids, max_tokens=n)
        assert state.finish_reason == "length" and state.stop_reason is None
        assert tokens_of(deltas) == ids[:n]
        assert deltas[-1].usage == Usage(len(tok.encode(PROMPT)), n)
        assert all(d.usage is None for d in deltas[:-1])


def test_max_model_len_finishes_with_length(tok):
    ids = tok.encode(TEXT)
    prompt_len = len(tok.encode(PROMPT))
    state, deltas, _ = run(tok, ids, max_model_len=prompt_len + 4)
    assert state.finish_reason == "length"
    assert len(tokens_of(deltas)) == 4


def test_abort_flushes_and_marks_abort(tok):
    ids = tok.encode(TEXT)
    state, deltas, _ = run(tok, ids[:3], stop=["zzzzzz"])
    proc = OutputProcessor(tok.eos_token_ids, 4096)
    final = proc.abort(state)
    assert final.finish_reason == "abort" and final.usage == Usage(state.seq.prompt_len, 3)
    assert text_of(deltas) + final.text == tok.decode(ids[:3])


def test_logprobs_travel_with_their_deltas(tok):
    ids = tok.encode(" a b c")
    lps = [TokenLogprob(t, -0.5 * i, [(t, -0.5 * i)]) for i, t in enumerate(ids)]
    state, deltas, _ = run(tok, ids, logprobs=lps, max_tokens=len(ids))
    assert [lp for d in deltas for lp in d.logprobs] == lps
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    completion = Completion("req-1")
    for d in deltas:
        completion.add(d)
    assert completion.logprobs == lps and completion.token_ids == ids and completion.finish_reason == "length"


# ---------------------------------------------------------------- incremental detokenization

MULTIBYTE = "日本語 😀 é naïve café – 中文 🚀👍🏽"


@pytest.mark.parametrize("prompt", ["", "Hello there", "語語語語x", "ab 🚀👍🏽"])
def test_incremental_detokenization_never_emits_broken_utf8(tok, prompt):
    ids = tok.encode(MULTIBYTE)
    detok = tok.detokenizer(tok.encode(prompt))
    chunks = [detok.step(t) for t in ids]
    assert "".join(chunks) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in c for c in chunks), chunks
    assert chunks.count("") > 0, "precondition: some tokens end inside a character"


def test_streamed_deltas_with_multibyte_text(tok):
    ids = tok.encode(MULTIBYTE)
    _, deltas, _ = run(tok, ids, max_tokens=len(ids), stop=["never"])
    assert text_of(deltas) == MULTIBYTE
    assert not any("\ufffd" in d.text for d in deltas)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(blacklist_categories=("Cs", "Cn", "Co")), max_size=24),
       prompt=st.text(st.characters(blacklist_categories=("Cs", "Cn", "Co")), max_size=8))
def test_incremental_detokenization_property(tok, text, prompt):
    ids = tok.encode(text)
    detok = tok.detokenizer(tok.encode(prompt))
    chunks = [detok.step(t) for t in ids]
    assert "".join(chunks) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("prompt", ["Hello 😀", "Hello 語"])
def test_prompt_ending_inside_a_character_is_not_repeated(tok, prompt):
    full = tok.encode(prompt)
    cut = 2 if prompt.endswith("語") else 1  # cut the prompt's token ids inside the last character
    assert "\ufffd" in tok.decode(full[:-cut]), "precondition: the prompt ends inside a character"
    detok = tok.detokenizer(full[:-cut])
    out = "".join(detok.step(t) for t in full[-cut:] + tok.encode(" world"))
    assert not out.startswith("Hello"), f"prompt text re-emitted as output: {out!r}"
    assert out.endswith(" world") and "\ufffd" not in out


# ---------------------------------------------------------------- sampler


def row(num_tokens: int = 10, prompt_len: int = 10, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), num_tokens, prompt_len, [0] * num_tokens)


def sample(logits: torch.Tensor, rows: list[SamplingRow], seed: int | None = 0, eos=(EOS,), library=None):
    """`library`: the C++ kernels that sample (cpu_sample.cpp), None: the torch-op path."""
    return Sampler(eos, seed, library)(logits.clone(), rows)


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g)
    tokens, lps = sample(logits, [row(temperature=0.0)] * 16)
    assert tokens == logits.argmax(-1).tolist() and lps is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 100, generator=g)
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.5) for i in range(8)]
    tokens, _ = sample(logits, rows)
    want = logits.argmax(-1).tolist()
    assert [t for i, t in enumerate(tokens) if i % 2] == [t for i, t in enumerate(want) if i % 2]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 200, generator=g)
    for seed in range(3):
        tokens, _ = sample(logits, [row(temperature=temperature, top_k=1)] * 64, seed=seed)
        assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 10.0])
def test_tiny_top_p_is_argmax(temperature):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 200, generator=g)
    tokens, _ = sample(logits, [row(temperature=temperature, top_p=1e-6)] * 64)
    assert tokens == logits.argmax(-1).tolist()


def test_seeded_row_ignores_neighbours_and_position():
    g = torch.Generator().manual_seed(4)
    vocab = 300
    mine = torch.randn(vocab, generator=g)
    for mine_params in (dict(seed=1234), dict(seed=1234, top_k=50, temperature=0.8), dict(seed=99, top_p=0.9)):
        got_a, got_b = [], []
        for n in range(25):
            me = row(num_tokens=20 + n, prompt_len=20, **mine_params)
            # Batch A: alone first, one unseeded neighbour. Batch B: third, among rows with
            # other temperatures, top-k, top-p, a greedy row and another seed.
            a = torch.stack([mine, torch.randn(vocab, generator=g)])
            b = torch.stack([torch.randn(vocab, generator=g), torch.randn(vocab, generator=g), mine,
                             torch.randn(vocab, generator=g)])
            rows_a = [me, row()]
            rows_b = [row(temperature=0.0), row(top_k=7, temperature=2.0), me, row(seed=5, top_p=0.5)]
            got_a.append(sample(a, rows_a, seed=n)[0][0])
            got_b.append(sample(b, rows_b, seed=1000 + n)[0][2])
        assert got_a == got_b, mine_params
        assert len(set(got_a)) > 5, "a seeded row should still vary with the sequence length"


def test_top_p_1_row_is_unaffected_by_a_top_p_neighbour():
    # The torch path (CUDA, or no C++ compiler): a seeded row with the full vocabulary, built
    # so that the exponential race is won by a low-probability token: logits = log(noise) +
    # delta, with the largest delta on the token with the smallest noise. Alone it samples
    # that token; it must do so in any batch.
    vocab, seed, num_tokens = 49152, 7, 30
    g = torch.Generator().manual_seed(_row_seed(seed, num_tokens))
    noise = torch.empty(vocab).exponential_(generator=g)
    g = torch.Generator().manual_seed(0)
    delta = (3 * torch.randn(vocab, generator=g)).clamp(max=0.0)
    winner = int(noise.argmin())
    delta[winner] = 0.5
    logits = noise.log() + delta
    me = row(num_tokens=num_tokens, prompt_len=10, seed=seed)
    alone = sample(logits[None], [me])[0][0]
    assert alone == winner, "precondition: the race winner is sampled when alone"
    neighbour = torch.randn(vocab, generator=g)
    mixed = sample(torch.stack([neighbour, logits]), [row(top_p=0.9), me])[0][1]
    assert mixed == alone


def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(1, 50)  # uniform
    draws = {s: [sample(logits, [row(num_tokens=n, prompt_len=0, seed=s)])[0][0] for n in range(40)]
             for s in (1, 2)}
    assert draws[1] != draws[2]
    again = [sample(logits, [row(num_tokens=n, prompt_len=0, seed=1)], seed=77)[0][0] for n in range(40)]
    assert again == draws[1]


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def draw_counts(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> list[int]:
    logits = logits_row.expand(n, -1).clone()
    tokens, _ = sample(logits, [row(**params)] * n, seed=seed)
    return [tokens.count(i) for i in range(logits.shape[1])]


P4 = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize("params, want", [
    (dict(), P4),
    (dict(temperature=2.0), [math.sqrt(p) / sum(math.sqrt(q) for q in P4) for p in P4]),
    (dict(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    (dict(top_p=0.75), [0.0, 2 / 9, 3 / 9, 4 / 9]),
    (dict(top_p=0.5), [0.0, 0.0, 3 / 7, 4 / 7]),
])
def test_unseeded_sampling_follows_the_distribution(params, want):
    logits = torch.tensor(P4).log()
    counts = draw_counts(logits, 2000, **params)
    for c, p in zip(counts, want):
        if p == 0.0:
            assert c == 0, (counts, want)
    # 3 degrees of freedom: P(chi2 > 25) < 2e-5
    assert chi_square(counts, want) < 25, (counts, want)


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What one row samples from, in float64: softmax(logits / T), cut to the top k (ties
    kept), then to the tokens whose higher-ranked mass is at most top_p of what is left."""
    x = logits.double() / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    probs = x.softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 1.0), (0.8, 20, 0.6),
                                                     (2.0, 0, 0.5)])
def test_sampled_distribution_matches_the_reference(cpu_build, backend, temperature, top_k, top_p):
    """4,000 draws of one 2,000-token row against its distribution computed in float64 (a
    chi-square over the tokens expected 5 times or more, the rest pooled), and no token
    outside the kept set; -inf logits (banned tokens) are never drawn."""
    library = cpu_build if backend == "native" else None
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2000, generator=g) * 2.5
    logits[:5] = float("-inf")
    want = reference_distribution(logits, temperature, top_k, top_p)
    n = 4000
    tokens, _ = sample(logits.expand(n, -1).contiguous(), [row(temperature=temperature, top_k=top_k, top_p=top_p)] * n,
                       seed=3, library=library)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(logits)).double()
    assert counts[want == 0].sum() == 0 and counts[:5].sum() == 0
    expected = want * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expect = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expect > 0
    chi2 = (((observed - expect) ** 2)[keep] / expect[keep]).sum().item()
    dof = int(keep.sum()) - 1
    # mean dof, sd sqrt(2 dof): 6 sd above the mean fails with probability < 1e-6
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)


def test_native_sampling_handles_the_edges(cpu_build):
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")], [5.0, 5.0, 5.0, 5.0], [float("-inf"), 0.0, -1e9, -3.0]])
    tokens, _ = sample(logits, [row(temperature=0.0), row(top_k=10), row(top_p=1e-6, temperature=50.0)],
                       library=cpu_build)
    assert tokens[0] == 2 and tokens[1] in range(4) and tokens[2] == 1
    # ties at the k-th weight are kept, as the reference keeps them: every tied token is drawn
    tied = torch.tensor([[3.0, 3.0, 3.0, 1.0]]).expand(600, -1).contiguous()
    drawn = set(sample(tied, [row(top_k=1)] * 600, library=cpu_build)[0])
    assert drawn == {0, 1, 2}


def test_unseeded_sampling_uses_the_sampler_generator():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [row()], seed=s)[0][0] for s in range(10)]
    assert len(set(a)) > 5
    assert a == [sample(logits, [row()], seed=s)[0][0] for s in range(10)]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 4] = 10.0, 9.0, 8.0
    # One output token so far, min_tokens=3: EOS and the stop id are banned.
    tokens, _ = sample(logits, [row(11, 10, temperature=0.0, min_tokens=3, stop_token_ids=[7])])
    assert tokens == [4]
    # ignore_eos: EOS is an ordinary token, the stop id is still banned.
    tokens, _ = sample(logits, [row(11, 10, temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)])
    assert tokens == [EOS]
    # min_tokens reached: nothing banned.
    tokens, _ = sample(logits, [row(13, 10, temperature=0.0, min_tokens=3, stop_token_ids=[7])])
    assert tokens == [EOS]
    # Random sampling never draws a banned id either.
    n = 500
    rows = [row(10, 10, min_tokens=1, stop_token_ids=[7])] * n
    tokens, _ = sample(logits.expand(n, -1), rows)
    assert EOS not in tokens and 7 not in tokens and tokens.count(4) > n // 2


def test_min_tokens_only_affects_its_own_row():
    logits = torch.zeros(2, 10)
    logits[:, EOS] = 10.0
    tokens, _ = sample(logits, [row(10, 10, temperature=0.0, min_tokens=2), row(10, 10, temperature=0.0)])
    assert tokens[0] != EOS and tokens[1] == EOS


def test_logprobs_top_n_sorted_and_sampled_logprob_is_log_softmax():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 80, generator=g) * 3
    rows = [row(logprobs=5), row(logprobs=0, temperature=0.0), row(), row(logprobs=20, temperature=0.7, top_k=10),
            row(logprobs=1, seed=3), row(logprobs=3, temperature=0.0)]
    tokens, lps = sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert lps is not None and len(lps) == 6
    assert lps[2] is None
    for i, (t, lp, r) in enumerate(zip(tokens, lps, rows)):
        if r.params.logprobs is None:
            continue
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
        assert len(lp.top) == r.params.logprobs
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want_ids = ref[i].topk(r.params.logprobs).indices.tolist() if r.params.logprobs else []
        assert [tid for tid, _ in lp.top] == want_ids
        for tid, v in lp.top:
            assert v == pytest.approx(ref[i, tid].item(), abs=1e-5)
    # greedy rows: the sampled token is the most likely one
    assert lps[5].top[0][0] == tokens[5]


def test_no_logprobs_requested_returns_none():
    logits = torch.randn(3, 20)
    _, lps = sample(logits, [row(), row(temperature=0.0), row(seed=1)])
    assert lps is None


# ---------------------------------------------------------------- messages

SP = SamplingParams(max_tokens=5, min_tokens=1, temperature=0.7, top_p=0.9, top_k=40, seed=123, stop=["\n\n", "END"],
                    stop_token_ids=[2, 7], ignore_eos=True, logprobs=3, skip_special_tokens=False)
LP = TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)])

MESSAGES = [
    SP,
    SamplingParams(),
    GenerateRequest("r1", prompt="hi", params=SP, stream=False),
    GenerateRequest("r2", prompt_token_ids=[1, 2, 3]),
    AbortRequest("r1"),
    LP,
    Usage(3, 4),
    Delta("r1", "text", [1, 2], "stop", [LP], Usage(3, 2), "END"),
    Delta("r1", "", [7], "stop", None, Usage(3, 1), 7),
    Delta("r1", "partial", [1]),
    Completion("r1", "abc", [1, 2], "length", None, [LP, LP], Usage(1, 2)),
    ErrorReply(None, "overloaded", "busy"),
    ErrorReply("r1", "too_long", "too long"),
    NewSeq(0, [1, 2, 3], 3, [0, 1], 0, 3, SP),
    SeqDelta(0, [4], [2], 1),
    StepPlan(0, [SeqDelta(0, [4], [], 1)], [NewSeq(1, [1], 1, [3], 0, 1, SamplingParams())], [5, 6]),
    StepPlan(1, [], [], []),
    Shutdown("bye"),
    Shutdown(),
    Hello("session-1"),
    StepResult(3, [0, 1], [10, 11], [LP, None]),
    StepResult(4, [], []),
    Ready(3, "session-1"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_message_round_trip(msg):
    wire = encoder().encode(msg)
    back = msgspec.msgpack.decode(wire, type=type(msg))
    assert back == msg
    assert encoder().encode(back) == wire


@pytest.mark.parametrize("msg", [m for m in MESSAGES if isinstance(m, (GenerateRequest, AbortRequest))],
                         ids=lambda m: type(m).__name__)
def test_client_decoder_round_trip(msg):
    assert client_decoder().decode(encoder().encode(msg)) == msg


@pytest.mark.parametrize("msg", [m for m in MESSAGES if isinstance(m, (Delta, ErrorReply))],
                         ids=lambda m: type(m).__name__)
def test_server_decoder_round_trip(msg):
    assert server_decoder().decode(encoder().encode(msg)) == msg


@pytest.mark.parametrize("msg", [m for m in MESSAGES if isinstance(m, (StepPlan, Shutdown, Hello))],
                         ids=lambda m: type(m).__name__)
def test_control_decoder_round_trip(msg):
    assert control_decoder().decode(encoder().encode(msg)) == msg


@pytest.mark.parametrize("msg", [m for m in MESSAGES if isinstance(m, (StepResult, Ready))],
                         ids=lambda m: type(m).__name__)
def test_rank_decoder_round_trip(msg):
    assert rank_decoder().decode(encoder().encode(msg)) == msg


def test_decoders_reject_each_others_messages():
    wrong = [(control_decoder(), StepResult(0, [], [])), (control_decoder(), GenerateRequest("r", prompt="x")),
             (rank_decoder(), StepPlan(0, [], [], [])), (server_decoder(), GenerateRequest("r", prompt="x")),
             (server_decoder(), Shutdown())]
    for decoder, msg in wrong:
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(encoder().encode(msg))


def test_client_decoder_rejects_server_and_control_messages():
    for msg in (Delta("r", "", []), StepPlan(0, [], [], []), Shutdown()):
        with pytest.raises(msgspec.ValidationError):
            client_decoder().decode(encoder().encode(msg))


def _generate(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "request_id": "r", "prompt": "hi", **fields})


def test_client_decoder_accepts_plain_dicts_and_bounds():
    ok = client_decoder().decode(_generate(params={"temperature": 0.0, "top_p": 1.0, "logprobs": 20, "max_tokens": 1,
                                                   "stop": ["x"] * 16}))
    assert isinstance(ok, GenerateRequest) and ok.params.logprobs == 20 and ok.params.greedy


@pytest.mark.parametrize("payload, where", [
    (_generate(bogus=1), "bogus"),
    (_generate(params={"temprature": 0.5}), "temprature"),
    (_generate(request_id=5), "request_id"),
    (_generate(request_id=""), "request_id"),
    (_generate(request_id="x" * 129), "request_id"),
    (_generate(prompt_token_ids=["a"]), "prompt_token_ids"),
    (_generate(prompt_token_ids=[-1]), "prompt_token_ids"),
    (_generate(prompt_token_ids=[1 << 31]), "prompt_token_ids"),
    (_generate(stream="yes"), "stream"),
    (_generate(params={"max_tokens": "10"}), "params.max_tokens"),
    (_generate(params={"temperature": -0.1}), "params.temperature"),
    (_generate(params={"temperature": 101.0}), "params.temperature"),
    (_generate(params={"top_p": 0.0}), "params.top_p"),
    (_generate(params={"top_p": 1.5}), "params.top_p"),
    (_generate(params={"logprobs": 21}), "params.logprobs"),
    (_generate(params={"max_tokens": 0}), "params.max_tokens"),
    (_generate(params={"min_tokens": -1}), "params.min_tokens"),
    (_generate(params={"top_k": -1}), "params.top_k"),
    (_generate(params={"seed": -1}), "params.seed"),
    (_generate(params={"stop": [""]}), "params.stop"),
    (_generate(params={"stop": ["x"] * 17}), "params.stop"),
    (_generate(params={"stop_token_ids": [-3]}), "params.stop_token_ids"),
    (_generate(params=[1, 2]), "params"),
    (msgspec.msgpack.encode({"type": "abort", "request_id": "r", "extra": True}), "extra"),
    (msgspec.msgpack.encode({"type": "shutdown"}), "type"),
    (msgspec.msgpack.encode({"request_id": "r"}), "type"),
    (msgspec.msgpack.encode(["generate", "r"]), ""),
])
def test_client_decoder_rejects_bad_requests(payload, where):
    with pytest.raises(msgspec.ValidationError) as e:
        client_decoder().decode(payload)
    assert where in str(e.value)
