"""The whole engine on the Triton backend (attention, norms, rotary fused with the KV-cache
write, block tables kept between steps), run on the CPU in Triton's interpreter, in a
subprocess (TRITON_INTERPRET must be set before a kernel is defined): the torch backend's
greedy tokens and logprobs, and the same with overlapped steps, with graph replays, with
speculative decoding, and under preemption. Float32: bf16 `tl.dot` is wrong in the
interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.layers.kernels import triton_available
from support.checkpoints import make_checkpoint

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_the_engine_on_triton_kernels_generates_what_it_does_on_torch(tiny_checkpoints, tmp_path):
    looping = make_checkpoint(tmp_path / "looping", "llama", seed=1, initializer_range=0.09)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "support.triton_engine", str(tiny_checkpoints["llama"]), str(looping)],
                         cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["torch"]["backend"], r["triton"]["backend"]) == ("torch", "triton")
    for run in ("triton", "triton_overlap", "triton_graphs_overlap", "triton_preempted_overlap"):
        assert r[run]["tokens"] == r["torch"]["tokens"], run
        for got, want in zip(r[run]["logprobs"], r["torch"]["logprobs"]):
            assert got == pytest.approx(want, abs=1e-4)
    assert r["triton_overlap"]["deferred"] > 0 and r["triton"]["deferred"] == 0
    assert r["triton_graphs_overlap"]["replays"] > 0 and r["triton_graphs_overlap"]["deferred"] > 0
    assert r["triton_ngram"]["tokens"] == r["torch_looping"]["tokens"] and r["triton_ngram"]["drafted"] > 0
    assert r["triton_preempted_overlap"]["preemptions"] > 0 and r["triton_preempted_overlap"]["deferred"] > 0
