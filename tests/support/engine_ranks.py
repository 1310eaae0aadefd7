"""The whole engine on gloo ranks: rank 0 drives (scheduler, control plane), the others
follow its plans, exactly as under a launcher; the driver's completions come back."""

from __future__ import annotations

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.offline import generate
from meshserve.launcher.env import RankEnv
from meshserve.launcher.rank import run_in_world
from support.server import EXACT


class CollectMode:
    """Generates `prompts` with `params`; then, if given, the `then` prompts and params (a
    second wave, after the first finished: it can reuse the first's cached prefixes)."""

    def __init__(self, prompts, params, then=None):
        self.prompts, self.params, self.then, self.results = prompts, params, then, None

    def prepare(self, config, tokenizer, info, memory) -> None:
        pass

    def run(self, engine) -> int:
        completions = generate(engine, self.prompts, self.params)
        if self.then is not None:
            completions += generate(engine, *self.then)
        self.results = as_results(completions)
        self.stats = {"preemptions": engine.scheduler.num_preemptions, "steps": engine.stats.steps,
                      "deferred_tokens": engine.executor.runner.stats.deferred_tokens}
        sp = engine.executor.runner.model.model.sp
        if sp is not None:
            self.stats["steps_split"] = sp.steps_split
        if engine.speculator is not None:
            spec = engine.speculator.stats
            self.stats |= {"draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens}
        return 0


def as_results(completions) -> list[dict]:
    """What run_engine returns of each completion (picklable, for assert_same)."""
    return [{"token_ids": c.token_ids, "finish_reason": c.finish_reason,
             "logprobs": [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or []],
             "cached_tokens": c.usage.cached_tokens} for c in completions]


def run_engine(groups, overrides: list[str], prompts: list[list[int]], params: list[SamplingParams], then=None):
    """On every rank of the harness's world, in float32 unless `overrides` say otherwise; returns
    (results, stats) on the driver, None elsewhere."""
    config = load_config(None, [EXACT, *overrides])
    info = check_config(config)
    mode = CollectMode(prompts, params, then)
    env = RankEnv(global_rank=groups.global_rank, world_size=groups.world_size, local_world_size=groups.world_size)
    run_in_world(config, info, plan_memory(config, info), env, mode, groups)
    return (mode.results, mode.stats) if groups.is_driver else None


def assert_same(got, want):
    """run_engine's results agree: the same greedy tokens, the same top-5 logprobs within 1e-4."""
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        for (gt, glp, gtop), (wt, wlp, wtop) in zip(g["logprobs"], w["logprobs"]):
            assert gt == wt and abs(glp - wlp) < 1e-4
            assert [t for t, _ in gtop] == [t for t, _ in wtop]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(gtop, wtop))
