"""Checks of the fused MoE Triton kernel (meshserve.layers.kernels.fused_moe) against a
float64 loop over the (token, slot) pairs, shared by the interpreter tests (CPU,
TRITON_INTERPRET=1) and, on a GPU, anyone who runs this module with --device cuda.

Each check returns a list of (what, error, tolerance) rows, as support.kernel_cases does;
output errors are relative to the reference's scale (its max abs). Nothing here imports
triton at module level: `python -m support.moe_kernel_cases` (cwd tests/) sets
TRITON_INTERPRET itself for --device cpu, before the kernel module is imported, and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MOE_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NUM_EXPERTS = 8
EMPTY_EXPERT = 3
"""Receives no token in the random routings."""
ONE_EXPERT = 5
"""Receives every token in the "all tokens to one expert" routing."""
SHAPES = [(64, 48), (32, 64)]
"""(hidden, inter): a non power-of-two inter, then an inter wider than hidden."""
NUM_TOKENS = [1, 7, 33]
TOP_KS = [1, 2]

Row = tuple[str, float, float]


# ---------------------------------------------------------------- inputs and reference


def route(kind: str, num_tokens: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """(num_tokens, top_k) expert ids, no id twice in a row (-1 aside). kind: "random"
    (expert EMPTY_EXPERT gets nothing), "one expert" (slot 0 of every token is ONE_EXPERT,
    the other slots -1), "some -1" (random, then about a third of the ids -1: slot 0 of the
    first token and, with more than one token, every slot of the last)."""
    if kind == "one expert":
        ids = torch.full((num_tokens, top_k), -1, dtype=torch.long)
        ids[:, 0] = ONE_EXPERT
    else:
        pool = torch.tensor([e for e in range(NUM_EXPERTS) if e != EMPTY_EXPERT])
        ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(num_tokens)])
        if kind == "some -1":
            ids[torch.rand(num_tokens, top_k, generator=g) < 0.3] = -1
            ids[0, 0] = -1
            if num_tokens > 1:
                ids[-1] = -1
    for row in ids.tolist():
        kept = [e for e in row if e >= 0]
        if len(set(kept)) != len(kept):
            raise ValueError(f"routing {kind!r} repeats an expert in a row: {row}")
    return ids


def moe_inputs(num_tokens: int, hidden: int, inter: int, top_k: int, kind: str, dtype: torch.dtype, device: str,
               seed: int):
    """(x, w13, w2, topk_ids, topk_weights); ids int32 when top_k is 2, else int64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=g) * inter ** -0.5
    ids = route(kind, num_tokens, top_k, g).to(torch.int32 if top_k == 2 else torch.long)
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), ids.to(device),
            weights.to(device))


def moe_reference(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """float64, one (token, slot) pair at a time, -1 skipped."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            h = w13[e].double().cpu() @ x[t].double().cpu()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double().cpu() @ act)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference over the reference's max abs (over 1e-30: an all-zero reference
    asks for exact zeros)."""
    diff = (got.double().cpu() - want).abs()
    return float(diff.max()) / max(float(want.abs().max()), 1e-30) if diff.numel() else 0.0


# ---------------------------------------------------------------- checks


def check_align(device: str, block_m: int = 16) -> list[Row]:
    """moe_align on every routing: each kept pair exactly once, in its expert's blocks; no
    -1 pair; each group padded up to the next multiple of block_m (num_padded) with the id
    num_pairs; blocks only for experts that receive pairs, in expert order, -1 past them."""
    from meshserve.layers.kernels.fused_moe import moe_align

    rows = []
    g = torch.Generator().manual_seed(7)
    for kind in ("random", "one expert", "some -1"):
        for n in NUM_TOKENS:
            for top_k in TOP_KS:
                ids = route(kind, n, top_k, g).to(device)
                sorted_ids, block_experts, num_padded = moe_align(ids, NUM_EXPERTS, block_m)
                sorted_ids, block_experts, num_padded = sorted_ids.cpu(), block_experts.cpu(), int(num_padded)
                flat = ids.reshape(-1).cpu()
                num_pairs = flat.numel()
                counts = torch.bincount(flat[flat >= 0], minlength=NUM_EXPERTS)
                want_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
                used = sorted_ids[:num_padded]
                is_pair = used < num_pairs
                real = used[is_pair].long()
                block_of = block_experts[:num_padded // block_m].repeat_interleave(block_m)  # expert of each slot
                kept = torch.nonzero(flat >= 0).flatten().tolist()
                with_pairs = set(torch.nonzero(counts).flatten().tolist())
                what = f"{kind}, {n} tokens, top_k {top_k}"
                rows += [
                    (f"{what}: num_padded", abs(num_padded - want_padded), 0.0),
                    (f"{what}: kept pairs once", float(sorted(real.tolist()) != kept), 0.0),
                    (f"{what}: pairs in their expert's blocks", float((flat[real] != block_of[is_pair]).sum()), 0.0),
                    (f"{what}: padding ids", float((sorted_ids[num_padded:] != num_pairs).sum()
                                                   + (used[~is_pair] != num_pairs).sum()), 0.0),
                    (f"{what}: blocks only for experts with pairs",
                     float(set(block_experts[block_experts >= 0].tolist()) != with_pairs), 0.0),
                    (f"{what}: block experts in order", float((block_of.diff() < 0).sum()), 0.0),
                    (f"{what}: -1 past the groups", float((block_experts[num_padded // block_m:] != -1).sum()), 0.0),
                ]
    return rows


def check_moe(dtype: torch.dtype, device: str, kind: str, block_sizes: tuple[int, int, int] | None = None,
              seed: int = 0) -> list[Row]:
    """fused_moe vs moe_reference for every shape, token count and top_k, on one routing."""
    from meshserve.layers.kernels.fused_moe import fused_moe

    rows = []
    for hidden, inter in SHAPES:
        for n in NUM_TOKENS:
            for top_k in TOP_KS:
                seed += 1
                x, w13, w2, ids, weights = moe_inputs(n, hidden, inter, top_k, kind, dtype, device, seed)
                out = fused_moe(x, w13, w2, ids, weights, block_sizes=block_sizes)
                want = moe_reference(x, w13, w2, ids, weights)
                what = f"hidden {hidden} inter {inter}, {n} tokens, top_k {top_k}"
                rows += [(what, rel_err(out, want), MOE_TOL[dtype]),
                         (f"{what}: dtype and shape", float(out.dtype != dtype or out.shape != x.shape), 0.0)]
                dropped = (ids < 0).all(dim=1)
                if dropped.any():
                    rows.append((f"{what}: tokens with only -1 ids give 0", float(out[dropped].abs().max()), 0.0))
    return rows


MOE_CHECKS = {
    # name: keyword arguments of check_moe
    "an expert with no tokens": dict(kind="random"),
    "all tokens to one expert": dict(kind="one expert"),
    "some -1 ids": dict(kind="some -1"),
    "blocks 16x16x16 (several N and K tiles)": dict(kind="some -1", block_sizes=(16, 16, 16)),
}


def run_moe_checks(dtypes: list[str], device: str) -> dict[str, list[Row]]:
    """"align" and `name|dtype` -> rows."""
    results = {"align": check_align(device)}
    for name, kwargs in MOE_CHECKS.items():
        for dtype in dtypes:
            results[f"{name}|{dtype}"] = check_moe(DTYPES[dtype], device, **kwargs)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    torch.set_num_threads(1)
    json.dump(run_moe_checks(args.dtypes, args.device), sys.stdout)


if __name__ == "__main__":
    main()
