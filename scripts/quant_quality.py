"""What quantization costs in quality: each model.quantization against the unquantized
model, in the same dtype, on SmolLM2 (its GGUF's Q4_1 codes come back exactly under int4,
so int4 differs from the unquantized run only in rounding; w8a8 also rounds every linear's
input to 8 bits per row, after smoothing). A mode `Q+kv8` is model.quantization=Q with the
int8 KV cache (cache.dtype=int8).

- perplexity on a fixed text (scripts/data/perplexity.txt), prefilled in chunks of
  --chunk tokens, so that every chunk after the first reads the ones before it from the
  KV cache, as a served prompt's chunks and decodes do;
- greedy agreement: --prompts chat prompts, --output-len greedy tokens each; the share of
  all positions whose token matches the float32 unquantized run's (--reference-dtype), the
  prompts that match to the end, and the mean position of the first token that differs;
  the bf16 unquantized row is the floor: what bf16 rounding alone changes;
- decode tok/s of one stream, for the trade.

    python scripts/quant_quality.py [--dtype bfloat16] [--quantizations none int8 int4 w8a8 none+kv8 w8a8+kv8]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.offline import generate

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and what is it famous for?",
    "Give three tips for writing readable Python code.",
    "Summarize the plot of Romeo and Juliet.",
    "How does a refrigerator keep food cold?",
    "List the planets of the solar system in order.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a good breakfast for a long hike.",
    "Why do cats purr?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What causes the seasons on Earth?",
    "Write a short thank-you note to a teacher.",
    "How do vaccines train the immune system?",
    "Explain what a hash table is to a beginner.",
    "What should I pack for a weekend at the beach?",
]


@torch.inference_mode()
def perplexity(engine, token_ids: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood of each token given the ones before it), the
    text prefilled `chunk` tokens at a time."""
    runner = engine.executor.runner
    n = len(token_ids)
    table = list(range(-(-n // runner.memory.block_size)))
    logits = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = runner.model.backend.build_metadata([end - start], [end], [table], runner.memory.block_size)
        hidden, _ = runner.model(torch.tensor(token_ids[start:end]), torch.arange(start, end), runner.kv_caches, meta)
        logits.append(runner.model.compute_logits(hidden))
    nll = F.cross_entropy(torch.cat(logits)[:-1], torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


def one_stream_tok_s(engine, output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.add_request("speed", "speed", list(range(1000, 1128)), params)
    engine.step()  # prefill
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return (output_len - 1) / (time.perf_counter() - start)


def measure(args, dtype: str, mode: str, text: str) -> tuple[dict, list[list[int]]]:
    """One configuration: its perplexity, one-stream speed and greedy tokens."""
    quantization, _, kv = mode.partition("+")
    if kv not in ("", "kv8"):
        raise SystemExit(f"mode {mode!r}: QUANTIZATION or QUANTIZATION+kv8")
    config = load_config(None, [f"model.dtype={dtype}", f"model.quantization={quantization}", "model.max_model_len=1024",
                                f"cache.dtype={'int8' if kv else 'auto'}"])
    info = check_config(config)
    engine = build_single_rank_engine(config, info, plan_memory(config, info), threads=args.threads)
    ids = engine.tokenizer.encode(text)
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    tokens = [c.token_ids for c in generate(engine, chats, params)]
    row = {"quantization": mode, "dtype": dtype, "perplexity": perplexity(engine, ids, args.chunk), "text_tokens": len(ids),
           "one_stream_tok_s": one_stream_tok_s(engine, args.output_len),
           "weight_bytes": plan_memory(config, info).weight_bytes}
    return row, tokens


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    same = sum(a == b for ours, ref in zip(tokens, reference) for a, b in zip(ours, ref))
    first = [next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
             for ours, ref in zip(tokens, reference)]
    return {"greedy_token_agreement": same / sum(len(ref) for ref in reference),
            "greedy_prompts_identical": sum(ours == ref for ours, ref in zip(tokens, reference)) / len(reference),
            "greedy_mean_first_divergence": sum(first) / len(first)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4", "w8a8", "none+kv8", "w8a8+kv8"],
                    help="modes: a model.quantization, +kv8 for the int8 KV cache")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk of the perplexity text")
    ap.add_argument("--reference-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the unquantized run the greedy tokens are compared with (float32: the bf16 "
                         "unquantized row then shows what bf16 rounding alone changes)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="results/quant_quality.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = (HERE / "data" / "perplexity.txt").read_text()
    runs = [(args.reference_dtype, "none")] + [(args.dtype, q) for q in args.quantizations
                                               if (args.dtype, q) != (args.reference_dtype, "none")]
    rows, reference = [], None
    for dtype, quantization in runs:
        row, tokens = measure(args, dtype, quantization, text)
        reference = reference or tokens
        row |= agreement(tokens, reference)
        rows.append(row)
        print(f"{dtype:<8} quantization={quantization:<8} perplexity {row['perplexity']:7.3f} ({row['text_tokens']} "
              f"tokens)  greedy tokens agreeing {100 * row['greedy_token_agreement']:5.1f}%, prompts identical "
              f"{round(row['greedy_prompts_identical'] * len(reference))}/{len(reference)}, first divergence at token "
              f"{row['greedy_mean_first_divergence']:.1f} on average  one stream {row['one_stream_tok_s']:6.1f} tok/s",
              flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reference": f"{args.reference_dtype} unquantized", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
