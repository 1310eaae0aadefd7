"""Speculative decoding across ranks: the n-gram proposer, a draft model and Medusa heads at
tp = 3 and pp = 2 (two micro-batches in flight) give the greedy tokens and top-5 logprobs of
one rank without speculation, for a batch of prompts (prefills beside drafting decodes) with
prefix caching on and a second wave that reuses the first's blocks. The drafts are made on
the driver (the draft model, the target's int8 build, runs there whole; the heads' guesses
come back from the last stage's ranks with each step's tokens) and travel in the step plan;
the verify step flows through the stages like any step."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import SamplingParams
from meshserve.engine.offline import generate
from meshserve.parallel.topology import Topology
from support.checkpoints import make_checkpoint
from support.dist import run_ranks
from support.engine_ranks import as_results, assert_same, run_engine
from support.engines import make_engine
from support.heads import self_distilled_heads

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7], list(range(100, 140)) * 2, [3, 4] * 20,
           list(range(200, 260))]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5) for n in (40, 32, 36, 28)]
SECOND = [PROMPTS[1] + [7, 7, 7], PROMPTS[3][:40]]
SECOND_PARAMS = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)] * 2


def overrides(path, topology: Topology, spec: list[str] = ()) -> list[str]:
    return [f"model.path={path}", "model.max_model_len=256", "cache.memory=8MiB", "cache.block_size=4",
            f"parallel.tensor={topology.tp_size}", f"parallel.pipeline={topology.pp_size}", *spec]


@pytest.fixture(scope="module")
def looping(tmp_path_factory, tokenizer_dir):
    """Six heads and three KV heads (tp = 3 splits them); small weights, so the model falls into
    loops that the lookup catches, and out of them."""
    return make_checkpoint(tmp_path_factory.mktemp("spec-ranks") / "llama-6h", "llama-6h", seed=1,
                           initializer_range=0.09, tokenizer_from=tokenizer_dir)


@pytest.fixture(scope="module")
def reference(looping):
    engine = make_engine(looping, *overrides(looping, Topology())[1:])
    return as_results(generate(engine, PROMPTS, PARAMS) + generate(engine, SECOND, SECOND_PARAMS))


@pytest.fixture(scope="module")
def heads(looping, tmp_path_factory):
    return self_distilled_heads(looping, PROMPTS, tmp_path_factory.mktemp("heads") / "heads.safetensors")


TREE = "speculative.tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"
"""A candidate tree of the heads' guesses (Medusa's choices, small)."""


@pytest.mark.parametrize("method", ["ngram", "draft", "medusa", "medusa-tree"])
@pytest.mark.parametrize("topology", [Topology(tp_size=3), Topology(pp_size=2)], ids=["tp3", "pp2"])
def test_speculation_across_ranks_gives_the_output_of_one_rank_without_it(looping, reference, heads, topology,
                                                                          method):
    spec = ["speculative.adaptive=false", f"speculative.method={method.removesuffix('-tree')}"]
    # The draft: the model's own int8 build (it agrees with the float32 model often, not always).
    spec += {"ngram": ["speculative.prompt_lookup_min=1"],
             "draft": [f"speculative.model={looping}", "speculative.quantization=int8"],
             "medusa": [f"speculative.heads={heads}"],
             "medusa-tree": [f"speculative.heads={heads}", TREE]}[method]
    (got, stats), *_ = run_ranks(run_engine, topology, overrides(looping, topology, spec), PROMPTS, PARAMS,
                                 (SECOND, SECOND_PARAMS))
    assert_same(got, reference)
    assert stats["accepted_tokens"] >= 40 and stats["draft_tokens"] > stats["accepted_tokens"]
    assert any(r["cached_tokens"] for r in got[len(PROMPTS):])
