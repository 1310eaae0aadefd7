"""From sampled tokens to what a client sees: stop conditions, incremental text with
stop strings held back, logprobs, and the final usage record. Runs on the driver's
step loop, right after each step, so a stop is acted on before the next step."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.comm.messages import Delta, FinishReason, TokenLogprob, Usage
from meshserve.engine.sequence import Sequence
from meshserve.engine.tokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    seq: Sequence
    request_id: str
    stream: bool
    detokenizer: IncrementalDetokenizer
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_logprobs: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """SamplingParams.prompt_logprobs: one per prompt token (the first None), filled as the
    prompt is computed, sent with the first delta after it is whole."""
    sent_prompt_logprobs: bool = False

    @property
    def holdback(self) -> int:
        """Characters kept back while streaming: a stop string may be starting there. With
        include_stop_str_in_output, none: a match ends in the newest characters, so the
        text before them stays whatever matches."""
        params = self.seq.params
        if not params.stop or params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in params.stop) - 1


class OutputProcessor:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def on_token(self, state: RequestState, logprob: TokenLogprob | None, grammar_done: bool = False) -> Delta | None:
        """`add_token`, then what the client should receive now (None: nothing yet)."""
        self.add_token(state, logprob, grammar_done)
        return self.delta(state)

    def add_token(self, state: RequestState, logprob: TokenLogprob | None, grammar_done: bool = False,
                  length: int | None = None) -> None:
        """Account for the token at `length - 1` of `state.seq` (default: its last) and decide
        whether it finishes the request, as if the sequence ended there (a step appends its
        accepted drafts at once). `grammar_done`: the request's structured-output constraint
        admits nothing more."""
        seq, params = state.seq, state.seq.params
        length = seq.num_tokens if length is None else length
        token = seq.token_ids[length - 1]
        num_output = length - seq.prompt_len
        if logprob is not None:
            state.logprobs.append(logprob)
        may_stop = num_output > params.min_tokens  # the sampler bans stop tokens before that
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            state.finish_reason = "stop"
        elif may_stop and token in params.stop_token_ids:
            state.finish_reason, state.stop_reason = "stop", token
        else:
            before = len(state.text)
            state.text += state.detokenizer.step(token)
            if may_stop and params.stop:
                self._check_stop_strings(state, before)
        if state.finish_reason is None and grammar_done:
            state.finish_reason = "stop"
        if state.finish_reason is None and (num_output >= params.max_tokens or length >= self.max_model_len):
            state.finish_reason = "length"

    @staticmethod
    def _check_stop_strings(state: RequestState, before: int) -> None:
        hits = []
        for stop in state.seq.params.stop:
            at = state.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                hits.append((at, stop))
        if hits:
            at, stop = min(hits)
            keep = at + len(stop) if state.seq.params.include_stop_str_in_output else at
            state.text = state.text[:keep]
            state.finish_reason, state.stop_reason = "stop", stop

    def abort(self, state: RequestState) -> Delta:
        state.finish_reason = "abort"
        return self.delta(state)

    def delta(self, state: RequestState) -> Delta | None:
        """What the client should receive of the request now (None: nothing yet)."""
        done = state.finish_reason is not None
        if not done and not state.stream:
            return None
        end = len(state.text) if done else max(state.sent_chars, len(state.text) - state.holdback)
        tokens = state.seq.output_token_ids[state.sent_tokens:]
        if not done and not tokens and end == state.sent_chars:
            return None
        text = state.text[state.sent_chars:end]
        logprobs = state.logprobs[state.sent_logprobs:] if state.logprobs else None
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.sent_prompt_logprobs:
            prompt_logprobs, state.sent_prompt_logprobs = state.prompt_logprobs, True
        state.sent_chars, state.sent_tokens, state.sent_logprobs = end, state.seq.num_output_tokens, len(state.logprobs)
        seq = state.seq
        usage = Usage(seq.prompt_len, seq.num_output_tokens, min(seq.num_cached_tokens, seq.prompt_len), seq.num_accepted_tokens,
                      seq.num_draft_tokens - seq.num_accepted_tokens) if done else None
        return Delta(state.request_id, text, tokens, state.finish_reason if done else None, logprobs, usage,
                     state.stop_reason if done else None, prompt_logprobs)
