"""Draft heads for speculative decoding without a draft model: Medusa heads (Cai et al.,
2024), or the sequential heads of Hydra (Ankner et al., 2024), on the target model's last
hidden state.

Head k (1-based) reads the final-normed hidden state h_t of position t, from which the LM
head takes token t+1, and guesses token t+1+k. A Medusa head reads h_t alone; a sequential
head also reads the tokens between: token t+1 (the target's own) and the guesses of the
heads before it, so it knows what it continues. Each head is `num_layers` residual blocks,
z = x + SiLU(W x + b), where the first block's x is h_t (Medusa) or h_t followed by the
token vectors of tokens t+1 ... t+k (sequential), and z is h_t plus the blocks' output.

The heads guess over a draft vocabulary: the tokens of the answers they were trained on
(`vocab`), with the target's LM-head rows of those tokens (`lm_rows`, frozen: copied from
the target when trained). Those rows are also the token vectors a sequential head reads
(zero for a token outside the draft vocabulary). A guess is then a product with a few
thousand rows, not the whole vocabulary, and needs no collective on a tensor-parallel LM head.

The file is safetensors: head k's block j as `heads.{k}.{j}.weight` / `.bias` (k from 0),
`vocab` and `lm_rows`, with metadata `format` (FILE_FORMAT), `hidden_size`, `num_heads`,
`num_layers`, `sequential` ("1" or "0") and `target_vocab_size`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from meshserve.configs.heads_file import FILE_FORMAT, file_problem


class ResidualBlock(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.linear = nn.Linear(in_features, hidden_size, dtype=dtype)
        nn.init.zeros_(self.linear.weight)  # a new head starts as the LM head itself: it guesses token t+1
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, inputs: torch.Tensor, product=None) -> torch.Tensor:
        """`product`: what multiplies by the weight (layers.matmul_plan), None: F.linear."""
        y = self.linear(inputs) if product is None else product(inputs) + self.linear.bias
        return x + F.silu(y)


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, vocab: torch.Tensor, lm_rows: torch.Tensor,
                 target_vocab_size: int, num_layers: int = 1, sequential: bool = True,
                 dtype: torch.dtype = torch.float32):
        """`vocab`: the draft vocabulary's token ids; `lm_rows`: (len(vocab), hidden_size),
        the target's LM-head rows of those tokens."""
        super().__init__()
        self.hidden_size, self.num_heads, self.num_layers = hidden_size, num_heads, num_layers
        self.sequential, self.target_vocab_size = sequential, target_vocab_size

        def width(k: int, j: int) -> int:
            return hidden_size * (k + 2) if sequential and j == 0 else hidden_size

        self.heads = nn.ModuleList(nn.ModuleList(ResidualBlock(width(k, j), hidden_size, dtype)
                                                 for j in range(num_layers)) for k in range(num_heads))
        self.register_buffer("vocab", vocab.to(torch.long))
        self.register_buffer("lm_rows", lm_rows.to(dtype))
        index = torch.full((target_vocab_size,), -1, dtype=torch.long)
        index[self.vocab] = torch.arange(len(vocab))
        self.register_buffer("index", index)
        """token id -> its row of the draft vocabulary, -1 outside it."""
        self._products: tuple[list[list], object] | None = None

    def use_products(self, kernel) -> None:
        """`guess` multiplies by `kernel`'s products (layers.matmul_plan.MatmulKernel: the
        model's own, prepared once), where a plain product of one row would read the weights
        far below the memory's bandwidth."""
        self._products = ([[kernel.product(block.linear.weight) for block in head] for head in self.heads],
                          kernel.product(self.lm_rows))

    def token_vectors(self, ids: torch.Tensor) -> torch.Tensor:
        """What a sequential head reads of each token: its LM-head row, zero outside the
        draft vocabulary."""
        rows = self.index[ids]
        return self.lm_rows[rows.clamp(min=0)] * (rows >= 0).unsqueeze(-1).to(self.lm_rows.dtype)

    def _head(self, k: int, hidden: torch.Tensor, before: list[torch.Tensor], products=None) -> torch.Tensor:
        """Head k's state (rows, hidden), from h_t and the vectors of the tokens before its guess."""
        x = hidden
        for j, block in enumerate(self.heads[k]):
            inputs = torch.cat([hidden, *before], -1) if self.sequential and j == 0 else x
            x = block(x, inputs, products[j] if products else None)
        return x

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        product = self._products[1] if self._products else None
        return state @ self.lm_rows.T if product is None else product(state)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Every head's logits over the draft vocabulary, (num_heads, rows, len(vocab)), given
        the tokens before each head's guess (rows, num_heads): token t+1, then the tokens head
        1, 2, ... guess (what training knows; sequential heads only)."""
        vectors = [self.token_vectors(tokens[:, j]) for j in range(self.num_heads)] if self.sequential else []
        return torch.stack([self._head(k, hidden, vectors[:k + 1]) for k in range(self.num_heads)]) @ self.lm_rows.T

    @torch.no_grad()
    def guess(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The heads' first guesses (rows, num_heads) after each row's `next_tokens` (token t+1,
        the target's), each sequential head reading the guesses of those before it."""
        before = [self.token_vectors(next_tokens)] if self.sequential else []
        out = []
        for k in range(self.num_heads):
            products = self._products[0][k] if self._products else None
            best = self._logits(self._head(k, hidden, before, products)).argmax(-1)
            out.append(self.vocab[best])
            if self.sequential:
                before.append(self.lm_rows[best])
        return torch.stack(out, -1)

    @torch.no_grad()
    def tree_guess(self, hidden: torch.Tensor, next_tokens: torch.Tensor, paths: list[tuple[int, ...]]
                   ) -> torch.Tensor:
        """Each node's token (rows, len(paths)) of a candidate tree (engine/speculative/tree.py
        TreeShape.paths: node (i1, ..., id) holds the i_d-th best guess of head d under its
        parent). Medusa heads guess once for every node of a depth; a sequential head guesses
        once per parent, reading the tokens of that parent's path."""
        rows = hidden.shape[0]
        index = {p: n for n, p in enumerate(paths)}
        tokens: list[torch.Tensor | None] = [None] * len(paths)
        for depth in range(1, max(map(len, paths)) + 1):
            nodes = [p for p in paths if len(p) == depth]
            parents = sorted({p[:-1] for p in nodes}) if self.sequential else [()]
            k = 1 + max(p[-1] for p in nodes)
            x = hidden.repeat(len(parents), 1)
            before = []
            if self.sequential:
                before.append(self.token_vectors(next_tokens.repeat(len(parents))))
                for j in range(1, depth):
                    before.append(self.token_vectors(torch.cat([tokens[index[p[:j]]] for p in parents])))
            products = self._products[0][depth - 1] if self._products else None
            best = self.vocab[self._logits(self._head(depth - 1, x, before, products)).topk(k, -1).indices]
            for p in nodes:
                i = parents.index(p[:-1]) if self.sequential else 0
                tokens[index[p]] = best[i * rows:(i + 1) * rows, p[-1]]
        return torch.stack(tokens, -1)

    def save(self, path: Path | str) -> None:
        tensors = {f"heads.{k}.{j}.{part}": getattr(block.linear, part).detach().contiguous()
                   for k, head in enumerate(self.heads) for j, block in enumerate(head) for part in ("weight", "bias")}
        tensors["vocab"] = self.vocab.contiguous()
        tensors["lm_rows"] = self.lm_rows.contiguous()
        meta = {"format": FILE_FORMAT, "hidden_size": str(self.hidden_size), "num_heads": str(self.num_heads),
                "num_layers": str(self.num_layers), "sequential": "1" if self.sequential else "0",
                "target_vocab_size": str(self.target_vocab_size)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path | str, hidden_size: int, vocab_size: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> MedusaHeads:
        """The heads in `path`, checked against the target's `hidden_size` and `vocab_size`."""
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            problem = file_problem(meta, hidden_size, vocab_size)
            if problem:
                raise ValueError(f"{path}: {problem}")
            heads = cls(hidden_size, int(meta["num_heads"]), f.get_tensor("vocab"), f.get_tensor("lm_rows"),
                        vocab_size, int(meta["num_layers"]), meta["sequential"] == "1", dtype)
            with torch.no_grad():
                for k, head in enumerate(heads.heads):
                    for j, block in enumerate(head):
                        block.linear.weight.copy_(f.get_tensor(f"heads.{k}.{j}.weight"))
                        block.linear.bias.copy_(f.get_tensor(f"heads.{k}.{j}.bias"))
        heads.requires_grad_(False)
        return heads.to(device)

