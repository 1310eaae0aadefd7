"""OpenAI's response shapes as meshserve sends them: the usage object, logprobs in the legacy
completions and the chat shapes, and the choices of /v1/completions and /v1/chat/completions,
whole or as stream chunks (openai_protocol.py has the requests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshserve.comm.messages import Completion, Delta, TokenLogprob, Usage
from meshserve.engine.serving.reasoning import ReasoningSplitter, reasoning_tokens, split_reasoning, tokens_through
from meshserve.engine.serving.tools import ToolCallStream, ToolFormat


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               draft_tokens: tuple[int, int] = (0, 0), reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (once known, at the end): prompt tokens whose KV
    came from the prefix cache. `draft_tokens`: speculative decoding's (accepted, rejected)
    proposed tokens, as OpenAI's completion_tokens_details names predicted outputs' (given
    where any were proposed). `reasoning_tokens`: of the completion tokens, those of the
    replies' reasoning (given where a reasoning parser splits replies)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if any(draft_tokens):
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": draft_tokens[0],
                                              "rejected_prediction_tokens": draft_tokens[1]}
    if reasoning_tokens is not None:
        usage.setdefault("completion_tokens_details", {})["reasoning_tokens"] = reasoning_tokens
    return usage


def draft_tokens(usages) -> tuple[int, int]:
    """Speculative decoding's (accepted, rejected) proposed tokens over every sample."""
    usages = list(usages)
    return sum(u.accepted_draft_tokens for u in usages), sum(u.rejected_draft_tokens for u in usages)


def cached_tokens(usages: dict[int, Usage], n: int) -> int:
    """The usage's cached tokens: those of each prompt's first sample (sample i * n), as
    prompt_tokens counts each prompt once however many samples it has."""
    return sum(u.cached_tokens for index, u in usages.items() if index % n == 0)


def best_of(results: list[Completion], per_prompt: int, n: int) -> list[Completion]:
    """vLLM's best_of: of each prompt's `per_prompt` samples (consecutive in `results`), the
    `n` whose sampled tokens have the highest cumulative logprob, best first."""
    if per_prompt == n:
        return results
    chosen = []
    for start in range(0, len(results), per_prompt):
        group = results[start:start + per_prompt]
        chosen += sorted(group, key=lambda c: sum(lp.logprob for lp in c.logprobs or []), reverse=True)[:n]
    return chosen


