"""The per-token outputs of a step (step_outputs.py) do not depend on text: an engine without
text (emit_text=False, no detokenizer) and one with a detokenizer on every sequence produce the
same outputs, text aside, for plain, n > 1, prefix-hit, stop-token, length-limited and logprob
requests; and a mid-stream output carries every field."""

from __future__ import annotations

import dataclasses

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from tests.sim.conftest import sim_config

SHARED = list(range(40, 48))  # two full blocks of 4: a prefix-cache hit for later requests


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> list:
    engine.add_request("warm", SHARED + [3], SamplingParams(max_tokens=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def _engines(sim_model_dir, **overrides) -> tuple[LLMEngine, LLMEngine]:
    config = sim_config(sim_model_dir, time_scale=1e-6, **overrides)
    return LLMEngine(config, emit_text=False), LLMEngine(config, emit_text=True)


def test_outputs_with_and_without_text_are_the_same(sim_model_dir):
    plain, texted = _engines(sim_model_dir, max_model_len=40)
    # The tokens a plain request produces, to stop another one on its third token.
    probe = plain.generate([SHARED + [9, 9]], SamplingParams(max_tokens=6))[0]
    requests = [
        ("plain", SHARED + [5, 6, 7], SamplingParams(max_tokens=7)),
        ("choices", SHARED + [8], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=4)),
        ("stop", SHARED + [9, 9], SamplingParams(max_tokens=6, stop_token_ids=[probe[2]])),
        ("context", list(range(200, 236)), SamplingParams(max_tokens=50)),  # max_model_len
        (
            "logprobs",
            [7, 8, 9],
            SamplingParams(max_tokens=4, temperature=0.8, seed=2, logprobs=True),
        ),
        ("eos", [11, 12], SamplingParams(max_tokens=3, ignore_eos=True)),
    ]
    texted.generate([SHARED + [9, 9]], SamplingParams(max_tokens=6))
    got = _run(plain, requests)
    want = [dataclasses.replace(out, text_delta="") for out in _run(texted, requests)]
    assert got == want
    finished = {out.request_id: out.finish_reason for out in got if out.finished}
    assert finished["stop"] == "stop" and finished["context"] == "length"
    assert sum(out.finished for out in got if out.request_id == "choices") == 3
    assert any(out.new_logprobs for out in got if out.request_id == "logprobs")


def test_a_mid_stream_output_fills_each_field(sim_model_dir):
    """Distinct values in every field of an output that ends nothing."""
    plain, _ = _engines(sim_model_dir)
    outputs = _run(plain, [("r", SHARED + [5, 6, 7], SamplingParams(max_tokens=4, n=2))])
    middle = [out for out in outputs if out.request_id == "r" and not out.finished]
    assert {out.index for out in middle} == {0, 1}
    for out in middle:
        assert len(out.new_token_ids) == 1
        assert out == RequestOutput(
            request_id="r",
            new_token_ids=out.new_token_ids,
            num_prompt_tokens=11,
            num_cached_tokens=8,
            index=out.index,
            open_choices=2,
        )
