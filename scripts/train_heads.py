"""Self-distilled draft heads (meshserve.layers.medusa: sequential or Medusa) for a model,
trained on this CPU.

1. Prompts: a fixed set of chat requests (every template below about every topic), the
   topics split into a training set and a held-out set.
2. The frozen model answers each greedily through meshserve's engine: the heads learn the
   model's own outputs (self-distillation), so no dataset is needed and what they learn is
   what the model will write when it serves.
3. One prefill per batch of conversations (prompt and answer) gives the final-normed hidden
   state of every answer position.
4. The draft vocabulary: the answers' --vocab most frequent tokens, with the LM head's rows
   of them. Head k learns the answer token k places after the one the LM head takes from
   the same position (a sequential head reading the answer tokens between), by
   cross-entropy over the draft vocabulary through those frozen rows (AdamW), until
   --minutes have passed since the start or --epochs are done.
5. It prints, on the held-out answers, each head's top-1 and top-`--top-k` accuracy and the
   tokens per step a chain of the heads' first guesses would give greedy decoding, writes the
   heads file and a JSON of the figures.

    python scripts/train_heads.py [--model builtin:smollm2-135m-instruct] [--heads 3]
        [--kind sequential|medusa] [--minutes 20] [--output results/smollm2-medusa.safetensors]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F

from meshserve.comm.groups import AxisGroup
from meshserve.comm.messages import SamplingParams
from meshserve.configs import load_config
from meshserve.configs.memory import plan_memory
from meshserve.configs.validate import check_config
from meshserve.engine.build import build_single_rank_engine
from meshserve.engine.offline import generate
from meshserve.layers.attention import build_attention_metadata
from meshserve.layers.kernels import cpu_library
from meshserve.layers.loader import build_model
from meshserve.layers.medusa import MedusaHeads
from meshserve.layers.weights import iter_checkpoint

TEMPLATES = [
    "Explain {} in simple terms.", "Write a short paragraph about {}.", "What are three facts about {}?",
    "Give me some advice about {}.", "Why is {} important?", "Describe the history of {} briefly.",
    "Write a short poem about {}.", "What are the pros and cons of {}?", "How would you teach a child about {}?",
    "Summarize what people should know about {}.", "Tell me a fun fact about {}.",
    "What is a common misconception about {}?", "How do I get started with {}?",
    "Can you recommend a good way to learn about {}?", "Write a friendly note to a friend about {}.",
]
TOPICS = [
    "the ocean", "volcanoes", "photosynthesis", "the moon", "bicycles", "coffee", "the internet", "bees",
    "rain forests", "chess", "music", "electricity", "the Roman Empire", "sleep", "vaccines", "gardening",
    "mountains", "trains", "honey", "recycling", "friendship", "the solar system", "bread", "exercise",
    "libraries", "dinosaurs", "clouds", "computers", "the desert", "saving money", "birds", "cooking pasta",
    "learning a language", "rivers", "the brain", "robots", "tea", "snow", "maps", "healthy eating",
]
HELD_OUT = ["earthquakes", "penguins", "painting", "the weather", "running", "cities", "books", "the sun"]
"""Topics of the held-out answers only."""


def conversations(engine, topics: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of every template about every topic."""
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": t.format(topic)}])
               for topic in topics for t in TEMPLATES]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return [(p, c.token_ids) for p, c in zip(prompts, generate(engine, prompts, params))]


