"""Draft heads (layers/medusa.py) and their training script: the file round trip and its
errors, a new head guessing what the LM head does, a sequential head reading the tokens
before its guess (and nothing of a token outside the draft vocabulary), and the script's
data lined up with the model's own greedy answers (the LM head on its hidden rows gives them
back), end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from meshserve.layers.matmul import bf16_exact
from meshserve.layers.medusa import MedusaHeads
from support.engines import make_engine
from support.scripts import SCRIPTS, script_module

VOCAB = torch.tensor([7, 3, 11, 20, 5])


def random_heads(hidden: int, num_heads: int, sequential: bool, num_layers: int = 1) -> MedusaHeads:
    heads = MedusaHeads(hidden, num_heads, VOCAB, torch.randn(len(VOCAB), hidden), 32, num_layers, sequential)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads


@pytest.mark.parametrize("sequential", [True, False])
def test_heads_file_round_trip_and_its_errors(tmp_path, sequential):
    heads = random_heads(16, 3, sequential, num_layers=2)
    heads.save(tmp_path / "h.safetensors")
    loaded = MedusaHeads.load(tmp_path / "h.safetensors", 16, 32)
    x, first = torch.randn(5, 16), torch.tensor([7, 3, 0, 20, 31])
    assert (loaded.num_heads, loaded.num_layers, loaded.sequential) == (3, 2, sequential)
    assert torch.equal(loaded.vocab, VOCAB) and torch.equal(loaded.lm_rows, heads.lm_rows)
    assert torch.equal(loaded.guess(x, first), heads.guess(x, first))
    with pytest.raises(ValueError, match="heads for hidden_size=16, the model has 32"):
        MedusaHeads.load(tmp_path / "h.safetensors", 32, 32)
    with pytest.raises(ValueError, match="heads for a vocabulary of 32 tokens, the model has 40"):
        MedusaHeads.load(tmp_path / "h.safetensors", 16, 40)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a Medusa heads file"):
        MedusaHeads.load(tmp_path / "other.safetensors", 16, 32)


@pytest.mark.parametrize("sequential", [True, False])
def test_a_new_head_guesses_what_the_lm_head_does(sequential):
    heads = MedusaHeads(8, 2, VOCAB, torch.randn(len(VOCAB), 8), 32, sequential=sequential)
    x = torch.randn(6, 8)
    lm = VOCAB[(x @ heads.lm_rows.T).argmax(-1)]
    assert torch.equal(heads.guess(x, torch.zeros(6, dtype=torch.long)), torch.stack([lm, lm], -1))


def test_a_sequential_head_reads_the_tokens_before_its_guess():
    """Head 2's guess is what its logits given token t+1 and head 1's guess pick; a token
    outside the draft vocabulary reads as zeros, and Medusa heads read no tokens at all."""
    heads = random_heads(8, 2, sequential=True)
    x = torch.randn(4, 8)
    first = torch.tensor([7, 3, 11, 5])
    guesses = heads.guess(x, first)
    teacher = torch.stack([first, guesses[:, 0]], -1)
    assert torch.equal(VOCAB[heads(x, teacher).argmax(-1)].T, guesses)
    swapped = torch.stack([torch.tensor([3, 7, 5, 11]), guesses[:, 0]], -1)
    assert not torch.allclose(heads(x, swapped)[0], heads(x, teacher)[0])  # head 1 reads token t+1
    assert torch.equal(heads.token_vectors(torch.tensor([4, 20])),
                       torch.stack([torch.zeros(8), heads.lm_rows[3]]))
    medusa = random_heads(8, 2, sequential=False)
    assert torch.equal(medusa.guess(x, first), medusa.guess(x, torch.tensor([3, 7, 5, 11])))


def test_the_lm_head_on_the_scripts_hidden_rows_gives_the_greedy_answers_back(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with script_module("train_heads") as train:
        engine = make_engine(path, "scheduler.max_num_seqs=8")
        convs, hidden = train.conversations(engine, ["tea", "maps"], max_tokens=10)
        lm_head = train.lm_head_matrix(engine.executor.runner.model.info)
        x, y = train.examples(hidden, convs, num_heads=2)
        vocab = train.draft_vocab(convs, 5)
    assert len(convs) == 2 * len(train.TEMPLATES)
    for h, (_, answer) in zip(hidden, convs):
        assert (h @ lm_head.T).argmax(-1).tolist() == answer
    assert y[0].tolist() == convs[0][1][:3]  # the LM head's token, then head 1's target, then head 2's
    assert (y[len(convs[0][1]) - 1, 1:] == -100).all()  # the answer's last position has nothing after it
    counts = torch.bincount(torch.tensor([t for _, a in convs for t in a]))
    assert len(vocab) == 5 and counts[vocab].min() >= counts.sort(descending=True).values[4]


@pytest.mark.slow
def test_the_training_script_writes_heads_that_load(tiny_checkpoints, tmp_path):
    out = tmp_path / "heads.safetensors"
    run = subprocess.run([sys.executable, str(SCRIPTS / "train_heads.py"), "--model", str(tiny_checkpoints["llama"]),
                          "--heads", "2", "--max-tokens", "12", "--topics", "3", "--epochs", "3", "--batch", "64",
                          "--lr", "1e-2", "--vocab", "50",
                          "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.with_suffix(".json").read_text())
    assert figures["epochs"] == 3 and figures["optimizer_steps"] > 0 and figures["draft_vocab"] <= 50
    assert figures["epoch_losses"][-1] < figures["epoch_losses"][0]
    assert all(0 <= a <= 1 for a in figures["trained"]["top1"])
    heads = MedusaHeads.load(out, hidden_size=64, vocab_size=figures_vocab(tiny_checkpoints["llama"]))
    assert heads.num_heads == 2 and heads.sequential
    weights = [block.linear.weight for head in heads.heads for block in head]
    assert all(bf16_exact(w) and w.abs().sum() > 0 for w in [*weights, heads.lm_rows])  # half the bytes to read


def figures_vocab(path) -> int:
    from meshserve.configs.model_info import read_model_info

    return read_model_info(str(path)).vocab_size


@pytest.mark.parametrize("sequential", [True, False])
def test_a_trees_nodes_are_the_heads_top_guesses_under_their_parents(sequential):
    """tree_guess: the chain of first guesses is guess()'s; a node (i1, ..., id) holds the
    i_d-th best guess of head d given its parent's path (sequential) or alone (Medusa)."""
    heads = random_heads(8, 3, sequential)
    x, first = torch.randn(5, 8), torch.tensor([7, 3, 11, 5, 20])
    paths = [(0,), (0, 0), (0, 0, 0), (0, 1), (1,), (1, 0), (2,)]
    nodes = heads.tree_guess(x, first, paths)
    assert nodes.shape == (5, len(paths))
    assert torch.equal(nodes[:, :3], heads.guess(x, first))
    second = VOCAB[heads(x, torch.stack([first, nodes[:, 4], nodes[:, 4]], -1))[1].topk(1, -1).indices[:, 0]]
    want_under_1 = second if sequential else nodes[:, 1]  # Medusa: head 2's best guess whatever the parent
    assert torch.equal(nodes[:, 5], want_under_1)
    top3 = VOCAB[heads(x, torch.stack([first, first, first], -1))[0].topk(3, -1).indices]
    assert torch.equal(nodes[:, [0, 4, 6]], top3)
