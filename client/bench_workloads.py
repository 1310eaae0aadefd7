"""The workloads of `meshserve bench` that reuse prompt prefixes, after the peers' benchmarks:

- `prefix-repetition` (vLLM's `prefix_repetition`, SGLang's `generated-shared-prefix`):
  `--num-prefixes` groups share a long system prompt of `--prefix-len` tokens, each request
  adds its own question of `--suffix-len` tokens; the groups' requests come interleaved.
- `multi-turn`: `--num-prompts` conversations of `--num-turns` turns. Each turn sends the
  whole history (every earlier question and answer) plus a new question of `--input-len`
  tokens, and waits for its answer before the next turn; conversations run concurrently
  (`--max-concurrency` of them at once).

Text is random common words, calibrated against the server's own token counts (as the
random workload's). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshserve.client.bench_data import BenchPrompt, random_words

Message = dict[str, str]


@dataclass
class Conversation:
    """A multi-turn conversation: its questions, asked one after another."""

    questions: list[str]
    output_len: int
    history: list[Message] = field(default_factory=list)

    def turn(self, index: int, chat: bool) -> BenchPrompt:
        """Turn `index`'s request: the history so far and its question (chat messages, or for
        a completions endpoint the same turns as one text)."""
        messages = self.history + [{"role": "user", "content": self.questions[index]}]
        if chat:
            return BenchPrompt(messages, self.output_len)
        text = "".join(f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}\n" for m in messages)
        return BenchPrompt(text + "Assistant:", self.output_len)

    def answered(self, index: int, answer: str) -> None:
        self.history += [{"role": "user", "content": self.questions[index]}, {"role": "assistant", "content": answer}]


def words_for(tokens: int, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word))


def prefix_repetition(rng: np.random.Generator, num: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                      output_len: int, tokens_per_word: float) -> list[BenchPrompt]:
    """`num` prompts in `num_prefixes` groups, each group's prompts starting with the same text."""
    prefixes = [random_words(rng, words_for(prefix_len, tokens_per_word)) for _ in range(num_prefixes)]
    groups = rng.permutation(np.arange(num) % num_prefixes)
    return [BenchPrompt(f"{prefixes[g]}\n{random_words(rng, words_for(suffix_len, tokens_per_word))}", output_len)
            for g in groups]


def multi_turn(rng: np.random.Generator, num: int, num_turns: int, input_len: int, output_len: int,
               tokens_per_word: float) -> list[Conversation]:
    return [Conversation([random_words(rng, words_for(input_len, tokens_per_word)) for _ in range(num_turns)],
                         output_len) for _ in range(num)]
