"""Speculative decoding of constrained requests: drafts are cut at the first token the grammar
refuses (or that ends it), each verified position is masked by the grammar after the drafts
before it, so the output is the non-speculative constrained output token for token, with
prompt lookup (ngram) and with a draft model, greedy and seeded, and drafts were accepted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.core.grammar_spec import GrammarSpec
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.draft_of import write_draft_of
from tests.engine.conftest import random_prompts

# Records whose keys repeat: prompt lookup finds them in the output so far.
RECORDS = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
    },
}
SCHEMA = GrammarSpec("json_schema", json.dumps(RECORDS))
PROMPTS = random_prompts([4, 9, 15], seed=29)
PARAMS = [
    SamplingParams(max_tokens=160, grammar=SCHEMA),
    SamplingParams(max_tokens=160, temperature=1.0, seed=7, grammar=SCHEMA),
]


@pytest.fixture(scope="module")
def draft_dir(tiny_dir, tmp_path_factory):
    """The tiny model's first layer (of two): its drafts are often wrong, and often refused."""
    return write_draft_of(tiny_dir, tmp_path_factory.mktemp("draft"), 1)[0]


def engine_for(tiny_dir, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(tiny_dir),
            block_size=4,
            num_kv_blocks=256,
            speculative=speculative or SpeculativeConfig(),  # the default: off
        )
    )


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_constrained_speculation_equals_the_plain_constrained_output(
    tiny_dir, draft_dir, method, params
):
    expected = engine_for(tiny_dir).generate(PROMPTS, params)
    draft = str(draft_dir) if method == "draft" else None
    speculative = SpeculativeConfig(
        method=method, draft_model=draft, num_speculative_tokens=4, min_acceptance=0.0
    )
    engine = engine_for(tiny_dir, speculative)
    assert engine.generate(PROMPTS, params) == expected
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert stats["num_used_blocks"] == 0, stats
    for tokens in expected:
        assert tokens[-1] in engine.eos_token_ids  # every output ended with its grammar
        jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), RECORDS)


def test_drafts_are_cut_where_the_grammar_refuses_or_ends(tiny_dir):
    engine = engine_for(tiny_dir)
    choice = GrammarSpec("choice", choices=("yes", "no"))
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    eos = min(engine.eos_token_ids)
    grammar = engine.grammars.start(choice)
    assert grammar.allowed_prefix([*yes, eos, *yes]) == yes  # EOS ends it: not verified
    refused = engine.tokenizer.encode("x", add_special_tokens=False)
    assert grammar.allowed_prefix([*yes[:1], *refused, *yes]) == yes[:1]
    assert grammar.allowed_prefix(refused) == []
    # The matcher ends where it started: the whole answer still goes through it.
    assert all(grammar.matcher.accept_token(t) for t in [*yes, eos])
    assert grammar.matcher.is_terminated()
