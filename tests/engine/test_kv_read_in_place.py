"""The engine reads decode rows' KV in place on CPU (pdserve/models/native_attention.py) and
gives the same greedy tokens as with the gathering path."""

from __future__ import annotations

import os

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.models import native_attention
from tests.engine.conftest import random_prompts


@pytest.mark.skipif(
    os.environ.get(native_attention.DISABLE_ENV) == "0", reason="switched off for this run"
)
def test_the_engine_gives_the_same_greedy_tokens_with_and_without_the_kernel(make_engine):
    prompts = random_prompts([3, 17, 40, 9, 1, 26])

    def run(in_place: bool) -> dict[str, list[int]]:
        engine = make_engine(max_num_batched_tokens=32)  # prompts in chunks beside decodes
        assert engine.runner.reads_kv_in_place
        engine.runner.reads_kv_in_place = in_place
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    read_in_place = run(True)
    assert all(len(t) == 24 for t in read_in_place.values())
    assert read_in_place == run(False)