@torch.no_grad()
def final_hidden(model, convs: list[tuple[list[int], list[int]]], hidden_size: int, tokens_per_batch: int = 4096,
                 block_size: int = 16) -> list[torch.Tensor]:
    """Each conversation's final-normed hidden states at the positions that predict its
    answer tokens (the prompt's last, then all but the answer's last): (len(answer), hidden).
    `model`: on the torch attention backend (build_model's default), which takes
    build_attention_metadata's steps."""
    out: list[torch.Tensor] = []
    i = 0
    while i < len(convs):
        batch = [convs[i]]
        while i + len(batch) < len(convs) and sum(len(p) + len(a) for p, a in batch) < tokens_per_batch:
            batch.append(convs[i + len(batch)])
        seqs = [p + a for p, a in batch]
        per_seq = -(-max(map(len, seqs)) // block_size)
        kv = model.model.layers[0].self_attn
        shape = (per_seq * len(seqs), block_size, kv.local_num_kv_heads, kv.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]
        tables = [list(range(j * per_seq, (j + 1) * per_seq)) for j in range(len(seqs))]
        lens = [len(s) for s in seqs]
        meta = build_attention_metadata(lens, lens, tables, block_size)
        ids = torch.tensor([t for s in seqs for t in s])
        pos = torch.tensor([t for s in seqs for t in range(len(s))])
        hidden, _ = model(ids, pos, caches, meta)
        start = 0
        for (p, a), n in zip(batch, lens):
            out.append(hidden[start + len(p) - 1:start + n - 1].reshape(-1, hidden_size).float().clone())
            start += n
        i += len(batch)
    return out


def examples(hidden: list[torch.Tensor], convs, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (hidden at answer position t) and their tokens (num_rows, num_heads + 1): the LM
    head's (answer token t), then head k's target, the answer token k places after it; -100
    past the answer's end."""
    rows, tokens = [], []
    for h, (_, answer) in zip(hidden, convs):
        n = len(answer)
        t = torch.full((n, num_heads + 1), -100, dtype=torch.long)
        for k in range(num_heads + 1):
            if n > k:
                t[:n - k, k] = torch.tensor(answer[k:])
        rows.append(h)
        tokens.append(t)
    return torch.cat(rows), torch.cat(tokens)


def draft_vocab(convs, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the answers (ties by id): what the heads may guess."""
    counts: dict[int, int] = {}
    for _, answer in convs:
        for t in answer:
            counts[t] = counts.get(t, 0) + 1
    return torch.tensor(sorted(counts, key=lambda t: (-counts[t], t))[:size], dtype=torch.long)


def lm_head_matrix(info) -> torch.Tensor:
    """The target's LM head (vocab, hidden), float32: its own or the tied embedding."""
    with ExitStack() as stack:
        found = dict(iter_checkpoint(info, stack))
        name = "lm_head.weight" if "lm_head.weight" in found else "model.embed_tokens.weight"
        return found[name].load().float()


def loss_of(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the draft vocabulary (a target outside it is not counted)."""
    logits = heads(x, y[:, :-1].clamp(min=0))  # (num_heads, rows, draft vocab)
    targets = y[:, 1:].T
    rows = heads.index[targets.clamp(min=0)]
    rows = rows.masked_fill((targets < 0) | (rows < 0), -100)
    return F.cross_entropy(logits.flatten(0, 1), rows.flatten(), ignore_index=-100)


@torch.no_grad()
def evaluate(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, top_k: int, rows_per_batch: int = 512) -> dict:
    """Each head's top-1 and top-k accuracy given the tokens before its guess, and the tokens
    per greedy step of a chain of first guesses: 1 + the leading heads right (a sequential
    head reads the true tokens before its guess, which are its chain's while the heads
    before it are right)."""
    top1 = torch.zeros(heads.num_heads)
    topk = torch.zeros(heads.num_heads)
    counted = torch.zeros(heads.num_heads)
    chain = []
    for s in range(0, len(x), rows_per_batch):
        yb = y[s:s + rows_per_batch]
        logits = heads(x[s:s + rows_per_batch], yb[:, :-1].clamp(min=0))
        target = yb[:, 1:].T  # (num_heads, rows)
        valid = target >= 0
        best = heads.vocab[logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices]  # (num_heads, rows, top_k)
        hit1 = (best[..., 0] == target) & valid
        top1 += hit1.sum(1)
        topk += ((best == target[..., None]).any(-1) & valid).sum(1)
        counted += valid.sum(1)
        chain.append(torch.cumprod(hit1.int(), dim=0).sum(0))  # leading heads right, per row
    accepted = torch.cat(chain).float().mean().item()
    return {"top1": (top1 / counted).tolist(), f"top{top_k}": (topk / counted).tolist(),
            "chain_tokens_per_step": 1.0 + accepted, "rows": len(x)}


def train(heads: MedusaHeads, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int, lr: float,
          deadline: float = float("inf"), report=None) -> tuple[int, list[float]]:
    """AdamW on shuffled batches of (x, y) for `epochs`, or until time.monotonic() passes
    `deadline` (an epoch cut short is not counted); returns the optimizer steps and each
    whole epoch's mean loss. `report(epoch, loss)`: called after each whole epoch."""
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    order = list(range(len(x)))
    rng = random.Random(0)
    steps, losses = 0, []
    for epoch in range(epochs):
        rng.shuffle(order)
        total, batches = 0.0, 0
        for s in range(0, len(order), batch):
            if time.monotonic() > deadline:
                return steps, losses
            idx = torch.tensor(order[s:s + batch])
            loss = loss_of(heads, x[idx], y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, batches, steps = total + loss.item(), batches + 1, steps + 1
        losses.append(total / max(batches, 1))
        if report is not None:
            report(epoch + 1, losses[-1])
    return steps, losses


def new_heads(info, convs, num_heads: int, num_layers: int, vocab_size: int, sequential: bool) -> MedusaHeads:
    """Untrained heads for the model of `info` over the draft vocabulary of `convs`' answers."""
    vocab = draft_vocab(convs, vocab_size)
    return MedusaHeads(info.hidden_size, num_heads, vocab, lm_head_matrix(info)[vocab], info.vocab_size,
                       num_layers, sequential)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=192, help="answer tokens per prompt")
    ap.add_argument("--minutes", type=float, default=20.0, help="the whole run's budget, data included")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: the answers' most frequent tokens")
    ap.add_argument("--kind", choices=("sequential", "medusa"), default="sequential",
                    help="sequential: each head also reads the tokens before its guess (Hydra); medusa: h_t alone")
    ap.add_argument("--topics", type=int, default=len(TOPICS), help="training topics (of the fixed list)")
    ap.add_argument("--output", default="results/smollm2-medusa.safetensors")
    args = ap.parse_args()
    started = time.monotonic()
    torch.manual_seed(0)
    config = load_config(None, [f"model.path={args.model}", "model.dtype=float32",
                                "scheduler.max_num_seqs=32", "cache.prefix_caching=false"])
    info = check_config(config)
    memory = plan_memory(config, info)
    engine = build_single_rank_engine(config, info, memory)
    train_convs = conversations(engine, TOPICS[:args.topics], args.max_tokens)
    held_convs = conversations(engine, HELD_OUT, args.max_tokens)
    del engine
    model = build_model(info, AxisGroup.single("tp"), torch.float32, max_position=memory.max_model_len,
                        library=cpu_library.load())
    x, y = examples(final_hidden(model, train_convs, info.hidden_size), train_convs, args.heads)
    hx, hy = examples(final_hidden(model, held_convs, info.hidden_size), held_convs, args.heads)
    del model
    data_seconds = time.monotonic() - started
    print(f"{len(train_convs)} training answers ({len(x)} positions), {len(held_convs)} held out ({len(hx)}); "
          f"data in {data_seconds:.0f} s")

    heads = new_heads(info, train_convs, args.heads, args.layers, args.vocab, args.kind == "sequential")
    before = evaluate(heads, hx, hy, args.top_k)
    deadline = started + 60 * args.minutes - 60  # a minute for the last evaluation
    steps, losses = train(heads, x, y, args.epochs, args.batch, args.lr, deadline,
                          lambda epoch, loss: print(f"epoch {epoch}: mean loss {loss:.3f} "
                                                    f"({time.monotonic() - started:.0f} s)"))
    epochs_done = len(losses)
    after = evaluate(heads, hx, hy, args.top_k)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    heads.save(out)
    result = {"model": args.model, "kind": args.kind, "heads": args.heads, "layers": args.layers,
              "draft_vocab": len(heads.vocab), "epochs": epochs_done,
              "optimizer_steps": steps, "epoch_losses": losses, "train_positions": len(x), "held_out_positions": len(hx),
              "seconds": time.monotonic() - started, "data_seconds": data_seconds,
              "untrained": before, "trained": after, "file": str(out)}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"{epochs_done} epochs ({steps} steps) in {result['seconds'] / 60:.1f} min; held-out answers:")
    for k in range(args.heads):
        print(f"  head {k + 1} (token t+{k + 2}): top-1 {after['top1'][k]:.3f}, "
              f"top-{args.top_k} {after[f'top{args.top_k}'][k]:.3f} (untrained {before['top1'][k]:.3f})")
    print(f"  a chain of the heads' first guesses: {after['chain_tokens_per_step']:.2f} tokens per greedy step "
          f"(untrained {before['chain_tokens_per_step']:.2f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
