"""The whole engine with the Triton backend on the CPU, in Triton's interpreter (run as
`python -m support.triton_engine PATH`, TRITON_INTERPRET=1 set by the caller before any
kernel is defined): greedy tokens and logprobs with device.kernels triton and torch, and
triton with overlapped steps. Prints them as one JSON line. The config refuses
device.kernels=triton on the CPU (the interpreter is for tests), so the engine is built
from the unvalidated config."""

from __future__ import annotations

import json
import sys

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.model_info import read_model_info
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.offline import generate
from support.server import EXACT

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(300, 341)), [5, 6, 7]]
PARAMS = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3, logprobs=0),
          SamplingParams(max_tokens=7, temperature=0.8, seed=2, ignore_eos=True)]


def run(path: str, kernels: str, overlap: bool) -> dict:
    config = load_config(None, [EXACT, f"model.path={path}", "model.max_model_len=128", f"device.kernels={kernels}",
                                f"scheduler.overlap={str(overlap).lower()}", "scheduler.max_batched_tokens=16",
                                "cache.block_size=4"])
    info = read_model_info(path)
    engine = build_single_rank_engine(config, info, plan_memory(config, info))
    done = generate(engine, PROMPTS, PARAMS)
    return {"backend": engine.executor.runner.model.backend.name, "tokens": [c.token_ids for c in done],
            "logprobs": [[lp.logprob for lp in c.logprobs or []] for c in done],
            "deferred": engine.executor.runner.stats.deferred_tokens}


if __name__ == "__main__":
    path = sys.argv[1]
    print(json.dumps({"torch": run(path, "torch", False), "triton": run(path, "triton", False),
                      "triton_overlap": run(path, "triton", True)}))
