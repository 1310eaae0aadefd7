"""A constraint that waits for the reply's reasoning (engine/structured.py, GrammarSpec's
`reasoning`), on SmolLM2's tokenizer: free text until `</think>`, then the constraint; a
thinking budget forces `</think>` after that many tokens; a forced call's opening marker ends
an open reasoning block too. And the chat reply's reader (openai_shapes.ChatShapes): a call
opened inside the reasoning comes back as a call, whole and streamed, and the reasoning
tokens counted in the usage are those up to the end of the reasoning."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshserve.comm.messages import Completion, Delta
from meshserve.engine.serving.openai_shapes import ChatShapes
from meshserve.engine.serving.tools import HERMES
from meshserve.engine.structured import ANY_TEXT, GrammarCompiler, GrammarSpec, GuidedDecoding

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False})


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from meshserve.configs.model_info import read_model_info
    from meshserve.engine.tokenizer import Tokenizer

    return Tokenizer(read_model_info(str(smollm2)))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer.hf))


def allowed(guide: GuidedDecoding, seq_id: int = 0) -> np.ndarray:
    """The tokens `seq_id` may sample next, as a boolean vector."""
    masks = guide.masks([seq_id])
    bits = np.unpackbits(np.frombuffer(masks.bits, dtype=np.uint8), bitorder="little")
    return bits[:guide.vocab_size].astype(bool)


def feed(guide: GuidedDecoding, token_ids: list[int], seq_id: int = 0) -> None:
    """Sample `token_ids`, each of which the mask must allow."""
    for token in token_ids:
        assert allowed(guide, seq_id)[token], token
        assert not guide.accept(seq_id, token)


def first(tokenizer, text: str) -> int:
    return tokenizer.encode_text(text, add_special_tokens=False)[0]


def test_the_constraint_applies_only_after_the_reasoning(tokenizer, compiler):
    guide = GuidedDecoding(compiler.vocab_size)
    guide.add(0, compiler.compile(GrammarSpec("json", SCHEMA, reasoning="inside")))
    words, brace = first(tokenizer, " Hello"), first(tokenizer, "{")
    assert allowed(guide)[[words, brace]].all()  # reasoning: any text
    feed(guide, tokenizer.encode_text("Let me see { not json</think>\n", add_special_tokens=False))
    now = allowed(guide)
    assert now[brace] and not now[words] and now.sum() < 100  # the answer: JSON only
    feed(guide, tokenizer.encode_text('{"a": 12}', add_special_tokens=False))
    assert guide.accept(0, tokenizer.eos_token_ids[0])


def test_optional_reasoning_may_be_skipped_or_taken(tokenizer, compiler):
    spec = GrammarSpec("json", SCHEMA, reasoning="optional")
    guide = GuidedDecoding(compiler.vocab_size)
    guide.add(0, compiler.compile(spec))
    guide.add(1, compiler.compile(spec))
    assert not allowed(guide, 0)[first(tokenizer, " Hello")]
    feed(guide, tokenizer.encode_text('{"a": 1}', add_special_tokens=False), 0)
    feed(guide, tokenizer.encode_text('<think>Hello there</think>{"a": 2}', add_special_tokens=False), 1)
    assert guide.accept(0, tokenizer.eos_token_ids[0]) and guide.accept(1, tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("budget", [1, 5])
def test_a_thinking_budget_forces_the_end_of_the_reasoning(tokenizer, compiler, budget):
    guide = GuidedDecoding(compiler.vocab_size)
    guide.add(0, compiler.compile(GrammarSpec("grammar", ANY_TEXT, reasoning="inside", reasoning_budget=budget)))
    words = tokenizer.encode_text(" and so on and so on", add_special_tokens=False)
    feed(guide, words[:budget])
    forced = allowed(guide)
    assert not forced[words[budget]] and not forced[tokenizer.eos_token_ids[0]]
    assert all(tokenizer.decode([int(t)]) in "</think>" for t in np.flatnonzero(forced))
    feed(guide, tokenizer.encode_text("</think>", add_special_tokens=False))
    assert allowed(guide)[words].all()  # the answer is free again
    assert guide.accept(0, tokenizer.eos_token_ids[0])


def test_a_forced_call_may_open_inside_the_reasoning(tokenizer, compiler):
    spec = GrammarSpec("json", SCHEMA, HERMES.forced_prefix, HERMES.forced_suffix, "tool_choice", reasoning="inside")
    for text in ['Call it.<tool_call>\n{"a": 3}\n</tool_call>', 'Call it.</think>\n<tool_call>\n{"a": 3}\n</tool_call>']:
        guide = GuidedDecoding(compiler.vocab_size)
        guide.add(0, compiler.compile(spec))
        feed(guide, tokenizer.encode_text(text, add_special_tokens=False))
        assert guide.accept(0, tokenizer.eos_token_ids[0])


CALLED = 'I need the tool.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("inside, text, reasoning, calls", [
    (True, CALLED, "I need the tool.", 1),
    (False, "<think>" + CALLED, "I need the tool.", 1),
    (True, "Short.</think>\n\nParis.", "Short.", 0),
])
def test_chat_replies_split_and_count_reasoning_alike_whole_and_streamed(tokenizer, inside, text, reasoning, calls):
    ids = tokenizer.encode_text(text, add_special_tokens=False)
    decode = tokenizer.decode
    whole = ChatShapes(None, tools=HERMES, reasoning=inside, decode=decode)
    message = whole.choice(0, Completion("r", text, ids, "stop"))["message"]
    assert message["reasoning_content"] == reasoning and len(message.get("tool_calls", [])) == calls
    streamed = ChatShapes(None, tools=HERMES, reasoning=inside, decode=decode)
    got, arguments = "", ""
    detok = tokenizer.detokenizer([])
    for i, token in enumerate(ids):
        delta = streamed.chunk_choice(0, Delta("r", detok.step(token), [token],
                                               "stop" if i == len(ids) - 1 else None))["delta"]
        got += delta.get("reasoning_content", "")
        arguments += "".join(c["function"]["arguments"] for c in delta.get("tool_calls", []))
    assert got == reasoning and (json.loads(arguments) == {"a": 1} if calls else arguments == "")
    spent = whole.reasoning_tokens(text, ids)
    assert spent == streamed.streamed_reasoning_tokens(0, ids)
    end = text.index(reasoning) + len(reasoning) + (0 if calls else len("</think>"))
    assert len(decode(ids[:spent])) >= end > len(decode(ids[:spent - 1]))
