"""`meshserve advise`: which dtype and quantization serve this model fastest on the machine
at hand, measured in-process in well under a minute for a small model.

Each candidate path (meshserve.configs.auto_choice.CANDIDATES, less those the CPU refuses)
builds one single-rank engine at the thread count a rank of the config runs, then times:
the prefill of one PROMPT_LEN-token prompt, and decode steps at batch 1 and at batch B
(the config's scheduler.max_num_seqs, at most 32), the batch made of B requests for the
same prompt, so the prefix cache spares B - 1 prefills. From those it estimates the output
tokens/s of B streams of PROMPT_LEN-token prompts and OUTPUT_LEN output tokens:

    tok/s(B) = B * OUTPUT_LEN / (B * prefill + OUTPUT_LEN * decode_step(B))

batch 1 for latency (one stream), batch B for throughput. The record it writes is what
`model.quantization: auto` then takes on this machine (configs/auto_choice.py).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from meshserve.comm.messages import SamplingParams
from meshserve.configs import ConfigError, load_config
from meshserve.configs.auto_choice import ADVICE_VERSION, CANDIDATES, Candidate, advice_path, threads_per_rank
from meshserve.configs.artifact_cache import write_atomically
from meshserve.configs.cpu_features import cpu_features
from meshserve.configs.memory import plan_memory
from meshserve.configs.schema import Config
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine

PROMPT_LEN = 128
OUTPUT_LEN = 128
DECODE_STEPS = 5
MAX_BATCH = 32


@dataclass
class Measured:
    name: str
    prefill_ms: float | None = None
    """One PROMPT_LEN-token prompt."""
    decode_ms: dict[int, float] = field(default_factory=dict)
    """Median decode step time by batch size."""
    build_s: float | None = None
    refused: str | None = None

    def tok_s(self, batch: int) -> float | None:
        if self.refused or batch not in self.decode_ms:
            return None
        return 1000 * batch * OUTPUT_LEN / (batch * self.prefill_ms + OUTPUT_LEN * self.decode_ms[batch])


def measure_config(base: Config, candidate: Candidate, threads: int, batch: int) -> Measured:
    """One candidate on one rank of `threads` threads (its speed, or why it cannot run)."""
    result = Measured(candidate.name)
    try:
        config = load_config(None, [f"model.path={base.model.path}", *candidate.overrides(),
                                    f"model.max_model_len={PROMPT_LEN + 64}", f"scheduler.max_num_seqs={batch}",
                                    f"device.kernels={base.device.kernels}", f"device.cpu_isa={base.device.cpu_isa}",
                                    "device.cpu_bind=none", "cache.prefix_caching=true",
                                    *([f"model.tokenizer={base.model.tokenizer}"] if base.model.tokenizer else [])])
        info = check_config(config)
    except ConfigError as e:
        result.refused = str(e).removeprefix("<builtin default>: ")
        return result
    start = time.perf_counter()
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=threads)
    result.build_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(0)
    warm, prompt = torch.randint(info.vocab_size // 8, info.vocab_size // 2, (2, PROMPT_LEN), generator=g).tolist()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    _run(engine, "warm-up", warm, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.add_request("first", "first", prompt, params)
    result.prefill_ms = 1000 * _until_tokens(engine, {"first"})
    result.decode_ms[1] = _decode_steps(engine)
    if batch > 1:
        keys = {f"more-{i}" for i in range(batch - 1)}
        for key in keys:
            engine.add_request(key, key, prompt, params)
        _until_tokens(engine, keys)
        result.decode_ms[batch] = _decode_steps(engine)
    return result


def _run(engine, key: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(key, key, prompt, params)
    while engine.has_work():
        engine.step()


def _until_tokens(engine, keys: set[str]) -> float:
    """Step until each of `keys` has its first token; the seconds it took."""
    waiting = set(keys)
    start = time.perf_counter()
    while waiting:
        for key, delta in engine.step():
            if delta.token_ids:
                waiting.discard(key)
    return time.perf_counter() - start


def _decode_steps(engine) -> float:
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


@dataclass
class Advice:
    threads: int
    batch: int
    cpu: str
    measured: list[Measured]
    path: str = ""

    def best(self, batch: int) -> Measured:
        runs = [m for m in self.measured if m.tok_s(batch)]
        return max(runs, key=lambda m: m.tok_s(batch))

    def record(self) -> dict:
        """What configs/auto_choice.py reads: each candidate's estimated tok/s per target."""
        return {"version": ADVICE_VERSION, "cpu": self.cpu, "threads": self.threads, "batch": self.batch,
                "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                "choice": {"latency": self.best(1).name, "throughput": self.best(self.batch).name},
                "candidates": {m.name: {"latency": m.tok_s(1), "throughput": m.tok_s(self.batch), **asdict(m)}
                               for m in self.measured}}


def advise(config: Config, progress: Callable[[str], None] = print, candidates: tuple[Candidate, ...] = CANDIDATES,
           write: bool = True) -> Advice:
    """Measure every candidate for `config`'s model on this machine; record the result where
    `model.quantization: auto` finds it (unless `write` is False)."""
    threads = threads_per_rank(config)
    batch = min(MAX_BATCH, config.scheduler.max_num_seqs)
    cpu = cpu_features()
    measured = []
    for c in candidates:
        progress(f"measuring {c.name} ({threads} threads) ...")
        m = measure_config(config, c, threads, batch)
        measured.append(m)
        progress(f"  {c.name}: refused: {m.refused}" if m.refused else
                 f"  {c.name}: prefill {m.prefill_ms:.0f} ms, decode step {m.decode_ms[1]:.1f} ms at batch 1, "
                 f"{m.decode_ms.get(batch, m.decode_ms[1]):.1f} ms at batch {batch}")
    advice = Advice(threads, batch, cpu.describe(), measured)
    if write and any(m.tok_s(1) for m in measured):
        path = advice_path(config, cpu, threads)
        write_atomically(path, json.dumps(advice.record(), indent=1).encode())
        advice.path = str(path)
    return advice


def report(advice: Advice) -> str:
    """The table and the two choices, with the settings to use."""
    b = advice.batch
    lines = [f"{PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens, one rank of {advice.threads} threads; "
             f"CPU: {advice.cpu}",
             f"{'path':<18}{'prefill':>9}{'step b=1':>10}{f'step b={b}':>11}{'c=1 tok/s':>11}{f'c={b} tok/s':>12}"]
    for m in advice.measured:
        if m.refused:
            lines.append(f"{m.name:<18}refused: {m.refused}")
            continue
        lines.append(f"{m.name:<18}{m.prefill_ms:>7.0f}ms{m.decode_ms[1]:>8.1f}ms"
                     f"{m.decode_ms.get(b, float('nan')):>9.1f}ms{m.tok_s(1):>11.1f}{(m.tok_s(b) or 0):>12.1f}")
    for target, batch in (("latency (c=1)", 1), (f"throughput (c={b})", b)):
        best = advice.best(batch)
        base = next((m for m in advice.measured if m.name == "float32" and m.tok_s(batch)), None)
        versus = f", {best.tok_s(batch) / base.tok_s(batch):.2f}x float32" if base else ""
        dtype, _, quantization = best.name.partition("+")
        lines.append(f"for {target}: {best.name} ({best.tok_s(batch):.1f} tok/s{versus}): "
                     f"--set model.dtype={dtype} --set model.quantization={quantization or 'none'}")
    lines.append("(eager steps: device.compile is not measured here; it compiles for a minute or more at start-up)")
    if advice.path:
        lines.append(f"recorded for `model.quantization: auto` on this machine: {advice.path}")
    return "\n".join(lines)
