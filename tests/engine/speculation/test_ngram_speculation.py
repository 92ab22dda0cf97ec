"""Speculative decoding with prompt lookup (ngram) in the engine: greedy output is the
non-speculative greedy output (and transformers') token for token for every k, alone and
batched with requests that do not speculate, with chunked prefill, under preemption, with
n > 1 and with prefix-cache hits; rejected drafts leave no blocks behind; seeded sampled
requests are reproducible; stop conditions cut an accepted run at the right token; the
speculation switches itself off when nothing is accepted."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.config import ConfigError
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.speculation.ngram_proposer import NgramProposer, lookup
from pdserve.engine_config import EngineConfig, SpeculativeConfig
from pdserve.models.builtin import make_model
from tests.engine.conftest import random_prompts
from tests.models.hf_reference import hf_greedy

MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose text repeats (so lookup finds matches) and plain random ones."""
    a, b, c = random_prompts([10, 7, 23], seed=5)
    return [a * 3, b * 4 + [9], c, a[:4] + c + a[:4], [5, 6] * 9]


def spec_engine(model_dir, k: int = 4, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), block_size=4, num_kv_blocks=128)
    settings.update(overrides)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
    return LLMEngine(EngineConfig(**settings, speculative=spec))


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts()


@pytest.fixture(scope="module")
def expected(make_engine_module, prompts):
    return make_engine_module().generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def make_engine_module(tiny_dir):
    def make(**overrides) -> LLMEngine:
        settings = dict(model=str(tiny_dir), block_size=4, num_kv_blocks=128)
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings))

    return make


