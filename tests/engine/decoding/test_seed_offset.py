"""A seeded request continued from a prompt that carries its first tokens (a router retry)
samples the same tokens as the uninterrupted run, given `seed_offset`."""

from __future__ import annotations

import dataclasses

from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts


def test_a_continuation_with_seed_offset_samples_the_rest_of_the_uninterrupted_run(make_engine):
    prompt = random_prompts([9], seed=5)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    [whole] = make_engine().generate([prompt], params)
    for done in (1, 5):
        rest = dataclasses.replace(params, max_tokens=12 - done, seed_offset=done)
        [tail] = make_engine().generate([prompt + whole[:done]], rest)
        assert tail == whole[done:]