@dataclass(frozen=True)
class ChoiceContext:
    """What the choices of one response carry besides the engine's output. Choice i answers
    prompt i // n."""

    prompt_ids: list[list[int]]
    n: int = 1
    echo: list[str] | None = None
    """Each prompt's text that precedes its choices' output (echo); None: nothing."""
    token_ids: bool = False
    """vLLM's return_token_ids: the prompt's token ids and each choice's."""
    prompt_logprobs: bool = False
    """vLLM's prompt_logprobs: each choice (chat: the response) carries the prompt's."""
    echo_logprobs: bool = False
    """Completions with echo and logprobs: the legacy logprobs start with the prompt's tokens."""

    @property
    def num_choices(self) -> int:
        return len(self.prompt_ids) * self.n

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def prompt_token_ids(self, index: int) -> list[int]:
        return self.prompt_ids[index // self.n]


class LogprobFormatter:
    """Token logprobs in the two shapes OpenAI uses (legacy completions, chat)."""

    def __init__(self, token_text):
        self.token_text = token_text
        """token id -> its text (cached by the caller)."""

    def completion(self, logprobs: list[TokenLogprob], offset: int,
                   prompt: tuple[list[int], list[TokenLogprob | None]] | None = None) -> tuple[dict[str, Any], int]:
        """Legacy `logprobs` object of the completions API, and the text offset after it.
        `prompt`: (token ids, prompt logprobs) of an echoed prompt, whose tokens come first
        (the first with a null logprob, as OpenAI gives it)."""
        tokens, offsets, values, tops = [], [], [], []
        entries = list(zip(*prompt)) if prompt is not None else []
        entries += [(lp.token_id, lp) for lp in logprobs]
        for token_id, lp in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            values.append(None if lp is None else lp.logprob)
            if lp is None:
                tops.append(None)
                continue
            top = {text: lp.logprob}
            for tid, value in lp.top:
                top.setdefault(self.token_text(tid), value)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset

    def prompt(self, prompt_logprobs: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id (a
        string): {"logprob", "rank", "decoded_token"}} for the token and the top alternatives."""
        if prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for lp in prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": self.token_text(lp.token_id)}}
            for rank, (tid, value) in enumerate(lp.top, 1):
                entry.setdefault(str(tid), {"logprob": value, "rank": rank, "decoded_token": self.token_text(tid)})
            out.append(entry)
        return out

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, value: float) -> dict[str, Any]:
            text = self.token_text(tid)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}


class CompletionShapes:
    """Choices of /v1/completions, whole or as stream chunks."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, logprobs: LogprobFormatter | None, context: ChoiceContext | None = None,
                 prompt_formatter: LogprobFormatter | None = None):
        """`prompt_formatter`: formats the prompt logprobs (vLLM's prompt_logprobs)."""
        self.logprobs = logprobs
        self.context = context or ChoiceContext([])
        self._prompt_formatter = prompt_formatter
        self._offsets: dict[int, int] = {}
        self._started: set[int] = set()

    def _logprobs(self, index: int, logprobs: list[TokenLogprob] | None,
                  prompt_logprobs: list[TokenLogprob | None] | None = None) -> dict[str, Any] | None:
        """The legacy logprobs of a choice's next output; the echoed prompt's first, with
        echo (they come with the choice's first output)."""
        if self.logprobs is None or logprobs is None:
            return None
        prompt = None
        if self.context.echo_logprobs and prompt_logprobs is not None:
            prompt = (self.context.prompt_token_ids(index), prompt_logprobs)
        elif index not in self._offsets:  # the output's offsets start after an echoed prompt
            self._offsets[index] = len(self.context.echo_text(index))
        out, self._offsets[index] = self.logprobs.completion(logprobs, self._offsets.get(index, 0), prompt)
        return out

    def _prompt_extras(self, out: dict[str, Any], prompt_logprobs: list[TokenLogprob | None] | None) -> None:
        if self.context.prompt_logprobs and self._prompt_formatter is not None:
            out["prompt_logprobs"] = self._prompt_formatter.prompt(prompt_logprobs)

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        out = {"index": index, "text": self.context.echo_text(index) + c.text,
               "logprobs": self._logprobs(index, c.logprobs or [], c.prompt_logprobs),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.context.token_ids:
            out |= {"token_ids": c.token_ids, "prompt_token_ids": self.context.prompt_token_ids(index)}
        self._prompt_extras(out, c.prompt_logprobs)
        return out

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        """The first chunk of a choice starts with the echoed prompt and carries the prompt's
        token ids (vLLM's shapes)."""
        first = index not in self._started
        self._started.add(index)
        echo = self.context.echo_text(index) if first else ""
        out = {"index": index, "text": echo + d.text,
               "logprobs": self._logprobs(index, d.logprobs or [], d.prompt_logprobs),
               "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = d.token_ids
            if first:
                out["prompt_token_ids"] = self.context.prompt_token_ids(index)
        if d.prompt_logprobs is not None:
            self._prompt_extras(out, d.prompt_logprobs)
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the engine's first output: none."""
        return []

    def top_level(self, results: list[Completion]) -> dict[str, Any]:
        """Fields of the whole response besides the header, choices and usage: none."""
        return {}

    counts_reasoning = False
    """Completions are not split into reasoning and answer."""

    def reasoning_tokens(self, text: str, token_ids: list[int]) -> int | None:
        return None

    def streamed_reasoning_tokens(self, index: int, token_ids: list[int]) -> int | None:
        return None


class ChatShapes:
    """Choices of /v1/chat/completions, whole or as stream chunks."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, logprobs: LogprobFormatter | None, context: ChoiceContext | None = None,
                 tools: ToolFormat | None = None, prompt_formatter: LogprobFormatter | None = None,
                 reasoning: bool | None = None, decode: Callable[[list[int]], str] | None = None):
        """`tools`: the model's tool-call format, when the reply is read for calls (a
        request with tools): they leave as `tool_calls`, and finish_reason is "tool_calls".
        `prompt_formatter`: formats the prompt logprobs (vLLM's prompt_logprobs).
        `reasoning`: with a reasoning parser (engine/serving/reasoning.py), whether a reply
        starts inside its reasoning; its reasoning leaves as `reasoning_content`, and only
        the answer after it is read for tool calls (a call opened inside the reasoning ends
        it). None: no parser. `decode`: the reply's detokenizer (ids -> text), with which
        its reasoning tokens are counted."""
        self.logprobs = logprobs
        self.context = context or ChoiceContext([])
        self.tools = tools
        self.reasoning = reasoning
        self._prompt_formatter = prompt_formatter
        self._streams: dict[int, ToolCallStream] = {}
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._call_open = tools.call_open if tools is not None else None
        self._decode = decode

    @property
    def counts_reasoning(self) -> bool:
        """Whether usage counts the replies' reasoning tokens (with a reasoning parser)."""
        return self.reasoning is not None and self._decode is not None

    def reasoning_tokens(self, text: str, token_ids: list[int]) -> int | None:
        """Of a whole reply's tokens, how many are its reasoning; None without a parser."""
        if not self.counts_reasoning:
            return None
        return reasoning_tokens(text, token_ids, self.reasoning, self._call_open, self._decode)

    def streamed_reasoning_tokens(self, index: int, token_ids: list[int]) -> int | None:
        """Of choice `index`'s streamed tokens, how many are its reasoning: where its
        splitter (fed every chunk, finished by the last) put the reasoning's end."""
        if not self.counts_reasoning:
            return None
        splitter = self._splitters.get(index)
        return tokens_through(splitter.reasoning_chars if splitter else 0, token_ids, self._decode)

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None or logprobs is None else self.logprobs.chat(logprobs)

    def choice(self, index: int, c: Completion) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.context.echo_text(index) + c.text}
        finish = c.finish_reason
        reasoning = None
        if self.reasoning is not None:
            reasoning, message["content"] = split_reasoning(c.text, self.reasoning, self._call_open)
            message["content"] = self.context.echo_text(index) + message["content"]
        if self.tools is not None:
            parsed = self.tools.parse(message["content"])
            message = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = parsed.tool_calls
                finish = "tool_calls" if finish == "stop" else finish
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
            if reasoning and not message["content"]:
                message["content"] = None
        out = {"index": index, "message": message, "logprobs": self._logprobs(c.logprobs or []),
               "finish_reason": finish, "stop_reason": c.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = c.token_ids
        return out

    def chunk_choice(self, index: int, d: Delta) -> dict[str, Any]:
        text, reasoning = d.text, ""
        if self.reasoning is not None:
            splitter = self._splitters.get(index)
            if splitter is None:
                splitter = self._splitters[index] = ReasoningSplitter(self.reasoning, self._call_open)
            reasoning, text = splitter.feed(d.text)
            if d.finish_reason is not None:
                more_reasoning, more_text = splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        delta: dict[str, Any] = {"content": text}
        finish = d.finish_reason
        if self.tools is not None:
            delta, called = self._tool_delta(index, text, d.finish_reason is not None)
            finish = "tool_calls" if finish == "stop" and called else finish
        if reasoning:
            delta = {"reasoning_content": reasoning, **{k: v for k, v in delta.items() if v}}
        out = {"index": index, "delta": delta, "logprobs": self._logprobs(d.logprobs or []),
               "finish_reason": finish, "stop_reason": d.stop_reason}
        if self.context.token_ids:
            out["token_ids"] = d.token_ids
        return out

    def _tool_delta(self, index: int, text: str, last: bool) -> tuple[dict[str, Any], bool]:
        """The chunk delta of a reply read for tool calls (its text held back while it may be
        a call; a call's name once it commits, then its arguments as they are written), and
        whether the reply called a tool. One call's fragments in one chunk go as one entry."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self.tools.stream()
        parts = stream.feed(text) + (stream.finish() if last else [])
        delta: dict[str, Any] = {}
        for part in parts:
            if "content" in part:
                delta["content"] = delta.get("content", "") + part["content"]
            for call in part.get("tool_calls", []):
                calls = delta.setdefault("tool_calls", [])
                if calls and calls[-1]["index"] == call["index"]:
                    calls[-1]["function"]["arguments"] += call["function"]["arguments"]
                else:
                    calls.append(call)
        return delta, stream.num_calls > 0

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the engine's first output, as OpenAI and vLLM send them: each
        choice's first chunk names the role and nothing else (`content` ""; a client that
        reads the first chunk as the role's loses no text), with the prompt's token ids if
        asked; then, with echo, a chunk of the echoed text per choice."""
        chunks = []
        for i in range(self.context.num_choices):
            chunk: dict[str, Any] = {"choices": [self._bare(i, {"role": "assistant", "content": ""})]}
            if self.context.token_ids:
                chunk["prompt_token_ids"] = self.context.prompt_token_ids(i)
            chunks.append(chunk)
        for i in range(self.context.num_choices):
            if self.context.echo_text(i):
                chunks.append({"choices": [self._bare(i, {"content": self.context.echo_text(i)})]})
        return chunks

    @staticmethod
    def _bare(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None}

    def top_level(self, results: list[Completion]) -> dict[str, Any]:
        """Fields of the whole response besides the header, choices and usage: vLLM puts the
        prompt's token ids (return_token_ids) and logprobs (prompt_logprobs) there."""
        out: dict[str, Any] = {}
        if self.context.token_ids:
            out["prompt_token_ids"] = self.context.prompt_ids[0]
        if self.context.prompt_logprobs and self._prompt_formatter is not None and results:
            out["prompt_logprobs"] = self._prompt_formatter.prompt(results[0].prompt_logprobs)
        return out
