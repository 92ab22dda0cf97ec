"""min_tokens by masking (sampler.py, vLLM's min_tokens): until a request has min_tokens output
tokens its stop tokens (EOS, stop_token_ids) are at -inf, so they are never chosen. On a tiny
model whose EOS is made its greedy first token, greedy output equals transformers'
`generate(min_new_tokens=...)` (MinNewTokensLengthLogitsProcessor masks EOS the same way),
with and without speculation (verification masks each position as the plain sampler), and a
seeded sampled request never emits a stop token before min_tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.draft_of import write_draft_of
from pdserve.tokenizer import Tokenizer
from tests.engine.conftest import random_prompts

PROMPT = random_prompts([9], seed=11)[0]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def eos_first(tiny_dir, hf_tiny, tmp_path_factory):
    """The tiny model with its greedy first token after PROMPT made its EOS: (dir, EOS ids)."""
    with torch.inference_mode():
        first = int(hf_tiny(torch.tensor([PROMPT])).logits[0, -1].argmax())
    out = tmp_path_factory.mktemp("eos-first") / "model"
    shutil.copytree(tiny_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            config = json.loads(path.read_text())
            config["eos_token_id"] = first
            path.write_text(json.dumps(config))
    eos = Tokenizer.from_dir(out).eos_token_ids
    assert first in eos
    return out, eos


def engine(model_dir, method=None, draft=None) -> LLMEngine:
    spec = {}
    if method:
        spec["speculative"] = SpeculativeConfig(
            method=method,
            draft_model=None if draft is None else str(draft),
            num_speculative_tokens=3,
            min_acceptance=0.0,
        )
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=256, **spec))


def transformers_greedy(hf, eos: list[int], min_tokens: int) -> list[int]:
    out = hf.generate(
        torch.tensor([PROMPT]),
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=min_tokens,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("min_tokens", [0, 1, 5])
def test_greedy_equals_transformers_min_new_tokens(eos_first, hf_tiny, min_tokens):
    model_dir, eos = eos_first
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=min_tokens)
    [tokens] = engine(model_dir).generate([PROMPT], params)
    assert tokens == transformers_greedy(hf_tiny, eos, min_tokens)
    assert not set(tokens[:min_tokens]) & set(eos)
    if min_tokens == 0:
        assert tokens == [eos[0]]  # the EOS is the greedy first token
    else:
        assert len(tokens) > min_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_masks_each_position_as_the_plain_sampler(eos_first, tmp_path, method):
    model_dir, eos = eos_first
    draft = write_draft_of(model_dir, tmp_path / "draft", 1)[0] if method == "draft" else None
    base = SamplingParams(max_tokens=32, min_tokens=10)
    kinds = [
        base,
        dataclasses.replace(base, temperature=1.0, seed=3),
        dataclasses.replace(base, temperature=0.8, top_k=5, seed=4),
    ] * 3
    # Prompts that repeat themselves: prompt lookup proposes.
    prompts = [p * 4 for p in random_prompts([4] * len(kinds), seed=8)]
    prompts[0] = PROMPT  # whose greedy first token is the EOS
    plain = engine(model_dir).generate(prompts, kinds)
    spec = engine(model_dir, method, draft)
    assert spec.generate(prompts, kinds) == plain
    assert spec.stats()["spec_verify_steps"] > 0


def test_a_sampled_request_never_draws_a_stop_token_before_min_tokens(eos_first):
    model_dir, eos = eos_first
    stop = random_prompts([1], seed=2)[0][0]
    base = SamplingParams(
        max_tokens=MAX_TOKENS, min_tokens=8, temperature=5.0, stop_token_ids=[stop]
    )
    params = [dataclasses.replace(base, seed=s) for s in range(40)]
    outputs = engine(model_dir).generate([PROMPT] * len(params), params)
    for tokens in outputs:
        assert len(tokens) > 8
        assert not set(tokens[:8]) & {*eos, stop}
