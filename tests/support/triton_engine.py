"""The whole engine with the Triton backend on the CPU, in Triton's interpreter (run as
`python -m support.triton_engine PATH LOOPING_PATH`, TRITON_INTERPRET=1 set by the caller before any
kernel is defined): greedy tokens and logprobs with device.kernels triton and torch; triton
with overlapped steps, with decode steps from graphs (the CPU stand-in), with n-gram
speculative decoding (block tables cut where drafts are rejected), and in a cache small
enough to preempt (tables sent again in full).
Prints them as one JSON line. The config refuses
device.kernels=triton on the CPU (the interpreter is for tests), so the engine is built
from the unvalidated config."""

from __future__ import annotations

import json
import sys

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.model_info import read_model_info
from meshserve.engine import build
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.offline import generate
from support.server import EXACT

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7] * 4]
PARAMS = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3, logprobs=0),
          SamplingParams(max_tokens=7, temperature=0.8, seed=2, ignore_eos=True)]


def run(path: str, kernels: str, overlap: bool, *extra: str, graphs: bool = False) -> dict:
    config = load_config(None, [EXACT, f"model.path={path}", "model.max_model_len=128", f"device.kernels={kernels}",
                                f"scheduler.overlap={str(overlap).lower()}", "scheduler.max_batched_tokens=16",
                                "cache.block_size=4", *extra])
    info = read_model_info(path)
    build.uses_decode_graphs = lambda _: graphs
    engine = build_single_rank_engine(config, info, plan_memory(config, info))
    done = generate(engine, PROMPTS, PARAMS)
    return {"backend": engine.executor.runner.model.backend.name, "tokens": [c.token_ids for c in done],
            "logprobs": [[lp.logprob for lp in c.logprobs or []] for c in done],
            "deferred": engine.executor.runner.stats.deferred_tokens,
            "preemptions": engine.scheduler.num_preemptions,
            "replays": engine.executor.runner.decode.graphs.replays if graphs else 0,
            "drafted": engine.speculator.stats.num_draft_tokens if engine.speculator else 0}


if __name__ == "__main__":
    path, looping = sys.argv[1:3]  # looping: small weights, whose output falls into loops the n-gram lookup catches
    ngram = ["speculative.method=ngram", "speculative.adaptive=false", "speculative.prompt_lookup_min=1"]
    small = ["model.max_model_len=48", "cache.num_blocks=12"]
    print(json.dumps({"torch": run(path, "torch", False), "triton": run(path, "triton", False),
                      "triton_overlap": run(path, "triton", True),
                      "triton_graphs_overlap": run(path, "triton", True, "scheduler.max_num_seqs=4", graphs=True),
                      "triton_preempted_overlap": run(path, "triton", True, *small),
                      "torch_looping": run(looping, "torch", False), "triton_ngram": run(looping, "triton", False, *ngram)}))
