"""The OpenAI pipelines: /v1/completions and /v1/chat/completions (with tools and structured
outputs), and the objects that serve /v1/responses and /tokenize over them, written against
an EngineLink (engine_link.py) and never against the HTTP transport.

A request's body is validated with every size bounded before it is parsed
(request_body.py); its sampling parameters are built and checked once, against
SamplingParams' bounds and the model's, before any prompt is tokenized; each prompt is
tokenized on the tokenize pool (off the event loop) and checked once, as soon as it is
tokenized (the next prompt is not tokenized if this one is too long); a structured-output or
forced-tool-call constraint is compiled on the pool too. Then one AddCommand per sample
(prompts x n) goes through the link, and the replies come back whole or streamed
(openai_generation.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from functools import lru_cache

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from meshserve.comm.messages import SamplingParams
from meshserve.engine.admission import RequestError, admit_prompt, check_chars, check_prompt
from meshserve.engine.serving.engine_link import EngineLink
from meshserve.engine.serving.openai_generation import (EventStream, Generation, Samples, chunks, collect,
                                                        first_replies, sse, watch_disconnect, whole)
from meshserve.engine.serving.lora_api import ServedAdapters
from meshserve.engine.serving.openai_protocol import (IGNORED_HEADER, MAX_N, ChatCompletionRequest, CompletionRequest,
                                                      OpenAIError, StreamOptions, check_model, engine_error,
                                                      from_request_error, ignored_fields, sample_params)
from meshserve.engine.serving.openai_shapes import ChatShapes, ChoiceContext, CompletionShapes, LogprobFormatter
from meshserve.engine.serving.request_body import parse_body
from meshserve.engine.serving.messages_api import MessagesApi
from meshserve.engine.serving.reasoning import PARSERS
from meshserve.engine.serving.response_store import ResponseStore
from meshserve.engine.serving.responses_api import ResponsesApi
from meshserve.engine.serving.structured_request import grammar_spec
from meshserve.engine.serving.tokenize_api import TokenizerApi, encode_chat, template_input
from meshserve.engine.serving.tokenize_pool import TokenizePool
from meshserve.engine.serving.tools import (ToolRequestError, chat_template_source, forced_call, render_messages,
                                            tool_format_for)
from meshserve.engine.structured import ANY_TEXT, Grammar, GrammarCompiler, GrammarSpec
from meshserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OpenAIServing:
    """The completions and chat pipelines of one served model, and the Responses, Messages
    and tokenizer APIs beside them."""

    def __init__(self, link: EngineLink, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 model_name: str, grammars: GrammarCompiler | None = None, adapters: ServedAdapters | None = None,
                 max_stored_responses: int = 1000, reasoning_parser: str | None = None):
        """`grammars`: compiles structured-output constraints (one is made if not given).
        `adapters`: the LoRA adapters a request's `model` may name, where the server serves them.
        `max_stored_responses`: the Responses API's store (server.responses.max_stored).
        `reasoning_parser`: how replies' reasoning is split off (engine/serving/reasoning.py)."""
        self.link, self.tokenizer = link, tokenizer
        self.adapters = adapters
        self.vocab_size, self.max_model_len, self.model_name = vocab_size, max_model_len, model_name
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)
        self._pool = TokenizePool(name="meshserve-http-tokenize")
        self._ignored_logged: set[str] = set()
        """Names of ignored request fields already logged (each once)."""
        self._token_text = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.chat_template = chat_template_source(tokenizer.hf.chat_template)
        self.tool_format = tool_format_for(self.chat_template)
        """How the model writes tool calls (engine/serving/tools), from its chat template."""
        self.tokenizer_api = TokenizerApi(tokenizer, vocab_size, max_model_len, model_name, self.in_pool,
                                          adapters.resolve if adapters is not None else None)
        self.responses = ResponsesApi(self.start_chat, model_name, max_model_len, ResponseStore(max_stored_responses))
        self.messages = MessagesApi(self.start_chat, model_name, max_model_len, reasoning_parser is not None)
        self.reasoning = None if reasoning_parser is None else PARSERS[reasoning_parser]
        """Whether a reply starts inside its reasoning; None: replies are not split."""

    def close(self) -> None:
        self._pool.close()

    async def in_pool(self, size: int, fn, *args):
        """fn(*args) in the tokenize pool (shortest job first, by `size`)."""
        return await asyncio.wrap_future(self._pool.submit(size, fn, *args))

    def _check_common(self, req) -> None:
        if not self.link.accepting:
            raise engine_error("unavailable", "the server is shutting down and accepts no new requests")
        self._adapter(req)
        req.check_supported()

    def _adapter(self, req) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base model); 404 if it names
        neither."""
        if self.adapters is None:
            check_model(req.model, self.model_name)
            return None
        return self.adapters.resolve(req.model)

    # ------------------------------------------------------------------ completions

    async def completions(self, raw: Request, background: bool = False) -> Response:
        """POST /v1/completions; `background`: a Batch API request (below every online one)."""
        req = parse_body(await raw.body(), CompletionRequest, self.max_model_len)
        self._check_common(req)
        prompts = req.prompts()
        if len(prompts) * req.num_samples > MAX_N:
            param = "n" if req.best_of is None else "best_of"
            raise OpenAIError(400, f"{len(prompts)} prompts x {param}={req.num_samples} exceeds {MAX_N} samples",
                              param=param)
        keep = req.prompt_keep(self.max_model_len)
        params = req.sampling_params(req.max_new_tokens(), req.engine_logprobs, self.vocab_size)
        ids, echo = [], []
        for prompt in prompts:
            prompt_ids, cut = await self._admit(prompt, params, keep)
            ids.append(prompt_ids)
            if req.echo:  # the prompt as sent, or the text of the token ids that stay
                echo.append(prompt if isinstance(prompt, str) and not cut else
                            await self.in_pool(len(prompt_ids), self.tokenizer.decode, prompt_ids, False))
        context = ChoiceContext(ids, req.n, echo or None, req.return_token_ids, req.prompt_logprobs is not None,
                                req.echo and req.logprobs is not None)
        formatter = LogprobFormatter(self._token_text)
        shapes = CompletionShapes(formatter if req.logprobs is not None else None, context, formatter)
        grammar = await self._grammar(grammar_spec(req))
        return await self._generate(req, raw, ids, params, shapes, grammar, background)

    async def _admit(self, prompt: str | list[int], params: SamplingParams, keep: int | None) -> tuple[list[int], bool]:
        """The prompt's token ids, checked once, as soon as they are known, and whether they
        were cut: with `keep` (truncate_prompt_tokens) only the last `keep` tokens stay, and
        the cut ids are the ones checked."""
        try:
            if keep is None:
                args = (self.tokenizer, prompt, params, self.vocab_size, self.max_model_len)
                ids = admit_prompt(*args) if isinstance(prompt, list) else await self.in_pool(
                    len(prompt), admit_prompt, *args)
                return ids, False
            if isinstance(prompt, str):
                check_chars(len(prompt), self.max_model_len)
                prompt = await self.in_pool(len(prompt), self.tokenizer.encode, prompt)
            ids = prompt[-keep:]
            check_prompt(ids, params, self.vocab_size, self.max_model_len)
        except RequestError as e:
            raise from_request_error(e, "prompt") from None
        return ids, len(ids) < len(prompt)

    async def run_background(self, url: str, body: bytes) -> tuple[int, dict]:
        """One Batch API request: `body` POSTed to `url` (/v1/chat/completions or
        /v1/completions) as a background request, answered whole: (status, JSON body)."""
        handler = {"/v1/chat/completions": self.chat, "/v1/completions": self.completions}[url]
        try:
            if json.loads(body).get("stream"):
                raise OpenAIError(400, "stream is not available in a batch: its answers are written whole",
                                  param="stream", code="invalid_value")
            response = await handler(internal_request(url, body), background=True)
        except OpenAIError as e:
            return e.status, e.body()
        return response.status_code, json.loads(response.body)

    # ------------------------------------------------------------------ chat

    async def chat(self, raw: Request, background: bool = False) -> Response:
        """POST /v1/chat/completions; `background`: a Batch API request (below every online one)."""
        req = parse_body(await raw.body(), ChatCompletionRequest, self.max_model_len)
        self._check_common(req)
        return await self._generate(req, raw, *await self._prepare_chat(req), background=background)

    async def start_chat(self, req: ChatCompletionRequest, raw: Request) -> Generation:
        """A chat request another API translated (responses_api.py), submitted."""
        self._check_common(req)
        return await self._start(req, raw, *await self._prepare_chat(req))

    async def _prepare_chat(self, req: ChatCompletionRequest) -> tuple:
        """What a chat request's generation needs: (prompt ids, parameters, shapes, the
        compiled constraint), the prompt and the parameters checked."""
        keep = req.prompt_keep(self.max_model_len)
        messages, chars = template_input(req.messages, self.max_model_len)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools or any(m.tool_calls or m.role == "tool" for m in req.messages):
            messages, tool_kwargs = self._tool_messages(req)
            kwargs |= tool_kwargs
        ids = await self.in_pool(chars + len(messages), encode_chat, self.tokenizer, messages,
                                 req.add_generation_prompt, req.continue_final_message, kwargs)
        if keep is not None:
            ids = ids[-keep:]
        params = req.sampling_params(req.max_new_tokens(len(ids), self.max_model_len), req.engine_logprobs,
                                     self.vocab_size)
        try:
            check_prompt(ids, params, self.vocab_size, self.max_model_len)
        except RequestError as e:
            raise from_request_error(e, "messages") from None
        context = ChoiceContext([ids], req.n, [req.echo_text()], req.return_token_ids, req.prompt_logprobs is not None)
        formatter = LogprobFormatter(self._token_text)
        skip = params.skip_special_tokens
        shapes = ChatShapes(formatter if req.logprobs else None, context,
                            self.tool_format if req.uses_tools else None, formatter, self.reasoning,
                            lambda token_ids: self.tokenizer.decode(token_ids, skip))
        grammar = await self._grammar(self._chat_constraint(req))
        return [ids], params, shapes, grammar

    def _tool_messages(self, req: ChatCompletionRequest) -> tuple[list[dict], dict]:
        """The conversation with its tools, calls and results as the model's template takes
        them (engine/serving/tools). NOTE: with tool_choice "none" the tools stay out of the
        prompt: the model is not to call them."""
        tools = req.tools if req.tool_choice != "none" else None
        try:
            return render_messages([m.as_tool_input() for m in req.messages], tools, self.chat_template,
                                   self.tool_format)
        except ToolRequestError as e:
            raise OpenAIError(400, str(e), param=e.param, code="invalid_value") from None

    def _chat_constraint(self, req: ChatCompletionRequest) -> GrammarSpec | None:
        """The output's constraint: the request's structured output, or a forced tool call's
        (tool_choice required or named: the call's arguments follow the function's schema).
        With a reasoning parser it applies after the reply's reasoning, which
        thinking_token_budget bounds (a constraint of its own when there is no other)."""
        spec = grammar_spec(req)
        forced = forced_call(req.tools, req.tool_choice, self.tool_format) if req.tools else None
        if forced is not None:
            if spec is not None:
                raise OpenAIError(400, f"{spec.param} and tool_choice={json.dumps(req.tool_choice)[:80]} both "
                                       f"constrain the output: give one", param="tool_choice", code="invalid_value")
            spec = GrammarSpec("json", json.dumps(forced.schema), forced.prefix, forced.suffix, "tool_choice")
        budget = req.thinking_token_budget
        if self.reasoning is None:
            if budget is not None:
                raise OpenAIError(400, "thinking_token_budget needs a server started with --reasoning-parser",
                                  param="thinking_token_budget", code="invalid_value")
            return spec
        if spec is None and budget is None:
            return None
        spec = spec or GrammarSpec("grammar", ANY_TEXT, param="thinking_token_budget")
        return dataclasses.replace(spec, reasoning="inside" if self.reasoning else "optional",
                                   reasoning_budget=budget or 0)

    # ------------------------------------------------------------------ both

    async def _grammar(self, spec: GrammarSpec | None) -> Grammar | None:
        """`spec` compiled on the tokenize pool (cached by spec), or a 400 naming its parameter."""
        if spec is None:
            return None
        try:
            return await self.in_pool(len(spec.value), self.grammars.compile, spec)
        except RequestError as e:
            raise engine_error(e.code, e.message, e.param) from None

    async def _start(self, req, raw: Request, prompt_ids: list[list[int]], params: SamplingParams, shapes,
                     grammar: Grammar | None = None, background: bool = False) -> Generation:
        """Submit req.num_samples engine requests per prompt, each with its sample's seed
        (sample_params); wait for all their results (whole) or their first deltas (streamed,
        so an error still gets its status code)."""
        per_sample = sample_params(params, req.num_samples)
        run = Samples(self.link, f"{shapes.id_prefix}{uuid.uuid4().hex}")
        lora = self._adapter(req)
        gen = Generation(run, shapes, lora or self.model_name, prompt_ids, req.num_samples, req.n)
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(raw, run.queue))
        try:
            for ids in prompt_ids:  # sample index = prompt index * num_samples + j
                for sample in per_sample:
                    run.submit(ids, sample, req.stream, req.cache_salt, grammar, lora, req.priority, background)
            if req.stream:
                gen.first = await first_replies(run)
            else:
                gen.results = await collect(run)
                run.close()
        except BaseException:
            run.close()
            raise
        finally:
            watcher.cancel()
        return gen

    async def _generate(self, req, raw: Request, prompt_ids: list[list[int]], params: SamplingParams, shapes,
                        grammar: Grammar | None = None, background: bool = False) -> Response:
        """Answer with `shapes`' choices, whole or streamed."""
        gen = await self._start(req, raw, prompt_ids, params, shapes, grammar, background)
        headers = self._ignored_header(req)
        if not req.stream:
            return JSONResponse(whole(gen), headers=headers)
        options = req.stream_options or StreamOptions()
        usage = "continuous" if options.continuous_usage_stats else "final" if options.include_usage else None
        return EventStream(sse(chunks(gen, usage)), gen.run.close, headers)

    def _ignored_header(self, req) -> dict[str, str]:
        """The request's fields this server ignores, for the response header (and, the first
        time each is seen, the log)."""
        ignored = ignored_fields(req)
        fresh = [name for name in ignored if name not in self._ignored_logged]
        if fresh:
            self._ignored_logged.update(fresh)
            log.warning("ignoring request fields this server does not know: %s (each logged once; the responses "
                        "name them in %s)", ", ".join(fresh), IGNORED_HEADER)
        return {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}


def internal_request(path: str, body: bytes) -> Request:
    """A POST of `body` to `path` made inside the server (the Batch API's runner): its
    client never goes away."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # never resolved: no disconnect comes
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
             "query_string": b""}
    return Request(scope, receive)
