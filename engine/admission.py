"""Admission: the checks of one request against the model, the same for every frontend (and
for offline generation). A failed check is a RequestError for that request only, naming the
parameter it is about; frontends turn it into their error reply."""

from __future__ import annotations

from meshserve.comm.messages import ErrorCode, GenerateRequest, ParamError, Resume, SamplingParams


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        """`param`: the request field the error is about (OpenAI's `param`), if one is."""
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The request's parameters against the model: the bounds are SamplingParams' own
    (comm/messages.py), this only makes a broken one this request's error."""
    try:
        params.check(vocab_size)
    except ParamError as e:
        raise RequestError("bad_request", e.message, e.field) from None


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise RequestError("bad_request", "the prompt is empty", "prompt")
    bad = [t for t in prompt_ids if t >= vocab_size]
    if bad:
        raise RequestError("bad_request", f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                           "prompt")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            "too_long",
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} in the prompt, max_tokens={params.max_tokens})",
            "prompt",
        )


def prompt_source(req: GenerateRequest) -> str | list[int]:
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise RequestError("bad_request", "give exactly one of prompt and prompt_token_ids", "prompt")
    return req.prompt if req.prompt is not None else list(req.prompt_token_ids)


MAX_CHARS_PER_TOKEN = 64
"""A prompt string longer than this many characters per token of context is refused untokenized."""
PROBE_CHARS_PER_TOKEN = 8
PROBE_SLACK = 32
"""A long prompt is refused once its first PROBE_CHARS_PER_TOKEN x context characters alone
make more than the context plus this many tokens: words are tokenized one by one, so only the
word the cut splits can come out differently in the whole prompt."""


def check_admissible(params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """What can be checked of a request before its prompt is tokenized."""
    check_params(params, vocab_size)
    if params.max_tokens >= max_model_len:
        raise RequestError("too_long", f"this model's maximum context length is {max_model_len} tokens; "
                                       f"max_tokens={params.max_tokens} leaves no room for a prompt", "max_tokens")


def check_chars(chars: int, max_model_len: int, param: str = "prompt") -> None:
    """Refuses text far too long for the context before it is tokenized: more than
    MAX_CHARS_PER_TOKEN characters per token of context. `param`: what the text is."""
    if chars > MAX_CHARS_PER_TOKEN * max_model_len:
        raise RequestError("too_long", f"the {param}: {chars} characters, far more than the model's maximum "
                                       f"context of {max_model_len} tokens", param)


def encode_prompt(tokenizer, text: str, max_model_len: int) -> list[int]:
    """Tokenize a prompt string, refusing one far too long for the context cheaply: by its
    length, then by the tokens of its first part (tokenizing a long prompt whole takes seconds)."""
    check_chars(len(text), max_model_len)
    probe = PROBE_CHARS_PER_TOKEN * max_model_len
    if len(text) > probe:
        head = len(tokenizer.encode(text[:probe]))
        if head > max_model_len + PROBE_SLACK:
            raise RequestError("too_long", f"the prompt's first {probe} characters alone make {head} tokens, more "
                                           f"than the model's maximum context of {max_model_len} tokens", "prompt")
    return tokenizer.encode(text)


def check_resume(resume: Resume | None, params: SamplingParams, vocab_size: int) -> None:
    """A migrated stream's output so far (comm/messages.py Resume) against its parameters."""
    if resume is None:
        return
    bad = [t for t in resume.token_ids if t >= vocab_size]
    if bad:
        raise RequestError("bad_request", f"resumed token ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                           "resume")
    if len(resume.token_ids) >= params.max_tokens:
        raise RequestError("bad_request", f"the resumed output has {len(resume.token_ids)} tokens: the request is "
                                          f"done (max_tokens={params.max_tokens})", "resume")
    if params.prompt_logprobs is not None:
        raise RequestError("bad_request", "a resumed request has had its prompt logprobs: ask for none",
                           "prompt_logprobs")


def admit_prompt(tokenizer, prompt: str | list[int], params: SamplingParams, vocab_size: int,
                 max_model_len: int, resume: Resume | None = None) -> list[int]:
    """A request's prompt as token ids that fit the model with its parameters: tokenized if it
    is text (on a frontend's tokenize pool: it may take a second), checked either way (and the
    output it resumes, if it does). The one admission of a prompt, for every frontend."""
    ids = encode_prompt(tokenizer, prompt, max_model_len) if isinstance(prompt, str) else prompt
    check_prompt(ids, params, vocab_size, max_model_len)
    check_resume(resume, params, vocab_size)
    return ids