def assert_accepted_some(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equals_plain_greedy_for_every_k(tiny_dir, prompts, expected, k):
    engine = spec_engine(tiny_dir, k)
    assert engine.generate(prompts, GREEDY) == expected
    assert_accepted_some(engine)
    stats = engine.stats()
    assert stats["num_used_blocks"] == 0
    engine.block_manager.check_invariants()


def test_greedy_equals_transformers(tiny_dir, hf_tiny, prompts):
    engine = spec_engine(tiny_dir, 4)
    assert engine.generate(prompts, GREEDY) == hf_greedy(hf_tiny, prompts, MAX_TOKENS)
    assert_accepted_some(engine)


def test_greedy_equals_transformers_on_the_small_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    small = make_model(tmp_path_factory.mktemp("small"), "small", seed=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(small).eval()
    prompts = [p[:12] for p in repetitive_prompts()[:3]]
    engine = spec_engine(small, 4, block_size=16, num_kv_blocks=32)
    assert engine.generate(prompts, dataclasses.replace(GREEDY, max_tokens=24)) == hf_greedy(
        hf, prompts, 24
    )
    assert engine.stats()["spec_verify_steps"] > 0


def test_batched_with_requests_that_do_not_speculate(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 4)
    plain = dataclasses.replace(GREEDY, speculative=False)
    params = [GREEDY if i % 2 else plain for i in range(len(prompts))]
    assert engine.generate(prompts, params) == expected
    assert_accepted_some(engine)


def test_opted_out_requests_are_never_speculated(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 4)
    plain = dataclasses.replace(GREEDY, speculative=False)
    assert engine.generate(prompts, plain) == expected
    assert engine.stats()["spec_draft_tokens"] == 0


def test_chunked_prefill_and_a_small_token_budget(tiny_dir, prompts, expected):
    # 6 tokens a step: drafts are trimmed to the budget left after prefill chunks.
    engine = spec_engine(tiny_dir, 8, max_num_batched_tokens=6)
    assert engine.generate(prompts, GREEDY) == expected
    assert_accepted_some(engine)
    assert engine.stats()["num_used_blocks"] == 0


def test_preemption_in_a_tiny_kv_pool(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 8, num_kv_blocks=22)
    assert engine.generate(prompts, GREEDY) == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0, stats
    assert_accepted_some(engine)
    assert stats["num_used_blocks"] == 0
    engine.block_manager.check_invariants()


def test_n_choices_speculate_alike(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 4)
    params = dataclasses.replace(GREEDY, n=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    for i, want in enumerate(expected):
        assert [got[(f"r{i}", c)] for c in range(3)] == [want] * 3
    assert_accepted_some(engine)
    assert engine.stats()["num_used_blocks"] == 0


def test_prefix_cache_hits(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 4)
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["prefix_hit_tokens"] >= sum(len(p) - 4 for p in prompts)
    # Requests that continue the earlier outputs hit blocks the speculation cached.
    extended = [p + out[:20] for p, out in zip(prompts, expected, strict=True)]
    plain = LLMEngine(dataclasses.replace(engine.config, speculative=SpeculativeConfig()))
    hits = engine.stats()["prefix_hit_tokens"]
    assert engine.generate(extended, GREEDY) == plain.generate(extended, GREEDY)
    assert engine.stats()["prefix_hit_tokens"] > hits


def test_rejected_drafts_never_enter_the_prefix_cache(tiny_dir, prompts):
    engine = spec_engine(tiny_dir, 8)
    outputs = engine.generate(prompts, GREEDY)
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats
    texts = [p + o for p, o in zip(prompts, outputs, strict=True)]
    cached = [t for t in engine.block_manager._tokens if t is not None]  # noqa: SLF001
    assert cached
    for tokens in cached:  # each cached block holds a run of some prompt + output
        assert any(_contains(text, tokens) for text in texts), tokens


def _contains(haystack: list[int], needle: tuple[int, ...]) -> bool:
    n = len(needle)
    return any(tuple(haystack[i : i + n]) == needle for i in range(len(haystack) - n + 1))


def test_stop_token_and_max_tokens_cut_an_accepted_run(tiny_dir, prompts, expected):
    i = max(range(len(prompts)), key=lambda j: len(set(expected[j][5:])) < len(expected[j][5:]))
    stop_at = 7
    stop = expected[i][stop_at]
    first = expected[i].index(stop)
    params = dataclasses.replace(GREEDY, stop_token_ids=[stop])
    for engine in (spec_engine(tiny_dir, 8), None):
        engine = engine or LLMEngine(
            dataclasses.replace(spec_engine(tiny_dir).config, speculative=SpeculativeConfig())
        )
        engine.add_request("r", prompts[i], params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert sum((o.new_token_ids for o in outs), []) == expected[i][: first + 1]
        assert outs[-1].finish_reason == "stop"
    engine = spec_engine(tiny_dir, 8)
    got = engine.generate([prompts[i]], dataclasses.replace(GREEDY, max_tokens=11))
    assert got == [expected[i][:11]]


def test_outputs_carry_every_accepted_token_with_text_and_logprobs(tiny_dir, prompts, expected):
    engine = spec_engine(tiny_dir, 8)
    plain = LLMEngine(dataclasses.replace(engine.config, speculative=SpeculativeConfig()))
    params = dataclasses.replace(GREEDY, logprobs=True)
    results = []
    for eng in (engine, plain):
        eng.add_request("r", prompts[0], params)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        results.append(outs)
    spec_outs, plain_outs = results
    assert max(len(o.new_token_ids) for o in spec_outs) > 1  # several tokens in one output
    assert len(spec_outs) < len(plain_outs)
    for field in ("new_token_ids", "new_logprobs"):
        got = sum((getattr(o, field) for o in spec_outs), [])
        want = sum((getattr(o, field) for o in plain_outs), [])
        assert got == pytest.approx(want, abs=1e-4)
    assert "".join(o.text_delta for o in spec_outs) == "".join(o.text_delta for o in plain_outs)
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in spec_outs)


def test_seeded_sampled_requests_are_reproducible(tiny_dir, prompts):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
    runs = [spec_engine(tiny_dir, 4).generate(prompts, params) for _ in range(2)]
    assert runs[0] == runs[1]


def test_switches_itself_off_when_nothing_is_accepted(tiny_dir):
    class Wrong(NgramProposer):
        """Proposes k tokens no greedy step of this model picks (0 is the pad token)."""

        def propose(self, seqs, k):
            self._num_proposed = len(seqs)
            return [[0] * k for _ in seqs]

    engine = spec_engine(tiny_dir, 4)
    engine._speculation.proposer = Wrong()  # noqa: SLF001
    config = engine.config.speculative
    prompt = random_prompts([8], seed=2)[0]
    out = engine.generate([prompt], dataclasses.replace(GREEDY, max_tokens=200))
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == 0
    assert stats["spec_paused"] == 1
    steps = 200
    # The window fills once, then one probe step every probe_interval steps.
    most = config.acceptance_window // 4 + steps // config.probe_interval + 1
    assert stats["spec_verify_steps"] <= most, stats
    plain = LLMEngine(dataclasses.replace(engine.config, speculative=SpeculativeConfig()))
    assert out == plain.generate([prompt], dataclasses.replace(GREEDY, max_tokens=200))


def test_sim_engine_never_speculates(tiny_dir, prompts):
    spec = SpeculativeConfig(method="ngram")
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), kind="sim", block_size=4, speculative=spec)
    )
    engine.generate(prompts[:2], dataclasses.replace(GREEDY, max_tokens=8))
    assert engine.stats()["spec_draft_tokens"] == 0


