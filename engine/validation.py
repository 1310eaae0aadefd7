"""Checks of one client request, turned into an error reply for that request only."""

from __future__ import annotations

from meshserve.comm.messages import ErrorCode, GenerateRequest, SamplingParams


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def check_params(params: SamplingParams, vocab_size: int) -> None:
    if params.min_tokens > params.max_tokens:
        raise RequestError("bad_request", f"min_tokens={params.min_tokens} exceeds max_tokens={params.max_tokens}")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise RequestError("bad_request", f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise RequestError("bad_request", "the prompt is empty")
    bad = [t for t in prompt_ids if t >= vocab_size]
    if bad:
        raise RequestError("bad_request", f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise RequestError(
            "too_long",
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{len(prompt_ids) + params.max_tokens} ({len(prompt_ids)} in the prompt, max_tokens={params.max_tokens})",
        )


def prompt_source(req: GenerateRequest) -> str | list[int]:
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise RequestError("bad_request", "give exactly one of prompt and prompt_token_ids")
    return req.prompt if req.prompt is not None else list(req.prompt_token_ids)


def admit(req: GenerateRequest, tokenizer, vocab_size: int, max_model_len: int) -> list[int]:
    """Validate a request and tokenize its prompt (in a frontend's thread); returns the prompt ids."""
    source = prompt_source(req)
    check_params(req.params, vocab_size)
    if isinstance(source, str):
        if len(source) > 64 * max_model_len:
            raise RequestError("too_long", f"the prompt has {len(source)} characters, far more than "
                                           f"the model's maximum context of {max_model_len} tokens")
        ids = tokenizer.encode(source)
    else:
        ids = source
    check_prompt(ids, req.params, vocab_size, max_model_len)
    return ids
