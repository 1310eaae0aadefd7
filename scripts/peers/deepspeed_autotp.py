"""Peer: DeepSpeed AutoTP (`deepspeed.init_inference(..., tensor_parallel={"tp_size": N})`)
running transformers `generate` on CPU with gloo. Start it with torchrun or the deepspeed
launcher (LOCAL_SIZE set for DeepSpeed's shared-memory all-reduce); rank 0 writes JSON.

    LOCAL_SIZE=2 torchrun --nproc-per-node 2 scripts/peers/deepspeed_autotp.py --model DIR --output FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    path = Path(args.model)
    if path.is_file():  # a GGUF: transformers dequantizes it
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[args.dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[args.dtype])
    model = model.eval()
    model = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=DTYPES[args.dtype],
                                     replace_with_kernel_inject=False).module
    rows = []
    for batch in args.batch_sizes:
        ids = torch.randint(1000, 40000, (batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                                     min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
            times.append(time.perf_counter() - start)
            if out.shape[1] != args.prompt_len + args.output_len:
                raise RuntimeError(f"generated {out.shape[1] - args.prompt_len} tokens, not {args.output_len}")
        rows.append({"batch": batch, "tok_s": batch * args.output_len / statistics.median(times), "seconds": times})
    if dist.get_rank() == 0:
        with open(args.output, "w") as f:
            json.dump({"peer": "deepspeed-autotp", "tp": world, "dtype": args.dtype, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