def test_config_checks():
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


def test_lookup_continues_the_earliest_occurrence_of_the_longest_suffix():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 3, 1) == [9, 1, 2]
    assert lookup([5, 1, 2, 6, 2], 2, 3, 1) == [6, 2]  # only the 1-gram [2] matches
    assert lookup([1, 2, 3, 4], 4, 3, 1) == []  # no suffix occurred before
    assert lookup([7, 7], 4, 3, 1) == [7]
    # Token 0x201's bytes occur inside 0x1000000, 2 (misaligned): not a match.
    assert lookup([0x1000000, 2, 0x201], 2, 1, 1) == []
    assert lookup([1, 0, 0, 0, 2, 1], 2, 1, 1) == [0, 0]


@pytest.mark.parametrize("n", [1, 3])
def test_disaggregated_decode_speculates_and_equals_one_engine(tiny_dir, prompts, expected, n):
    from tests.engine.test_disaggregation import handoff

    prefill = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=128))
    decode = spec_engine(tiny_dir, 4)
    params = dataclasses.replace(GREEDY, n=n)
    for i, prompt in enumerate(prompts):
        got, _ = handoff(prefill, decode, f"r{i}", prompt, params)
        assert sorted(got) == sorted(expected[i] * n)  # every choice is the greedy output
    assert_accepted_some(decode)
    assert decode.stats()["num_used_blocks"] == 0


def test_drafts_never_crowd_out_other_running_sequences(tiny_dir, prompts, expected):
    # A budget of 7 tokens and 5 running sequences: drafts get only what is left over, even
    # for the first-arrived sequence (prompt 3, whose output repeats at once).
    engine = spec_engine(tiny_dir, 8, max_num_batched_tokens=7)
    plain = dataclasses.replace(GREEDY, speculative=False)
    order = [3, 0, 1, 2, 4]
    for i in order:
        long = dataclasses.replace(GREEDY, max_tokens=300)  # still running when all decode
        engine.add_request(f"r{i}", prompts[i], long if i == 3 else plain)
    got: dict[str, list[int]] = {f"r{i}": [] for i in order}
    crowded = 0
    while engine.has_unfinished():
        decoding = [s for s in engine.scheduler.running if s.num_output_tokens >= 1]
        drafted = engine.stats()["spec_draft_tokens"]
        outs = engine.step()
        if len(decoding) == len(prompts):  # every one decodes: every one gets its token
            assert {o.request_id for o in outs} == set(got)
            crowded += engine.stats()["spec_draft_tokens"] > drafted
        for out in outs:
            got[out.request_id] += out.new_token_ids
    assert crowded > 0  # steps that verified drafts while all five decoded
    got["r3"] = got["r3"][:MAX_TOKENS]
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
