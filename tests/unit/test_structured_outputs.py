"""Structured outputs in the engine (engine/structured.py): every schema of a set of
real-world shaped schemas yields output that validates (jsonschema, a validator nobody here
wrote), greedy and sampled, with SmolLM2; regex and choice likewise; a constrained and an
unconstrained request in one step each get what they asked for; bad constraints are a
RequestError naming the parameter."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from meshserve.comm.messages import SamplingParams, StructuredOutputs
from meshserve.engine.admission import RequestError
from meshserve.engine.offline import generate
from meshserve.engine.structured import GrammarCompiler, GrammarSpec, GuidedDecoding, spec_from_message
from support.engines import make_engine
from support.schemas import CHOICES, PROMPTS, REGEX, SCHEMAS


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2, "model.max_model_len=512")


@pytest.fixture(scope="module")
def compiler(engine):
    return GrammarCompiler(engine.tokenizer, engine.vocab_size)


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def json_spec(schema: dict) -> GrammarSpec:
    return spec_from_message(StructuredOutputs(json=schema))


def test_every_schema_validates_greedy_and_sampled(engine, compiler):
    names = list(SCHEMAS)
    prompts = [chat(engine, PROMPTS[n]) for n in names] * 2
    params = [SamplingParams(max_tokens=200, temperature=0)] * len(names) + [
        SamplingParams(max_tokens=200, temperature=0.8, seed=7 + i) for i in range(len(names))]
    grammars = [compiler.compile(json_spec(SCHEMAS[n])) for n in names] * 2
    results = generate(engine, prompts, params, grammars)
    for name, r in zip(names * 2, results):
        assert r.finish_reason == "stop", (name, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])


def test_regex_choice_json_object_and_an_unconstrained_request_in_one_step(engine, compiler):
    """Four requests run together: each constrained one matches its constraint, and the
    unconstrained one gets exactly the tokens it gets alone (its row pays no mask)."""
    prompt = chat(engine, "Name a city and a number.")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = generate(engine, [prompt], free)[0]
    specs = [spec_from_message(StructuredOutputs(regex=REGEX)), spec_from_message(StructuredOutputs(choice=CHOICES)),
             spec_from_message(StructuredOutputs(json_object=True)), None]
    params = [SamplingParams(max_tokens=40, temperature=0)] * 2 + [SamplingParams(max_tokens=60, temperature=0), free]
    results = generate(engine, [prompt] * 4, params, [compiler.compile(s) if s else None for s in specs])
    assert re.fullmatch(REGEX, results[0].text) and results[0].finish_reason == "stop"
    assert results[1].text in CHOICES and results[1].finish_reason == "stop"
    if results[2].finish_reason == "stop":
        assert isinstance(json.loads(results[2].text), dict)
    else:  # a free-form object may run long: a prefix of one, cut at max_tokens
        assert results[2].finish_reason == "length" and results[2].text.startswith("{")
    assert results[3].token_ids == alone.token_ids


def test_max_tokens_inside_a_structure_ends_with_length(engine, compiler):
    grammar = compiler.compile(json_spec(SCHEMAS["order"]))
    r = generate(engine, [chat(engine, PROMPTS["order"])], SamplingParams(max_tokens=5, temperature=0), [grammar])[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 5 and r.text.startswith("{")


def test_masks_only_for_constrained_sequences(compiler):
    guide = GuidedDecoding(compiler.vocab_size)
    assert guide.masks([0, 1, 2]) is None  # nothing constrained: no mask in the plan at all
    guide.add(1, compiler.compile(spec_from_message(StructuredOutputs(choice=CHOICES))))
    masks = guide.masks([0, 1, 2])
    assert masks.seq_ids == [1] and masks.words == (compiler.vocab_size + 31) // 32
    assert len(masks.bits) == 4 * masks.words
    guide.drop(1)
    assert not guide and guide.masks([1]) is None


def test_a_draft_is_cut_where_the_grammar_stops_allowing_it_and_gets_a_mask_per_row(engine, compiler):
    """valid_draft keeps the proposals the constraint allows (short of the one completing it);
    masks gives one row for the next token and one after each kept proposal, each the mask
    of a matcher walked there one token at a time, and leaves the matcher where it was."""
    import numpy as np

    grammar = compiler.compile(spec_from_message(StructuredOutputs(choice=["Paris is big", "Pisa"])))
    tokens = engine.tokenizer.encode_text("Paris is big", add_special_tokens=False)
    guide = GuidedDecoding(compiler.vocab_size)
    guide.add(3, grammar)
    bad = engine.tokenizer.encode_text("Rome", add_special_tokens=False)[0]
    assert guide.valid_draft(3, tokens[:2] + [bad, tokens[2]]) == tokens[:2]
    eos = engine.tokenizer.eos_token_ids[0]
    assert guide.valid_draft(3, tokens + [eos]) == tokens  # the completing token is sampled, never drafted
    masks = guide.masks([7, 3], [[1, 2], tokens])
    assert masks.seq_ids == [3] and masks.rows == [1 + len(tokens)]
    got = np.frombuffer(masks.bits, dtype=np.int32).reshape(-1, masks.words)
    walker = grammar.matcher()
    for row, token in enumerate(tokens + [eos]):
        want = np.zeros((1, masks.words), dtype=np.int32)
        walker.fill_next_token_bitmask(want, 0)
        assert (got[row] == want[0]).all()
        assert got[row][token // 32] >> (token % 32) & 1  # the token that follows is allowed
        walker.accept_token(token)
    assert guide.valid_draft(3, tokens) == tokens  # the matcher was rolled back: it still starts at the start


def test_speculation_under_a_grammar_gives_the_output_without_it(engine, smollm2, compiler):
    """n-gram drafts for constrained requests (JSON schemas, a regex) are cut to what the
    grammar allows and verified under a mask per row: greedy and seeded output is the
    output without speculation, and drafts were kept."""
    spec = make_engine(smollm2, "model.max_model_len=512", "speculative.method=ngram", "speculative.adaptive=false")
    names = list(SCHEMAS)
    prompts = [chat(engine, PROMPTS[n]) for n in names] + [chat(engine, "Name a city and a number.")] * 2
    grammars = [compiler.compile(json_spec(SCHEMAS[n])) for n in names]
    grammars += [compiler.compile(spec_from_message(StructuredOutputs(regex=REGEX)))] * 2
    params = [SamplingParams(max_tokens=120, temperature=0)] * (len(names) + 1)
    params += [SamplingParams(max_tokens=40, temperature=0.8, seed=3)]
    want = generate(engine, prompts, params, grammars)
    got = generate(spec, prompts, params, grammars)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert spec.speculator.stats.num_accepted_tokens > 20


def test_compiled_grammars_are_cached_by_spec(compiler):
    spec = json_spec({"type": "object", "properties": {"x": {"type": "integer"}}})
    first = compiler.compile(spec)
    hits = compiler.cache_hits
    assert compiler.compile(json_spec({"type": "object", "properties": {"x": {"type": "integer"}}})) is first
    assert compiler.cache_hits == hits + 1


@pytest.mark.parametrize("so,fragment", [
    (StructuredOutputs(json={"type": "objec"}), 'Unsupported type "objec"'),
    (StructuredOutputs(json="{not json"), "does not compile"),
    (StructuredOutputs(regex="(unclosed"), "parenthesis"),
    (StructuredOutputs(grammar="root ::= foo"), 'Rule "foo" is not defined'),
    (StructuredOutputs(choice=[]), "non-empty list"),
])
def test_a_constraint_that_does_not_compile_is_a_request_error(compiler, so, fragment):
    with pytest.raises(RequestError) as e:
        compiler.compile(spec_from_message(so, "response_format"))
    assert e.value.code == "bad_request" and e.value.param == "response_format"
    assert fragment in e.value.message and "/project/" not in e.value.message


@pytest.mark.parametrize("so", [StructuredOutputs(), StructuredOutputs(regex="a", choice=["a"])])
def test_exactly_one_constraint(so):
    with pytest.raises(RequestError, match="exactly one of") as e:
        spec_from_message(so, "structured_outputs")
    assert e.value.param == "structured_outputs"
