"""Beam search equals transformers' `generate(num_beams=k, num_return_sequences=n,
do_sample=False, length_penalty, early_stopping)` on Llama, Mistral and Qwen2 test models:
the same returned token ids and the same scores (sequences_scores), for 8 prompts, with
hypotheses ending by stop tokens and by length, run as one batch next to a sampled request."""

from __future__ import annotations

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from tests.engine.conftest import random_prompts

transformers = pytest.importorskip("transformers")
from tests.models.test_llama_matches_transformers import VOCAB, make_hf_model  # noqa: E402

PROMPTS = random_prompts([5, 8, 11, 3, 16, 9, 7, 13], seed=21, vocab=VOCAB)
MAX_TOKENS = 7
EOS = 1
# (beam_width, n, length_penalty, early_stopping)
SETTINGS = [(4, 2, 1.0, False), (3, 3, 0.5, True), (2, 1, 2.0, False)]


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2"])
def models(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(directory, request.param)
    config = EngineConfig(model=str(directory), block_size=4, num_kv_blocks=512)
    return hf, config


def stop_token(hf, prompt: list[int]) -> int:
    """A token the model likes early on (its greedy second token): some beams end on it."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return int(out[0, -1])


def hf_beams(hf, prompt, stop, width, n, length_penalty, early_stopping):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=[stop, EOS],
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    tokens = [out.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist() for i in range(n)]
    return tokens, out.sequences_scores.tolist()


def beam_cases(hf, prompts, max_tokens, width, n, length_penalty, early_stopping):
    """Beam-search requests over `prompts` ("b0", "b1", ...: prompt and params, each stopped by
    its own likely token) and transformers' answers to them (`hf_beams`)."""
    requests, expected = {}, {}
    for i, prompt in enumerate(prompts):
        stop = stop_token(hf, prompt)
        params = SamplingParams(
            max_tokens=max_tokens,
            beam_width=width,
            n=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=[stop],
        )
        requests[f"b{i}"] = (prompt, params)
        expected[f"b{i}"] = hf_beams(hf, prompt, stop, width, n, length_penalty, early_stopping)
    return requests, expected


def run_engine(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, dict[int, object]] = {rid: {} for rid in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                got[out.request_id][out.index] = out
    return got


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "k{}-n{}-lp{}-es{}".format(*s))
def test_beam_search_equals_transformers(models, setting):
    hf, config = models
    width, n, length_penalty, early_stopping = setting
    engine = LLMEngine(config)
    requests, expected = beam_cases(
        hf, PROMPTS, MAX_TOKENS, width, n, length_penalty, early_stopping
    )
    # An ordinary sampled request shares the batch with the beams.
    requests["sampled"] = (PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    got = run_engine(engine, requests)
    for rid, (tokens, scores) in expected.items():
        outs = got[rid]
        assert sorted(outs) == list(range(n)), rid
        assert [outs[i].new_token_ids for i in range(n)] == tokens, rid
        assert [outs[i].score for i in range(n)] == pytest.approx(scores, abs=1e-4), rid
        stops = (EOS, *requests[rid][1].stop_token_ids)
        reasons = ["stop" if t[-1] in stops else "length" for t in tokens]
        assert [outs[i].finish_reason for i in range(n)] == reasons, rid
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0
    engine.block_manager.check_invariants()


BEAM = SamplingParams(max_tokens=6, beam_width=3, n=2, length_penalty=0.7, ignore_eos=True)


def beams_of(outs: dict) -> list[tuple[list[int], float]]:
    return [(outs[i].new_token_ids, round(outs[i].score, 4)) for i in sorted(outs)]


@pytest.mark.parametrize("warm", [0, 8], ids=["cold", "prefix-hit"])
def test_handoff_beam_search_equals_colocated(make_engine, warm):
    """The prefill engine computes the prompt; the decode engine recomputes its last position
    for the first candidates and runs the search."""
    prompt = random_prompts([10], seed=31)[0]
    expected = beams_of(run_engine(make_engine(), {"r": (prompt, BEAM)})["r"])
    prefill, decode = make_engine(), make_engine()
    if warm:
        decode.generate([prompt[:warm] + [3]], SamplingParams(max_tokens=1))
    prefill.add_request("r", prompt, BEAM, prefill_only=True)
    first = prefill.step()[0]
    assert first.finish_reason == "prefill"
    reservation = decode.reserve("r", prompt, BEAM)
    assert reservation.num_cached_tokens == warm
    src = [first.block_ids[i] for i in reservation.missing_block_indices]
    dst = [reservation.block_ids[i] for i in reservation.missing_block_indices]
    decode.write_kv(dst, 0, prefill.read_kv(src, 0, prefill.num_layers))
    prefill.release("r")
    decode.commit("r", first.new_token_ids[0], None)
    got: dict[int, object] = {}
    while decode.has_unfinished():
        got.update({out.index: out for out in decode.step() if out.finished})
    assert beams_of(got) == expected
    assert decode.stats()["num_free_blocks"] == decode.stats()["num_blocks"]


def test_preempted_beams_are_recomputed_and_the_search_is_unchanged(make_engine):
    """Few blocks: beams get preempted and recomputed mid-search; same beams as with room."""
    prompts = random_prompts([9, 11, 10], seed=33)
    requests = {f"r{i}": (p, BEAM) for i, p in enumerate(prompts)}
    roomy = run_engine(make_engine(), requests)
    tight_engine = make_engine(num_kv_blocks=16)
    tight = run_engine(tight_engine, requests)
    assert tight_engine.stats()["num_preemptions"] > 0
    for rid in requests:
        assert beams_of(tight[rid]) == beams_of(roomy[rid]), rid
    assert tight_engine.stats()["num_free_blocks"] == 16


def test_aborting_a_beam_search_frees_every_block(make_engine):
    engine = make_engine()
    engine.add_request("r", random_prompts([9], seed=34)[0], BEAM)
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_running"] == 3
    engine.abort("r")
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    engine.block_manager.check_invariants()
