"""Structured outputs: requests whose output must match a JSON schema, a regex, a list of
choices or a grammar (vLLM's `structured_outputs`, OpenAI's `response_format`).

    compiler = GrammarCompiler(tokenizer, vocab_size)  # engine/tokenizer.py's Tokenizer
    grammar = compiler.compile(spec)          # a frontend's thread; RequestError if bad
    guide = GuidedDecoding(vocab_size)        # the driver's engine
    guide.add(seq_id, grammar)
    masks = guide.masks([seq_id, ...])        # in each plan, for the sampling rank
    guide.accept(seq_id, token)               # after each step

xgrammar compiles a constraint into a pushdown automaton over the model's tokens and, per
step, fills a bitmask of the tokens that may come next. It was picked over llguidance (both
are CPU libraries) because it fills a mask faster, which is paid for every sampled sequence
in every step; compiling is paid once per schema, after which the grammar comes from the
cache.

NOTE: the matchers live on the driver, beside the scheduler (as vLLM v1 does): the driver
knows every token of a sequence when it plans its next step (a sequence is in one step at a
time, pipeline micro-batches included), so each plan carries the masks of the sequences it
samples, and the sampling rank applies them. Preemption and recompute leave the matcher as
it is, and no rank holds grammar state.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from meshserve.comm.messages import StructuredOutputs, TokenMasks
from meshserve.engine.admission import RequestError

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
Reasoning = Literal["", "inside", "optional"]
ANY_TEXT = "root ::= [^]*"
"""A grammar any output follows: the body of a constraint that only bounds the reasoning."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SPACE = r"[ \t\r\n]{0,4}"
"""What may stand between a reasoning block and what follows it; bounded, since small models
under a mask pad with whitespace."""
CACHE_ENTRIES = 512
"""Compiled grammars kept, most recently used first (xgrammar caches schemas too, but not
grammars built from parts)."""
_XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint, as any frontend names it. `value`: the schema as JSON text, the
    regex, the choices as a JSON list, or the EBNF grammar. `prefix` and `suffix`: literal
    text the output starts and ends with around it (a forced tool call's markers)."""

    kind: Kind
    value: str = ""
    prefix: str = ""
    suffix: str = ""
    param: str = "structured_outputs"
    """The request field it came from, named in errors."""
    reasoning: Reasoning = ""
    """With a reasoning parser (engine/serving/reasoning.py), the constraint applies only
    after the reply's reasoning, which is free text up to `</think>`: "inside", a reply that
    starts inside its reasoning; "optional", one that may open a `<think>` block first; "":
    the constraint applies from the first token."""
    reasoning_budget: int = 0
    """With `reasoning`: the most tokens the reasoning may take, after which `</think>` is
    forced (vLLM's thinking_token_budget); 0: no limit."""


def spec_from_message(so: StructuredOutputs, param: str = "structured_outputs") -> GrammarSpec:
    """The one constraint a StructuredOutputs names; RequestError unless exactly one."""
    given = [name for name in ("json", "regex", "choice", "grammar") if getattr(so, name) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        raise RequestError("bad_request", f"{param} must set exactly one of json, regex, choice, grammar and "
                                          f"json_object; it sets {given or 'none'}", param)
    kind = given[0]
    if kind == "json":
        return GrammarSpec("json", so.json if isinstance(so.json, str) else json.dumps(so.json), param=param)
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(so.choice), param=param)
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    return GrammarSpec(kind, getattr(so, kind), param=param)


def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)


