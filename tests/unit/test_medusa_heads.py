"""Medusa heads (layers/medusa.py) and their training script: the file round trip and its
errors, a new head guessing what the LM head does, and the script's data lined up with the
model's own greedy answers (the LM head on its hidden rows gives them back), end to end on a
tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from meshserve.layers.medusa import MedusaHeads
from support.engines import make_engine
from support.scripts import SCRIPTS, script_module


def test_heads_file_round_trip_and_its_errors(tmp_path):
    heads = MedusaHeads(16, num_heads=3, num_layers=2)
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    heads.save(tmp_path / "h.safetensors")
    loaded = MedusaHeads.load(tmp_path / "h.safetensors", 16)
    x = torch.randn(5, 16)
    assert (loaded.num_heads, loaded.num_layers) == (3, 2)
    assert torch.equal(loaded(x), heads(x))
    with pytest.raises(ValueError, match="heads for hidden_size=16, the model has 32"):
        MedusaHeads.load(tmp_path / "h.safetensors", 32)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a Medusa heads file"):
        MedusaHeads.load(tmp_path / "other.safetensors", 16)


def test_a_new_head_passes_the_hidden_state_through():
    x = torch.randn(4, 8)
    out = MedusaHeads(8, num_heads=2)(x)
    assert out.shape == (2, 4, 8) and torch.equal(out[0], x) and torch.equal(out[1], x)


def test_the_lm_head_on_the_scripts_hidden_rows_gives_the_greedy_answers_back(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    with script_module("train_heads") as train:
        engine = make_engine(path, "scheduler.max_num_seqs=8")
        convs = train.conversations(engine, ["tea", "maps"], max_tokens=10)
        from meshserve.comm.groups import AxisGroup
        from meshserve.layers.loader import build_model

        model = build_model(engine.executor.runner.model.info, AxisGroup.single("tp"), torch.float32,
                            max_position=256)
        hidden = train.final_hidden(model, convs, model.info.hidden_size, tokens_per_batch=200)
        lm_head = train.lm_head_matrix(model.info)
        x, y = train.examples(hidden, convs, num_heads=2)
    assert len(convs) == 2 * len(train.TEMPLATES)
    for h, (_, answer) in zip(hidden, convs):
        assert (h @ lm_head.T).argmax(-1).tolist() == answer
    assert y[0].tolist() == convs[0][1][1:3]  # head 1: the token after the next; head 2: the one after that
    assert (y[len(convs[0][1]) - 1] == -100).all()  # the answer's last position has nothing after it


@pytest.mark.slow
def test_the_training_script_writes_heads_that_load(tiny_checkpoints, tmp_path):
    out = tmp_path / "heads.safetensors"
    run = subprocess.run([sys.executable, str(SCRIPTS / "train_heads.py"), "--model", str(tiny_checkpoints["llama"]),
                          "--heads", "2", "--max-tokens", "12", "--topics", "3", "--epochs", "3", "--batch", "64",
                          "--lr", "1e-2",
                          "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.with_suffix(".json").read_text())
    assert figures["epochs"] == 3 and figures["optimizer_steps"] > 0
    assert figures["epoch_losses"][-1] < figures["epoch_losses"][0]
    assert all(0 <= a <= 1 for a in figures["trained"]["top1"])
    assert MedusaHeads.load(out, hidden_size=64).num_heads == 2
