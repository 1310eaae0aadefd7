"""LoRA on the embedding and the LM head, split by vocabulary as tensor parallelism splits
them (layers/lora_vocab.py, layers/lora.py), against the unsharded delta PEFT computes:
each rank's share summed (embedding) or concatenated (head) over ranks whose ranges end in
padding, with the C++ kernel where this machine builds it and the torch product."""

from __future__ import annotations

import math

import pytest
import torch

from meshserve.engine.lora.rank_adapters import lora_kernel
from meshserve.layers.kernels import cpu_library
from meshserve.layers.lora import LoraBatch, LoraPart, LoraStack
from meshserve.layers.lora_vocab import LoraEmbedding

VOCAB, HIDDEN, MAX_RANK, SLOTS = 10, 6, 4, 3
KERNELS = ["torch"] + (["cpp"] if cpu_library.load() is not None else [])


def adapters(seed=0):
    """slot -> (A, B, scaling) of the embedding (A (r, vocab), B (hidden, r)) and the head
    (A (r, hidden), B (vocab, r)); slot 2 targets neither."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for slot, r, scaling in [(0, 4, 2.0), (1, 2, 0.5)]:
        out[slot] = ((torch.randn(r, VOCAB, generator=g), torch.randn(HIDDEN, r, generator=g), scaling),
                     (torch.randn(r, HIDDEN, generator=g), torch.randn(VOCAB, r, generator=g), scaling))
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("tp", [1, 3])
def test_sharded_vocabulary_deltas_add_up_to_pefts(kernel, tp):
    weights = adapters()
    ids = torch.tensor([0, 9, 4, 7, 3, 9, 1])
    slots = [0, 1, -1, 2, 1, 0, 0]
    hidden = torch.randn(len(ids), HIDDEN, generator=torch.Generator().manual_seed(1))
    local = math.ceil(VOCAB / tp)
    library = cpu_library.load() if kernel == "cpp" else None
    embedded = torch.zeros(len(ids), HIDDEN)
    logits = []
    for rank in range(tp):
        product = lora_kernel(torch.device("cpu"), library)
        batch, head_batch = LoraBatch(product), LoraBatch(product)
        start = rank * local
        embedding = LoraEmbedding(batch, SLOTS, MAX_RANK, start, VOCAB, local, HIDDEN, torch.float32,
                                  torch.device("cpu"))
        rows = max(0, min(local, VOCAB - start))
        head = LoraStack(head_batch, [LoraPart("lm_head", 0, rows, start)], False, SLOTS, MAX_RANK, HIDDEN, local,
                         torch.float32, torch.device("cpu"))
        for slot in range(SLOTS):
            pair = weights.get(slot)
            embedding.load(slot, None if pair is None else pair[0][:2], 1.0 if pair is None else pair[0][2])
            head.load(slot, {} if pair is None else {"lm_head": pair[1][:2]}, 1.0 if pair is None else pair[1][2])
        batch.set(slots, torch.device("cpu"))
        head_batch.set(slots, torch.device("cpu"))
        embedded += embedding.apply(torch.zeros(len(ids), HIDDEN), ids)
        logits.append(head.apply(torch.zeros(len(ids), local), hidden))
    logits = torch.cat(logits, dim=1)
    if tp > 1:
        assert logits.shape[1] > VOCAB and logits[:, VOCAB:].abs().max() == 0, "the padding's logits stay zero"
    for row, (token, slot) in enumerate(zip(ids.tolist(), slots)):
        if slot not in weights:
            assert embedded[row].abs().max() == 0 and logits[row].abs().max() == 0
            continue
        (ea, eb, es), (ha, hb, hs) = weights[slot]
        torch.testing.assert_close(embedded[row], es * ea.T[token] @ eb.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[row, :VOCAB], hs * (hidden[row] @ ha.T) @ hb.T, rtol=1e-5, atol=1e-5)


def test_a_step_whose_adapters_leave_the_vocabulary_alone_skips_it():
    batch = LoraBatch()
    embedding = LoraEmbedding(batch, SLOTS, MAX_RANK, 0, VOCAB, VOCAB, HIDDEN, torch.float32, torch.device("cpu"))
    embedding.load(0, adapters()[0][0][:2], 1.0)
    y = torch.zeros(2, HIDDEN)
    batch.set([2, -1], torch.device("cpu"))
    assert embedding.apply(y, torch.tensor([1, 2])) is y
    batch.set([2, 0], torch.device("cpu"))
    assert embedding.apply(y, torch.tensor([1, 2]))[1].abs().max() > 0
