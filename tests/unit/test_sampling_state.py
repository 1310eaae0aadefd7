"""The sampler's device-resident state (layers/sampling_state.py) against its own list-built
path (layers/logits_processors.py, whose tests hold it to vLLM's arithmetic): over steps of
a changing batch (sequences that join, leave, are sent again in full, verify drafts), the
penalized logits and the drawn tokens are the same, bit for bit, in the C++ sampler and in
torch ops."""

from __future__ import annotations

import pytest
import torch

from meshserve.comm.messages import SamplingParams
from meshserve.layers.sampler import Sampler, SamplingRow
from meshserve.layers.sampling_state import SamplingState

VOCAB = 300
EOS = 2
PARAMS = [
    SamplingParams(temperature=0, repetition_penalty=1.4),
    SamplingParams(temperature=0.8, top_k=20, frequency_penalty=0.7, seed=3),
    SamplingParams(temperature=1.0, top_p=0.8, presence_penalty=1.1, repetition_penalty=0.9),
    SamplingParams(temperature=0.6, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0, frequency_penalty=-0.5, presence_penalty=0.3, logit_bias=[(7, 2.0)]),
    SamplingParams(temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.2, presence_penalty=0.2),
]


def test_steps_of_a_changing_batch_sample_what_the_lists_sample(backend):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (20,), generator=g)]
    seqs: dict[int, list[int]] = {}
    prompt_lens: dict[int, int] = {}
    state = SamplingState(VOCAB, "cpu")
    with_state, with_lists = Sampler((EOS,), 5, backend, state), Sampler((EOS,), 5, backend)
    for step in range(12):
        for seq_id in range(min(20, 2 * step + 2)):  # two more sequences join each step, 20 (past 16 slots) in all
            if seq_id not in seqs:
                seqs[seq_id], prompt_lens[seq_id] = list(prompts[seq_id]), len(prompts[seq_id])
        if step == 5:  # 1 dropped (it comes back afresh next step); 4 sent again in full (preempted)
            state.forget([1, 4])
            del seqs[1]
            seqs[4] = seqs[4][:prompt_lens[4] + 2]
        ids = sorted(seqs)
        drafts = {s: torch.randint(0, VOCAB, (2,), generator=g).tolist() for s in ids if step % 3 == 2 and s % 2}
        rows, by_list, order = [], [], []
        for s in ids:
            tokens = seqs[s] + drafts.get(s, [])
            for j in range(len(drafts.get(s, [])) + 1):
                p = PARAMS[s % len(PARAMS)]
                known = len(seqs[s])
                rows.append(SamplingRow(p, known + j, prompt_lens[s], tokens, s, known))
                by_list.append(SamplingRow(p, known + j, prompt_lens[s], tokens))
                order.append(s)
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        a, b = logits.clone(), logits.clone()
        got = with_state.sample(a, rows)
        want = with_lists.sample(b, by_list)
        assert torch.equal(a, b), f"step {step}: the penalized logits differ"
        assert got.tokens.tolist() == want.tokens.tolist()
        if drafts:  # a speculative step: each sequence keeps its first draft and the token after it
            kept, at = [], 0
            for s in ids:
                n = len(drafts.get(s, []))
                kept.append(drafts[s][:1] + [int(want.tokens[at + 1])] if n else [int(want.tokens[at])])
                at += n + 1
            state.record(ids, kept)
        else:
            kept = [[t] for t in want.tokens.tolist()]
            state.record(ids, got.tokens)
        for s, k in zip(ids, kept):
            seqs[s] += k
    penalized = [p for p in PARAMS if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty]
    assert len(state) == len(seqs) == 20
    assert state.num_counted == sum(1 for s in seqs if PARAMS[s % len(PARAMS)] in penalized)


def test_a_deferred_token_is_never_counted_from_the_lists():
    state = SamplingState(VOCAB, "cpu")
    row = SamplingRow(SamplingParams(repetition_penalty=1.5), 4, 2, [5, 6, 7, -1], 3, 4)
    with pytest.raises(RuntimeError, match="deferred"):
        Sampler((EOS,), 0, None, state).sample(torch.randn(1, VOCAB), [row])
