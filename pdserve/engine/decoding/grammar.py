"""Grammars: constrained decoding (structured output) with xgrammar.

A request with `SamplingParams.grammar` gets a `SequenceGrammar` per sequence (an xgrammar
GrammarMatcher): before its row samples, the matcher's token bitmask sets the logit of every
token that would leave the grammar's language to -inf (grammar_masks.py, filled while the
forward runs and applied before the sampler, so greedy, sampling, n choices, beams and
speculative verification all choose among allowed tokens), and each token appended advances
it. EOS is allowed only where the grammar may end (the matcher's stop tokens are the
model's EOS ids); the sequence finishes when the matcher terminates.

A matcher is rebuilt from the tokens so far wherever a request continues: the decode side of
a handoff builds it from the prompt and then accepts the prefill worker's first token like
any other, and a retry's continuation (a prompt that ends with the `seed_offset` tokens
already generated) feeds those tokens first. Choices fork their matcher with their blocks.

Compiling is per spec, cached (`GrammarSpec` is frozen): a second request with the same schema
compiles nothing. xgrammar (which imports torch) is imported on the first constrained request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.core.grammar_spec import GrammarError, GrammarSpec

CACHED_GRAMMARS = 256  # compiled grammars kept per engine, least recently used dropped


class SequenceGrammar:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advances past `token`; True when the grammar has ended (EOS accepted, or no token
        may follow), or when the token is outside it (min_tokens holding back the only EOS
        allowed): either way the sequence ends here."""
        return not self.matcher.accept_token(token) or self.matcher.is_terminated()

    def allowed_prefix(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of `drafts` (speculative guesses) the grammar accepts without
        ending: a draft it refuses, or one that ends it (its EOS), cuts them there, so every
        verified position has a grammar state to mask by. The matcher ends where it was."""
        fed = 0  # drafts the matcher took
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            fed += 1
            if self.matcher.is_terminated():
                break
        kept = fed - 1 if self.matcher.is_terminated() else fed
        self.matcher.rollback(fed)
        return list(drafts[:kept])

    def fork(self) -> SequenceGrammar:
        return SequenceGrammar(self.matcher.fork())


class Grammars:
    """An engine's grammar compiler and its cache of compiled grammars."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model_dir = model_dir
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)

    def start(self, spec: GrammarSpec, tokens_so_far: Sequence[int] = ()) -> SequenceGrammar:
        """A matcher at the grammar's start, advanced past `tokens_so_far` (a continuation's
        generated tokens). Raises GrammarError when the spec does not compile or the tokens
        leave the grammar."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self._compile(spec))
        for token in tokens_so_far:
            if not matcher.accept_token(token):
                raise GrammarError(
                    f"grammar: the tokens generated so far do not match it (token {token})"
                )
        return SequenceGrammar(matcher)

    def _compile(self, spec: GrammarSpec) -> Any:
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        compiler = self._compiler or self._make_compiler()
        try:
            compiled = _compile(compiler, spec)
        except RuntimeError as e:  # xgrammar's parse errors name the position and problem
            problem = str(e).strip().splitlines()[0]
            problem = problem.split(": ", 1)[-1] if problem.startswith("[") else problem
            raise GrammarError(f"grammar: the {spec.kind} does not compile: {problem}") from None
        self.compiles += 1
        self._compiled[spec] = compiled
        if len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _make_compiler(self) -> Any:
        import transformers
        import xgrammar

        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(self._model_dir / "tokenizer.json")
        )
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=self._vocab_size, stop_token_ids=self._eos_token_ids or None
        )
        # The grammar's caching is ours (by spec); xgrammar's own would hold every schema.
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as this class, which
# lets raw control characters in (JSON forbids them: json.loads refuses the output); its other
# strings use the right one.
_LAX_STRING_CHARACTER = r"[^\"\\\r\n]"
_STRING_CHARACTER = r"[^\"\\\0-\x1f]"


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_object":
        # xgrammar's built-in JSON grammar takes arrays too; OpenAI's json_object is an object.
        return compiler.compile_json_schema(
            '{"type": "object"}', strict_mode=False, any_whitespace=False
        )
    if spec.kind == "json_schema":
        # Compact JSON (no free whitespace): a model cannot pad its output with blanks
        # until it runs out of tokens. xgrammar's strict mode (no properties or items the
        # schema does not name) whatever `strict` says: that flag refuses ignored keywords.
        import xgrammar

        ebnf = str(xgrammar.Grammar.from_json_schema(spec.text, any_whitespace=False))
        return compiler.compile_grammar(ebnf.replace(_LAX_STRING_CHARACTER, _STRING_CHARACTER))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "choice":
        # EBNF string literals take JSON's escapes.
        return compiler.compile_grammar("root ::= " + " | ".join(_literal(c) for c in spec.choices))
    return compiler.compile_grammar(spec.text)


def _literal(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)