class Grammar:
    """A compiled constraint; each sequence that follows it gets its own matcher."""

    def __init__(self, compiled: Any, spec: GrammarSpec):
        self.compiled, self.spec = compiled, spec

    def matcher(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer, caching by spec. Thread-safe; call it off the
    step loop (a frontend's tokenize pool): a cold compile takes milliseconds to a second."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        """`tokenizer`: the served model's (engine/tokenizer.py): its Hugging Face tokenizer
        (`.hf`) and EOS ids are read at the first compile."""
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self.cache_hits = 0

    def warm_up(self):
        """xgrammar's compiler, built on first use (its tokenizer table is built over the whole
        vocabulary): call it to build it now."""
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self._tokenizer.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of `spec`; RequestError (400, naming spec.param) if it does
        not compile."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                self.cache_hits += 1
                return cached
            try:
                grammar = Grammar(self._build(spec), spec)
            except (RuntimeError, ValueError, TypeError) as e:
                raise RequestError("bad_request", f"{spec.param}: the {spec.kind} constraint does not compile: "
                                                  f"{_clean(e)}", spec.param) from None
            self._cache[spec] = grammar
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return grammar

    def _build(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        compiler = self.warm_up()
        if spec.kind == "json":
            json.loads(spec.value)  # a clear error for text that is not JSON at all
            # NOTE: any_whitespace=False: JSON as json.dumps writes it (", ", ": "). With free
            # whitespace small models pad with newlines until max_tokens.
            body = xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
        elif spec.kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            body = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        elif spec.kind == "regex":
            body = xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            body = xgr.Grammar.from_ebnf("root ::= " + " | ".join(_literal(c) for c in choices))
        else:
            body = xgr.Grammar.from_ebnf(spec.value)
        if spec.reasoning:
            head = [_reasoning_head(spec.reasoning, spec.reasoning_budget, spec.prefix)]
        else:
            head = [xgr.Grammar.from_ebnf("root ::= " + _literal(spec.prefix))] if spec.prefix else []
        parts = head + [body] + ([xgr.Grammar.from_ebnf("root ::= " + _literal(spec.suffix))] if spec.suffix else [])
        return compiler.compile_grammar(xgr.Grammar.concat(*parts) if len(parts) > 1 else body)


def _reasoning_head(mode: Reasoning, budget: int, prefix: str) -> Any:
    """What comes before a constraint's body when it waits for the reasoning: free text (at
    most `budget` tokens) up to `</think>`, then at most a little whitespace and `prefix`.
    A forced tool call's opening marker (`prefix`) also ends a reasoning block the model left
    open, as the reply's reader takes it (engine/serving/reasoning.py)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (AnyTextFormat, ConstStringFormat, OptionalFormat, OrFormat, RegexFormat,
                                         SequenceFormat, StructuralTag, TagFormat)

    begin = "" if mode == "inside" else THINK_OPEN
    text = AnyTextFormat(max_tokens=budget or None)
    space = RegexFormat(pattern=_SPACE)
    closed = [TagFormat(begin=begin, content=text, end=THINK_CLOSE), space]
    if not prefix:
        head = SequenceFormat(elements=closed) if mode == "inside" else SequenceFormat(
            elements=[space, OptionalFormat(content=SequenceFormat(elements=closed))])
    else:
        opened = ConstStringFormat(value=prefix)
        ways = [SequenceFormat(elements=[*closed, opened]), TagFormat(begin=begin, content=text, end=prefix)]
        head = OrFormat(elements=ways) if mode == "inside" else SequenceFormat(
            elements=[space, OrFormat(elements=[*ways, opened])])
    return xgr.Grammar.from_structural_tag(StructuralTag(format=head))


def _clean(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGRAMMAR_NOISE.sub("", text)


class GuidedDecoding:
    """The driver's matchers, one per constrained sequence: the masks of a step's sampled
    sequences, and the tokens they were sampled."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._matchers: dict[int, Any] = {}
        self._batch = None

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    def add(self, seq_id: int, grammar: Grammar) -> None:
        self._matchers[seq_id] = grammar.matcher()

    def drop(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def masks(self, seq_ids: list[int], drafts: list[list[int]] | None = None) -> TokenMasks | None:
        """The allowed next tokens of those of `seq_ids` that are constrained (None if none
        is): one row for the sequence's next token, then one after each of its `drafts`
        (proposals valid_draft allowed). The first rows are filled in one batched call; a
        draft's rows by walking the matcher through it and back."""
        rows = [(s, d) for s, d in zip(seq_ids, drafts or [[]] * len(seq_ids)) if s in self._matchers]
        if not rows:
            return None
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        counts = [1 + len(d) for _, d in rows]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        bitmask = xgr.allocate_token_bitmask(sum(counts), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([self._matchers[s] for s, _ in rows], bitmask, starts)
        for (seq_id, draft), start in zip(rows, starts):
            matcher = self._matchers[seq_id]
            for j, token in enumerate(draft):
                matcher.accept_token(token)
                matcher.fill_next_token_bitmask(bitmask, start + 1 + j)
            if draft:
                matcher.rollback(len(draft))
        return TokenMasks([s for s, _ in rows], self.words, bitmask.numpy().tobytes(),
                          counts if any(d for _, d in rows) else [])

    def valid_draft(self, seq_id: int, draft: list[int]) -> list[int]:
        """The longest start of `draft` that `seq_id`'s constraint allows, short of a token
        that completes it (no row may follow one); the matcher is left as it was."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or not draft:
            return draft
        n = 0
        for token in draft:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                n -= 1
                matcher.rollback(1)
                break
        if n:
            matcher.rollback(n)
        return draft[:n]

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance `seq_id`'s matcher by `token`; True if the constraint is now complete (or
        the token broke it, which the mask rules out): nothing more may follow."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            return True
        return matcher.is_terminated()
